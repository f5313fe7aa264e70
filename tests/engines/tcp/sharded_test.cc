// tcp_sharded in one process: M trainer ranks, each with only its FSDP Shard(0)
// shards, and N workers in vLLM's tensor-parallel layout. Every byte each worker
// holds is checked against a reference slicing of the full model (copy_box of each
// piece), independent of the planner.
#include <gtest/gtest.h>

#include <cstring>

#include <refit/backend/async/all_of.h>
#include <refit/engines/tcp/sharded.h>
#include <refit/error.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

// A Llama-like checkpoint: vocab 100 (padded to 128 for tp 2), hidden 16, GQA k/v.
update_metadata checkpoint(int layers = 2) {
  update_metadata m;
  auto add = [&](std::string n, std::vector<std::int64_t> s) {
    m.tensors.push_back({std::move(n), dtype::bfloat16, std::move(s)});
  };
  add("model.embed_tokens.weight", {100, 16});
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {16});
    add(p + "self_attn.q_proj.weight", {16, 16});
    add(p + "self_attn.k_proj.weight", {8, 16});
    add(p + "self_attn.v_proj.weight", {8, 16});
    add(p + "self_attn.o_proj.weight", {16, 16});
    add(p + "mlp.gate_proj.weight", {40, 16});
    add(p + "mlp.up_proj.weight", {40, 16});
    add(p + "mlp.down_proj.weight", {16, 40});
  }
  add("model.norm.weight", {16});
  add("lm_head.weight", {100, 16});
  return m;
}

json layout_spec(int ranks, int tp, std::int64_t padding = 64) {
  return {{"source", {{"mesh", {ranks}}, {"placements", {"shard(0)"}}}},
          {"destination", {{"preset", "vllm_llama"}, {"tp_size", tp}, {"vocab_padding", padding}}}};
}

// The global model for round `round`, and what each rank holds of it.
struct full_model {
  update_metadata meta;
  std::vector<std::vector<std::byte>> data;
  full_model(update_metadata m, std::uint64_t round) : meta(std::move(m)) {
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      data.emplace_back(meta.tensors[i].nbytes());
      for (std::size_t k = 0; k < data[i].size(); ++k) data[i][k] = pattern_byte(round * 1000 + i, k);
    }
  }
  // The next step of a trajectory: one bf16 element in `every` of each tensor
  // moves by its lowest bit (where an element starts at `offset`, mod every).
  full_model step(std::size_t every, std::size_t offset) const {
    full_model next = *this;
    for (auto& t : next.data)
      for (std::size_t e = offset % every; e * 2 < t.size(); e += every) t[e * 2] ^= std::byte{1};
    return next;
  }
  // Rank r's shards (contiguous copies of its local boxes).
  std::vector<std::vector<std::byte>> shards(const source_layout& l, int rank) const {
    std::vector<std::vector<std::byte>> out;
    const auto local = l.local_metadata(rank);
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      const auto b = l.local_box(i, rank);
      out.emplace_back(local.tensors[i].nbytes());
      copy_box(data[i].data(), meta.tensors[i].shape, b, out.back().data(), local.tensors[i].shape,
               std::vector<std::int64_t>(b.offset.size(), 0), element_size(meta.tensors[i].dtype));
    }
    return out;
  }
  // What a worker must hold: each piece copied from the global tensor (padding 0).
  std::map<std::string, std::vector<std::byte>> expected(const dest_layout& d) const {
    std::map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) index[meta.tensors[i].name] = i;
    std::map<std::string, std::vector<std::byte>> out;
    for (const auto& t : d.tensors) {
      auto& bytes = out[t.spec.name];
      bytes.assign(t.spec.nbytes(), std::byte{0});
      for (const auto& p : t.pieces) {
        const auto s = index.at(p.source);
        copy_box(data[s].data(), meta.tensors[s].shape, p.from, bytes.data(), t.spec.shape, p.at,
                 element_size(t.spec.dtype));
      }
    }
    return out;
  }
};

// A worker's model: zeroed host tensors it offers as destinations (or not).
class host_model final : public model_target {
 public:
  explicit host_model(bool direct) : direct_(direct) {}
  void begin_update(const update_metadata& meta) override {
    std::lock_guard lock(mutex_);
    for (const auto& t : meta.tensors)
      if (tensors_[t.name].size() != t.nbytes()) tensors_[t.name].assign(t.nbytes(), std::byte{0});
    announced_ = meta;
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    if (!direct_) return std::nullopt;
    std::lock_guard lock(mutex_);
    return tensor_view(spec, tensors_.at(spec.name).data());
  }
  void load_weights(std::span<const tensor_view> views) override {
    std::lock_guard lock(mutex_);
    for (const auto& v : views) {
      auto& t = tensors_.at(std::string(v.name));
      ASSERT_EQ(t.size(), v.nbytes());
      if (t.data() != v.data) std::memcpy(t.data(), v.data, t.size());
      ++loaded_;
    }
  }
  std::map<std::string, std::vector<std::byte>> tensors_;
  std::size_t loaded_ = 0;
  update_metadata announced_;

 private:
  bool direct_;
  std::mutex mutex_;
};

weight_transfer_config config(std::chrono::milliseconds timeout = 5s) {
  weight_transfer_config c;
  c.backend = "tcp_sharded";
  c.timeout = timeout;
  return c;
}

struct sharded_group {
  asio::io_context io;
  int ranks, workers;
  json spec;
  std::vector<std::unique_ptr<tcp::sharded_sender>> senders;
  std::vector<std::unique_ptr<host_model>> models;
  std::vector<std::unique_ptr<tcp::sharded_engine>> engines;
  json init;
  std::vector<update_metadata> locals;

  sharded_group(int m, int n, bool checksums, std::chrono::milliseconds timeout = 5s, bool delta = false)
      : ranks(m), workers(n), spec(layout_spec(m, n)) {
    json trainers = json::array();
    for (int r = 0; r < m; ++r) trainers.push_back({{"address", "127.0.0.1"}, {"port", 0}});
    for (int r = 0; r < m; ++r) {
      senders.push_back(std::make_unique<tcp::sharded_sender>(config(timeout), trainer_context{io.get_executor(), {}}));
      json args = {{"rank", r},      {"trainers", trainers}, {"workers", n},
                   {"layout", spec}, {"buffer_bytes", 4096}, {"checksums", checksums}};
      if (delta) args["delta"] = true;
      auto info = senders.back()->prepare(args);
      trainers[r]["port"] = info["trainers"][r]["port"];
      init = info;
    }
    init["trainers"] = trainers;
    for (int w = 0; w < n; ++w) {
      models.push_back(std::make_unique<host_model>(w % 2 == 0));  // odd workers: the fallback path
      engines.push_back(std::make_unique<tcp::sharded_engine>(
          config(timeout), engine_context{io.get_executor(), {}, {}, models.back().get()}));
    }
  }
  ~sharded_group() {
    for (auto& s : senders) s->shutdown();
    for (auto& e : engines) e->shutdown();
    run(io, 5s);
  }
  static asio::awaitable<void> init_one(tcp::sharded_engine& e, json info) {
    auto typed = e.parse_init_info(info);
    co_await e.init_transfer_engine(*typed);
  }
  void connect() {
    std::vector<asio::awaitable<void>> all;
    for (auto& s : senders) all.push_back(s->connect_workers());
    for (int w = 0; w < workers; ++w) {
      json info = init;
      info["rank_offset"] = w + 1;
      all.push_back(init_one(*engines[w], info));
    }
    run_to_completion(io, async::all_of(std::move(all)), 30s);
  }
  static asio::awaitable<void> send(tcp::sharded_sender& s, update_metadata meta, std::vector<tensor_view> views) {
    co_await trainer_send_weights(s, meta, views);
  }
  static asio::awaitable<void> receive(tcp::sharded_engine& e, std::unique_ptr<update_info> info, model_target* m) {
    co_await e.receive_weights(*info, m->as_load_weights());
  }
  json update_info(const update_metadata& meta, json layout) const {
    json j = json::object();
    write_update_metadata(meta, j);
    j["layout"] = std::move(layout);
    if (!commit.empty()) j["commit"] = commit;
    return j;
  }
  std::string commit;  // "staged" or "in_place" in every update_info; empty: the config's
  // One update of `model`: every rank sends its shards, every worker receives.
  std::pair<std::vector<std::shared_ptr<outcome>>, std::vector<std::shared_ptr<outcome>>> update(
      const full_model& model, std::vector<std::vector<std::vector<std::byte>>>& shards,
      std::optional<json> worker_layout = std::nullopt) {
    const auto source = read_layout().source;
    shards.clear();
    std::vector<std::shared_ptr<outcome>> sent, got;
    for (int w = 0; w < workers; ++w) {
      auto info = engines[w]->parse_update_info(update_info(model.meta, worker_layout.value_or(spec)));
      got.push_back(spawn(io, receive(*engines[w], std::move(info), models[w].get())));
    }
    for (int r = 0; r < ranks; ++r) shards.push_back(model.shards(source, r));
    locals.clear();
    for (int r = 0; r < ranks; ++r) locals.push_back(source.local_metadata(r));  // the views' names and shapes
    for (int r = 0; r < ranks; ++r) {
      const auto& local = locals[r];
      std::vector<tensor_view> views;
      for (std::size_t i = 0; i < local.tensors.size(); ++i) views.emplace_back(local.tensors[i], shards[r][i].data());
      sent.push_back(spawn(io, send(*senders[r], model.meta, std::move(views))));
    }
    auto all = [&] {
      for (auto* list : {&sent, &got})
        for (auto& o : *list)
          if (!o->done) return false;
      return true;
    };
    EXPECT_TRUE(run_until(io, all, 30s));
    return {sent, got};
  }
  tcp::sharded_layouts read_layout() const {
    tcp::layout_cache cache;
    return *cache.get(checkpoint(), spec, "test");
  }
};

// Sources' local_metadata views must point into shards that outlive the send.
TEST(tcp_sharded, two_ranks_to_two_workers_every_byte_verified) {
  sharded_group g(2, 2, /*checksums=*/true);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  for (std::uint64_t round = 1; round <= 2; ++round) {
    full_model model(checkpoint(), round);
    auto [sent, got] = g.update(model, shards);
    for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
    for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
    for (int w = 0; w < 2; ++w) {
      const auto expected = model.expected(layouts.workers[w]);
      ASSERT_EQ(g.models[w]->tensors_.size(), expected.size());
      for (const auto& [name, bytes] : expected)
        EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << "worker " << w << " " << name;
      // The model was told of its own (local, fused) tensors.
      EXPECT_EQ(g.models[w]->announced_.tensors.size(), layouts.workers[w].tensors.size());
      // Each worker received only what it keeps: its tensors' bytes less padding.
      EXPECT_EQ(g.engines[w]->last_update_stats().bytes, layouts.plan->ingress[w]);
    }
    // Every rank sent: FSDP shards hold bytes for every worker.
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(g.senders[r]->last_send_stats().bytes, layouts.plan->egress[r]);
      for (int w = 0; w < 2; ++w) EXPECT_GT(g.senders[r]->last_bytes_per_worker()[w], 0u);
    }
  }
  EXPECT_LT(layouts.plan->ingress[0], layouts.global.total_bytes());
}

TEST(tcp_sharded, one_rank_to_four_workers_sends_each_a_quarter) {
  sharded_group g(1, 4, false);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 7);
  auto [sent, got] = g.update(model, shards);
  for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
  for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
  const auto total = model.meta.total_bytes();
  for (int w = 0; w < 4; ++w) {
    const auto expected = model.expected(layouts.workers[w]);
    for (const auto& [name, bytes] : expected)
      EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << "worker " << w << " " << name;
    // Norms are replicated (every worker holds them), the rest is a quarter.
    EXPECT_LT(g.engines[w]->last_update_stats().bytes, total * 3 / 10) << "worker " << w;
  }
}

TEST(tcp_sharded, a_worker_with_another_layout_refuses_before_any_byte) {
  sharded_group g(2, 2, false);
  g.connect();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 3);
  // Both workers plan with another vocab padding (100 rows: 50 each, not 64): the
  // pieces differ, so does the digest.
  auto [sent, got] = g.update(model, shards, layout_spec(2, 2, 100));
  for (auto& o : got) {
    ASSERT_TRUE(o->error);
    EXPECT_EQ(o->kind(), static_cast<int>(errc::protocol_error)) << o->message();
  }
  for (auto& o : sent) {
    ASSERT_TRUE(o->error);
    EXPECT_NE(o->message().find("transfer plans differ"), std::string::npos) << o->message();
  }
  // Nothing reached the models.
  for (auto& m : g.models)
    for (auto& [name, bytes] : m->tensors_)
      EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == std::byte{0}; })) << name;
  for (auto& e : g.engines) EXPECT_FALSE(e->weights_dirty()) << e->dirty_reason();
}

TEST(tcp_sharded, a_trainer_rank_lost_before_its_send_fails_every_side_with_a_typed_error) {
  sharded_group g(2, 2, false, 2s);
  g.connect();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 4);
  // Rank 1 goes away before it sends (its connections close): its workers' pairs fail, rank 0's sends fail.
  g.senders[1]->shutdown();
  auto [sent, got] = g.update(model, shards);
  for (auto& o : got) {
    ASSERT_TRUE(o->error);
    const auto k = static_cast<errc>(o->kind());
    EXPECT_TRUE(k == errc::peer_lost || k == errc::invalid_state || k == errc::cancelled) << o->message();
  }
  ASSERT_TRUE(sent[1]->error);
  EXPECT_EQ(sent[1]->kind(), static_cast<int>(errc::invalid_state)) << sent[1]->message();
  // Rank 0 either finished its pairs before the workers failed, or learns why.
  if (sent[0]->error) {
    EXPECT_NE(sent[0]->message().find("worker"), std::string::npos) << sent[0]->message();
  }
  // A failure after direct writes marks the weights dirty; never clean and claimed.
  for (int w = 0; w < 2; ++w)
    EXPECT_EQ(g.models[w]->loaded_, 0u) << "worker " << w << " loaded an update it does not hold";
}

TEST(tcp_sharded, staged_commits_land_whole_or_not_at_all) {
  sharded_group g(2, 2, true);
  g.commit = "staged";
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model first(checkpoint(), 5);
  auto [sent, got] = g.update(first, shards);
  for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
  for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
  for (int w = 0; w < 2; ++w) {
    for (const auto& [name, bytes] : first.expected(layouts.workers[w]))
      EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << "worker " << w << " " << name;
    EXPECT_GT(g.engines[w]->staged_bytes(), 0u);
  }
  // The next update loses a trainer rank: staged, the models keep update 5 whole.
  g.senders[1]->shutdown();
  full_model second(checkpoint(), 6);
  auto [sent2, got2] = g.update(second, shards);
  for (auto& o : got2) ASSERT_TRUE(o->error);
  for (int w = 0; w < 2; ++w) {
    for (const auto& [name, bytes] : first.expected(layouts.workers[w]))
      EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << "worker " << w << " " << name << " changed";
    EXPECT_FALSE(g.engines[w]->weights_dirty()) << g.engines[w]->dirty_reason();
  }
}

TEST(tcp_sharded, update_info_before_init_and_bad_layouts_are_typed_errors) {
  asio::io_context io;
  tcp::sharded_engine e(config(), engine_context{io.get_executor()});
  json j = json::object();
  write_update_metadata(checkpoint(), j);
  j["layout"] = layout_spec(2, 2);
  try {
    (void)e.parse_update_info(j);
    FAIL() << "parsed before init";
  } catch (const error& x) {
    EXPECT_EQ(x.kind(), errc::invalid_state) << x.message();
  }
  tcp::layout_cache cache;
  json bad = layout_spec(2, 3);  // 16 rows do not split in 3
  try {
    (void)cache.get(checkpoint(), bad, "test");
    FAIL() << "tp 3 accepted";
  } catch (const error& x) {
    EXPECT_EQ(x.kind(), errc::invalid_argument) << x.message();
    EXPECT_NE(x.message().find("divisible"), std::string::npos) << x.message();
  }
  // Cached: the same spec and metadata give the same plan object.
  auto a = cache.get(checkpoint(), layout_spec(2, 2), "test");
  auto b = cache.get(checkpoint(), layout_spec(2, 2), "test");
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(cache.get(checkpoint(3), layout_spec(2, 2), "test").get(), a.get());
}

// ---- Deltas (docs/delta.md): each (rank, worker) pair is a version of its own.

// Every worker holds exactly `model`'s bytes of its tensors.
void expect_holds(sharded_group& g, const tcp::sharded_layouts& layouts, const full_model& model,
                  const std::string& when) {
  for (int w = 0; w < g.workers; ++w)
    for (const auto& [name, bytes] : model.expected(layouts.workers[w]))
      EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << when << ": worker " << w << " " << name;
}

void expect_ok(const std::vector<std::shared_ptr<outcome>>& sent, const std::vector<std::shared_ptr<outcome>>& got) {
  for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
  for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
}

class tcp_sharded_delta : public ::testing::TestWithParam<bool> {};  // checksums

TEST_P(tcp_sharded_delta, frames_go_as_deltas_to_workers_holding_the_base_and_every_byte_is_exact) {
  // Worker 0 offers its model's memory (deltas decode there); worker 1 does not
  // (its bytes go through the engine's own area): it gets every update full.
  sharded_group g(2, 2, GetParam(), 5s, /*delta=*/true);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 11);
  for (int round = 1; round <= 4; ++round) {
    if (round > 1) model = model.step(50, static_cast<std::size_t>(round));
    auto [sent, got] = g.update(model, shards);
    expect_ok(sent, got);
    expect_holds(g, layouts, model, "round " + std::to_string(round));
    for (int r = 0; r < 2; ++r) {
      const auto& d = g.senders[r]->last_delta_stats();
      EXPECT_EQ(d.version, static_cast<std::uint64_t>(round));
      EXPECT_EQ(d.full_bytes, layouts.plan->egress[r]);
      if (round == 1) {
        EXPECT_EQ(d.base_version, 0u);  // nothing to be a delta of yet
        EXPECT_EQ(d.delta_workers + d.full_fallbacks, 0u);
      } else {
        EXPECT_EQ(d.base_version, static_cast<std::uint64_t>(round - 1));
        EXPECT_EQ(d.delta_workers, 1u) << "rank " << r;   // worker 0
        EXPECT_EQ(d.full_fallbacks, 1u) << "rank " << r;  // worker 1: no model memory to decode into
        EXPECT_GT(d.encoded_buckets, 0u);
        EXPECT_LT(d.delta_bytes, d.encoded_full / 4) << "2% of the elements moved";
      }
      const json info = g.senders[r]->last_send_info();
      EXPECT_EQ(info.at("delta").at("version").get<std::uint64_t>(), static_cast<std::uint64_t>(round));
    }
    const auto& w0 = g.engines[0]->last_update_stats();
    EXPECT_EQ(w0.bytes, layouts.plan->ingress[0]);
    if (round > 1) {
      EXPECT_LT(w0.wire_bytes, w0.bytes / 4);
    } else {
      EXPECT_EQ(w0.wire_bytes, w0.bytes);
    }
    EXPECT_EQ(g.engines[1]->last_update_stats().wire_bytes, layouts.plan->ingress[1]);
    // Both workers know the version of each rank's pair they now hold.
    for (int w = 0; w < 2; ++w)
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(g.engines[w]->held().at(r)) << "worker " << w << " rank " << r;
        EXPECT_EQ(g.engines[w]->held()[r]->version, static_cast<std::uint64_t>(round));
      }
  }
}

INSTANTIATE_TEST_SUITE_P(checksums, tcp_sharded_delta, ::testing::Bool());

TEST(tcp_sharded, a_rank_whose_egress_is_over_the_snapshot_bound_sends_plain_updates) {
  sharded_group g(1, 2, true, 5s, /*delta=*/true);
  // Rank 0 re-prepared with a bound below its egress.
  json trainers = json::array({{{"address", "127.0.0.1"}, {"port", 0}}});
  g.init = g.senders[0]->prepare({{"rank", 0},
                                  {"trainers", trainers},
                                  {"workers", 2},
                                  {"layout", g.spec},
                                  {"buffer_bytes", 4096},
                                  {"checksums", true},
                                  {"delta", true},
                                  {"delta_max_bytes", 1024}});
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 51);
  for (int round = 0; round < 2; ++round) {
    if (round) model = model.step(50, 1);
    auto [sent, got] = g.update(model, shards);
    expect_ok(sent, got);
    expect_holds(g, layouts, model, "over the bound");
    EXPECT_TRUE(g.senders[0]->last_delta_stats().over_bound);
    EXPECT_EQ(g.senders[0]->last_delta_stats().snapshot_bytes, 0u);
    EXPECT_FALSE(g.engines[0]->held().at(0)) << "a plain pair claims no version";
  }
}

TEST(tcp_sharded, an_update_asked_full_goes_full_from_every_rank_and_deltas_resume) {
  sharded_group g(2, 2, true, 5s, /*delta=*/true);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 41);
  auto [sent, got] = g.update(model, shards);
  expect_ok(sent, got);
  model = model.step(50, 1);
  for (auto& s : g.senders) s->set_next_send({.delta = false});
  auto [sent2, got2] = g.update(model, shards);
  expect_ok(sent2, got2);
  expect_holds(g, layouts, model, "the update asked full");
  for (auto& s : g.senders) {
    EXPECT_EQ(s->last_delta_stats().base_version, 0u);
    EXPECT_EQ(s->last_delta_stats().delta_workers, 0u);
  }
  EXPECT_EQ(g.engines[0]->last_update_stats().wire_bytes, layouts.plan->ingress[0]);
  model = model.step(50, 2);
  auto [sent3, got3] = g.update(model, shards);
  expect_ok(sent3, got3);
  expect_holds(g, layouts, model, "the delta after it");
  for (auto& s : g.senders) EXPECT_EQ(s->last_delta_stats().delta_workers, 1u);
}

TEST(tcp_sharded, a_delta_against_bytes_changed_outside_refit_is_refused_and_sent_full) {
  sharded_group g(2, 2, true, 5s, /*delta=*/true);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 21);
  auto [sent, got] = g.update(model, shards);
  expect_ok(sent, got);
  // Worker 0's model changes one byte that rank 1 sends it (a reload, a write in
  // place): its recorded version is right, its bytes are not. (The final norm is
  // whole on every worker; rank 1 holds its second half.)
  auto& bytes = g.models[0]->tensors_.at("model.norm.weight");
  bytes.back() ^= std::byte{0x40};
  model = model.step(40, 3);
  auto [sent2, got2] = g.update(model, shards);
  expect_ok(sent2, got2);
  expect_holds(g, layouts, model, "after the outside write");
  EXPECT_EQ(g.senders[0]->last_delta_stats().delta_workers, 1u);  // rank 0's pair with worker 0 is intact
  EXPECT_EQ(g.senders[1]->last_delta_stats().delta_workers, 0u);
  EXPECT_EQ(g.senders[1]->last_delta_stats().full_fallbacks, 2u);
  // Then deltas again, from both ranks.
  model = model.step(40, 5);
  auto [sent3, got3] = g.update(model, shards);
  expect_ok(sent3, got3);
  expect_holds(g, layouts, model, "the update after");
  for (int r = 0; r < 2; ++r) EXPECT_EQ(g.senders[r]->last_delta_stats().delta_workers, 1u) << "rank " << r;
}

TEST(tcp_sharded, staged_delta_updates_decode_into_the_stage_and_a_failed_one_leaves_the_base) {
  sharded_group g(2, 2, true, 5s, /*delta=*/true);
  g.commit = "staged";
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 31);
  for (int round = 1; round <= 3; ++round) {
    if (round > 1) model = model.step(30, static_cast<std::size_t>(round));
    auto [sent, got] = g.update(model, shards);
    expect_ok(sent, got);
    expect_holds(g, layouts, model, "staged round " + std::to_string(round));
    if (round > 1) {
      for (int r = 0; r < 2; ++r) EXPECT_EQ(g.senders[r]->last_delta_stats().delta_workers, 1u);
    }
  }
  // A rank lost mid-way: staged, every model keeps the last version whole, and
  // clean; the worker no longer claims a version it may not hold.
  g.senders[1]->shutdown();
  full_model lost = model.step(30, 7);
  auto [sent4, got4] = g.update(lost, shards);
  for (auto& o : got4) ASSERT_TRUE(o->error);
  expect_holds(g, layouts, model, "after the failed update");
  for (int w = 0; w < 2; ++w) {
    EXPECT_FALSE(g.engines[w]->weights_dirty()) << g.engines[w]->dirty_reason();
    for (const auto& h : g.engines[w]->held()) EXPECT_FALSE(h) << "worker " << w << " claims version " << h->version;
  }
}

}  // namespace
}  // namespace refit::testing
