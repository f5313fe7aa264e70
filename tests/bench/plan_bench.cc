// The planner at scale: a DeepSeek-like 1.4T-parameter MoE checkpoint of ~100k
// tensors (128 layers x 256 experts x gate/up/down, plus embeddings), HSDP over M
// trainer ranks (a mesh [M / 8, 8]: replicate x Shard(0), as hybrid-sharded MoE
// training places them; replicated blocks spread over their holders), expert-parallel
// over N workers (each holds whole
// experts e with e % N == worker; embeddings and norms replicated). Reports the
// median of ROUNDS plans with their spread: plan_transfer, layout_digest (what a
// cache hit costs), and the plan's size.
//   bazel run -c opt //tests/bench:plan_bench -- [--ranks 512] [--workers 64] [--rounds 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>

using namespace refit;
using clock_type = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int ranks = 512, workers = 64, rounds = 3, layers = 128, experts = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--ranks")
      ranks = v;
    else if (a == "--workers")
      workers = v;
    else if (a == "--rounds")
      rounds = v;
    else if (a == "--layers")
      layers = v;
    else if (a == "--experts")
      experts = v;
    else {
      std::fprintf(stderr, "usage: plan_bench [--ranks M] [--workers N] [--rounds R] [--layers L] [--experts E]\n");
      return 2;
    }
  }
  const std::int64_t hidden = 7168, inter = 2048, vocab = 129280;
  update_metadata meta;
  meta.tensors.push_back({"model.embed_tokens.weight", dtype::bfloat16, {vocab, hidden}});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    meta.tensors.push_back({p + "input_layernorm.weight", dtype::bfloat16, {hidden}});
    for (int e = 0; e < experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      meta.tensors.push_back({x + "gate_proj.weight", dtype::bfloat16, {inter, hidden}});
      meta.tensors.push_back({x + "up_proj.weight", dtype::bfloat16, {inter, hidden}});
      meta.tensors.push_back({x + "down_proj.weight", dtype::bfloat16, {hidden, inter}});
    }
  }
  meta.tensors.push_back({"lm_head.weight", dtype::bfloat16, {vocab, hidden}});
  const int shard_group = std::min(ranks, 8);
  const auto source = source_layout::uniform(meta, device_mesh{{ranks / shard_group, shard_group}},
                                             {placement::replicate(), placement::shard(0)});
  std::vector<dest_layout> dests(workers);
  std::uint64_t params = 0;
  for (const auto& t : meta.tensors) {
    params += static_cast<std::uint64_t>(checked_numel(t.shape));
    const auto pos = t.name.find(".experts.");
    const int owner = pos == std::string::npos ? -1 : std::atoi(t.name.c_str() + pos + 9) % workers;
    for (int w = 0; w < workers; ++w)
      if (owner < 0 || owner == w)
        dests[w].tensors.push_back({t, {{t.name, whole(t.shape), std::vector<std::int64_t>(t.shape.size(), 0)}}});
  }
  std::vector<double> plan_s, digest_s;
  std::size_t items = 0;
  double balance = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = clock_type::now();
    const auto plan = plan_transfer(source, dests);
    plan_s.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
    t0 = clock_type::now();
    const auto d = layout_digest(source, dests);
    digest_s.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
    if (d != plan.digest) return 1;
    items = 0;
    for (const auto& p : plan.pairs) items += p.items.size();
    std::uint64_t most = 0, sum = 0;
    for (auto e : plan.egress) most = std::max(most, e), sum += e;
    balance = static_cast<double>(most) / (static_cast<double>(sum) / plan.egress.size());
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return std::vector<double>{v[v.size() / 2], v.front(), v.back()};
  };
  const auto p = med(plan_s), d = med(digest_s);
  std::printf(
      "{\"tensors\": %zu, \"params\": %llu, \"ranks\": %d, \"workers\": %d, \"items\": %zu, "
      "\"plan_s\": [%.3f, %.3f, %.3f], \"digest_s\": [%.4f, %.4f, %.4f], \"egress_max_over_mean\": %.3f}\n",
      meta.tensors.size(), static_cast<unsigned long long>(params), ranks, workers, items, p[0], p[1], p[2], d[0], d[1],
      d[2], balance);
  return 0;
}
