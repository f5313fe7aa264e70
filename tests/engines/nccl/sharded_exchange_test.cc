// The sharded plan as grouped point-to-point exchanges on the host collective (the
// CPU stand-in for NCCL behind the same provider interface): M trainer ranks with
// FSDP Shard(0) shards, N workers in vLLM's tp layout, every byte checked against
// a reference slicing of the whole model.
#include <gtest/gtest.h>

#include <refit/adapters/vllm.h>
#include <refit/backend/async/all_of.h>
#include <refit/backend/pipeline.h>
#include <refit/engines/nccl/sharded.h>
#include <refit/error.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

update_metadata checkpoint() {
  update_metadata m;
  auto add = [&](std::string n, std::vector<std::int64_t> s) {
    m.tensors.push_back({std::move(n), dtype::bfloat16, std::move(s)});
  };
  add("model.embed_tokens.weight", {100, 16});
  add("model.layers.0.input_layernorm.weight", {16});
  add("model.layers.0.self_attn.q_proj.weight", {16, 16});
  add("model.layers.0.self_attn.k_proj.weight", {8, 16});
  add("model.layers.0.self_attn.v_proj.weight", {8, 16});
  add("model.layers.0.self_attn.o_proj.weight", {16, 16});
  add("model.layers.0.mlp.gate_proj.weight", {40, 16});
  add("model.layers.0.mlp.up_proj.weight", {40, 16});
  add("model.layers.0.mlp.down_proj.weight", {16, 40});
  add("lm_head.weight", {100, 16});
  return m;
}

struct exchange_setup {
  update_metadata meta = checkpoint();
  source_layout source;
  std::vector<dest_layout> dests;
  transfer_plan plan;
  std::vector<std::vector<std::byte>> whole;                // the global tensors
  std::vector<std::vector<std::vector<std::byte>>> shards;  // [rank][tensor]
  std::vector<update_metadata> locals;
  std::vector<std::vector<std::vector<std::byte>>> held;  // [worker][tensor]

  exchange_setup(int m, int n) {
    source = source_layout::uniform(meta, device_mesh{{m}}, {placement::shard(0)});
    for (int w = 0; w < n; ++w) dests.push_back(tensor_parallel_layout(meta, n, w, vllm_llama_layout()));
    plan = plan_transfer(source, dests);
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      whole.emplace_back(meta.tensors[i].nbytes());
      for (std::size_t k = 0; k < whole[i].size(); ++k) whole[i][k] = pattern_byte(i + 1, k);
    }
    for (int r = 0; r < m; ++r) {
      locals.push_back(source.local_metadata(r));
      shards.emplace_back();
      for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
        const auto b = source.local_box(i, r);
        shards[r].emplace_back(locals[r].tensors[i].nbytes());
        copy_box(whole[i].data(), meta.tensors[i].shape, b, shards[r][i].data(), locals[r].tensors[i].shape,
                 std::vector<std::int64_t>(b.offset.size(), 0), 2);
      }
    }
    for (int w = 0; w < n; ++w) {
      held.emplace_back();
      for (const auto& t : dests[w].tensors) held[w].emplace_back(t.spec.nbytes(), std::byte{0});
    }
  }
  std::vector<tensor_place> shard_places(int r) {
    std::vector<tensor_place> out;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i)
      out.push_back({shards[r][i].data(), locals[r].tensors[i].shape, 2});
    return out;
  }
  std::vector<tensor_place> dest_places(int w) {
    std::vector<tensor_place> out;
    for (std::size_t t = 0; t < dests[w].tensors.size(); ++t)
      out.push_back({held[w][t].data(), dests[w].tensors[t].spec.shape, 2});
    return out;
  }
  void check() const {
    std::map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) index[meta.tensors[i].name] = i;
    for (std::size_t w = 0; w < dests.size(); ++w)
      for (std::size_t t = 0; t < dests[w].tensors.size(); ++t) {
        const auto& d = dests[w].tensors[t];
        std::vector<std::byte> want(d.spec.nbytes(), std::byte{0});
        for (const auto& p : d.pieces) {
          const auto s = index.at(p.source);
          copy_box(whole[s].data(), meta.tensors[s].shape, p.from, want.data(), d.spec.shape, p.at, 2);
        }
        EXPECT_EQ(held[w][t], want) << "worker " << w << " " << d.spec.name;
      }
  }
};

asio::awaitable<void> join_one(std::shared_ptr<nccl::collective_provider> p, std::string id, int rank, int world,
                               std::unique_ptr<nccl::collective>* out) {
  *out = co_await p->join(id, rank, world, co_await asio::this_coro::executor, 5s);
}

asio::awaitable<void> send_one(nccl::collective* c, nccl::collective_provider* p, staging_memory* s,
                               const transfer_plan* plan, int rank, std::vector<tensor_place> places,
                               std::uint64_t frame) {
  co_await nccl::send_sharded(*c, *p, *s, *plan, rank, places, frame, 2s);
}

asio::awaitable<void> receive_one(nccl::collective* c, staging_memory* s, const transfer_plan* plan, int worker,
                                  std::vector<tensor_place> places, std::uint64_t frame) {
  co_await nccl::receive_sharded(*c, *s, *plan, worker, places, frame, 2s);
}

struct comm_group {
  asio::io_context io;
  std::shared_ptr<nccl::collective_provider> provider = nccl::host_collectives();
  std::vector<std::unique_ptr<nccl::collective>> comms;
  std::vector<std::unique_ptr<staging_memory>> staging;
  comm_group(int m, int n, std::uint64_t frame) {
    const int world = m + n;
    comms.resize(world);
    const std::string id = provider->new_group_id();
    std::vector<asio::awaitable<void>> joins;
    for (int r = 0; r < world; ++r) joins.push_back(join_one(provider, id, r, world, &comms[r]));
    run_to_completion(io, async::all_of(std::move(joins)), 10s);
    for (int r = 0; r < world; ++r) staging.push_back(provider->make_staging(r < m ? n : m, frame));
  }
};

class sharded_exchange : public ::testing::TestWithParam<std::tuple<int, int, std::uint64_t>> {};

TEST_P(sharded_exchange, every_worker_gets_exactly_its_bytes) {
  const auto [m, n, frame] = GetParam();
  exchange_setup s(m, n);
  comm_group g(m, n, frame);
  std::vector<std::shared_ptr<outcome>> all;
  for (int r = 0; r < m; ++r)
    all.push_back(spawn(
        g.io, send_one(g.comms[r].get(), g.provider.get(), g.staging[r].get(), &s.plan, r, s.shard_places(r), frame)));
  for (int w = 0; w < n; ++w)
    all.push_back(
        spawn(g.io, receive_one(g.comms[m + w].get(), g.staging[m + w].get(), &s.plan, w, s.dest_places(w), frame)));
  ASSERT_TRUE(run_until(
      g.io, [&] { return std::all_of(all.begin(), all.end(), [](auto& o) { return o->done; }); }, 20s));
  for (auto& o : all) ASSERT_FALSE(o->error) << o->message();
  s.check();
  // Several frames per pair at small frames: the rounds are the largest pair's.
  EXPECT_GE(nccl::exchange_rounds(s.plan, frame), 1u);
}

INSTANTIATE_TEST_SUITE_P(layouts, sharded_exchange,
                         ::testing::Values(std::make_tuple(2, 2, std::uint64_t(4096)),
                                           std::make_tuple(1, 4, std::uint64_t(1 << 20)),
                                           std::make_tuple(3, 2, std::uint64_t(300)),
                                           std::make_tuple(2, 1, std::uint64_t(64))));

TEST(sharded_exchange_faults, a_trainer_rank_that_aborts_fails_every_worker_with_a_typed_error) {
  exchange_setup s(2, 2);
  comm_group g(2, 2, 4096);
  g.comms[1]->abort();  // rank 1 is gone before it sends
  std::vector<std::shared_ptr<outcome>> got;
  auto sent = spawn(
      g.io, send_one(g.comms[0].get(), g.provider.get(), g.staging[0].get(), &s.plan, 0, s.shard_places(0), 4096));
  for (int w = 0; w < 2; ++w)
    got.push_back(
        spawn(g.io, receive_one(g.comms[2 + w].get(), g.staging[2 + w].get(), &s.plan, w, s.dest_places(w), 4096)));
  ASSERT_TRUE(run_until(
      g.io, [&] { return sent->done && got[0]->done && got[1]->done; }, 20s));
  for (auto& o : got) {
    ASSERT_TRUE(o->error);
    const auto k = static_cast<errc>(o->kind());
    EXPECT_TRUE(k == errc::peer_lost || k == errc::timeout) << o->message();
  }
  ASSERT_TRUE(sent->error);
}

}  // namespace
}  // namespace refit::testing
