// A sharded engine's M trainer ranks and N workers in one process, for the
// engines' tests (tcp_sharded, ucx_sharded): FSDP Shard(0) shards on the ranks,
// vLLM's tensor-parallel layout on the workers, and a reference slicing of the full
// model (copy_box of each piece, independent of the planner) to check every byte a
// worker holds against.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <refit/backend/async/all_of.h>
#include <refit/backend/sharded.h>
#include <refit/engine.h>
#include <refit/error.h>
#include <refit/session.h>
#include <refit/trainer.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {

using namespace std::chrono_literals;

// A Llama-like checkpoint: vocab 100 (padded to 128 for tp 2), hidden 16, GQA k/v.
inline update_metadata checkpoint(int layers = 2) {
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

inline json layout_spec(int ranks, int tp, std::int64_t padding = 64) {
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
    if (fail_next_load.exchange(false)) throw_error(errc::processing_failed, "host model: load_weights failed");
    std::lock_guard lock(mutex_);
    for (const auto& v : views) {
      auto& t = tensors_.at(std::string(v.name));
      ASSERT_EQ(t.size(), v.nbytes());
      if (t.data() != v.data) std::memcpy(t.data(), v.data, t.size());
      ++loaded_;
    }
  }
  // Its slices read back (the undo of a fleet-atomic commit).
  bool can_read_back(const tensor_spec& spec) override {
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    return it != tensors_.end() && it->second.size() == spec.nbytes();
  }
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override {
    std::lock_guard lock(mutex_);
    const auto& t = tensors_.at(spec.name);
    std::memcpy(out.data(), t.data(), out.size());
  }
  std::map<std::string, std::vector<std::byte>> tensors_;
  std::size_t loaded_ = 0;
  std::atomic<bool> fail_next_load{false};  // the next load_weights throws
  update_metadata announced_;

 private:
  bool direct_;
  std::mutex mutex_;
};

inline weight_transfer_config sharded_config(std::string backend, std::chrono::milliseconds timeout) {
  weight_transfer_config c;
  c.backend = std::move(backend);
  c.timeout = timeout;
  return c;
}

// M ranks and N workers of one sharded engine in one io_context. `Engine` names
// it: Engine::sender and Engine::engine its two sides, Engine::name its backend.
template <class Engine>
struct sharded_group_of {
  using sender_type = typename Engine::sender;
  using engine_type = typename Engine::engine;
  asio::io_context io;
  int ranks, workers;
  json spec;
  std::vector<std::unique_ptr<sender_type>> senders;
  std::vector<std::unique_ptr<host_model>> models;
  std::vector<std::unique_ptr<engine_type>> engines;
  json init;
  std::vector<update_metadata> locals;

  sharded_group_of(int m, int n, bool checksums, std::chrono::milliseconds timeout = 5s, bool delta = false)
      : ranks(m), workers(n), spec(layout_spec(m, n)) {
    json trainers = json::array();
    for (int r = 0; r < m; ++r) trainers.push_back({{"address", "127.0.0.1"}, {"port", 0}});
    for (int r = 0; r < m; ++r) {
      senders.push_back(
          std::make_unique<sender_type>(sharded_config(Engine::name, timeout), trainer_context{io.get_executor(), {}}));
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
      engines.push_back(std::make_unique<engine_type>(sharded_config(Engine::name, timeout),
                                                      engine_context{io.get_executor(), {}, {}, models.back().get()}));
    }
  }
  ~sharded_group_of() {
    for (auto& s : senders) s->shutdown();
    for (auto& e : engines) e->shutdown();
    run(io, 5s);
  }
  static asio::awaitable<void> init_one(engine_type& e, json info) {
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
  static asio::awaitable<void> send(sender_type& s, update_metadata meta, std::vector<tensor_view> views) {
    co_await trainer_send_weights(s, meta, views);
  }
  static asio::awaitable<void> receive(engine_type& e, std::unique_ptr<update_info> info, model_target* m) {
    co_await e.receive_weights(*info, m->as_load_weights());
  }
  // Through worker w's update session, when `sessions` holds one per worker.
  static asio::awaitable<void> receive_in(weight_update_session& s, std::unique_ptr<update_info> info,
                                          model_target* m) {
    co_await s.update_weights(*info, m->as_load_weights());
  }
  std::vector<std::unique_ptr<weight_update_session>> sessions;
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
      if (sessions.empty())
        got.push_back(spawn(io, receive(*engines[w], std::move(info), models[w].get())));
      else
        got.push_back(spawn(io, receive_in(*sessions[w], std::move(info), models[w].get())));
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
  backend::sharded_layouts read_layout() const {
    backend::layout_cache cache;
    return *cache.get(checkpoint(), spec, "test");
  }
};

// ---- Cases every sharded engine must pass, each over a fresh group.

// Every worker holds exactly `model`'s bytes of its tensors.
template <class Engine>
void expect_holds(sharded_group_of<Engine>& g, const backend::sharded_layouts& layouts, const full_model& model,
                  const std::string& when = {}) {
  for (int w = 0; w < g.workers; ++w)
    for (const auto& [name, bytes] : model.expected(layouts.workers[w]))
      EXPECT_EQ(g.models[w]->tensors_.at(name), bytes) << when << ": worker " << w << " " << name;
}

inline void expect_ok(const std::vector<std::shared_ptr<outcome>>& sent,
                      const std::vector<std::shared_ptr<outcome>>& got) {
  for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
  for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
}

// One rank to four workers: each worker gets its quarter (norms are replicated).
template <class Engine>
void one_rank_to_four_workers() {
  sharded_group_of<Engine> g(1, 4, false);
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

// Both workers plan with another vocab padding (100 rows: 50 each, not 64): the
// pieces differ, so does the digest; refused before any byte, nothing dirty.
template <class Engine>
void another_layout_is_refused_before_any_byte() {
  sharded_group_of<Engine> g(2, 2, false);
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

// Rank 1 goes away before it sends: typed errors on every side within the
// deadline, and no worker loads an update it does not hold.
template <class Engine>
void a_lost_rank_fails_every_side() {
  sharded_group_of<Engine> g(2, 2, false, 2s);
  g.connect();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model model(checkpoint(), 4);
  // Rank 1 goes away before it sends (its connections close): its workers' pairs fail, rank 0's sends fail.
  g.senders[1]->shutdown();
  const auto start = std::chrono::steady_clock::now();
  auto [sent, got] = g.update(model, shards);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "not within the deadline";
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

// Staged: an update that loses a rank leaves the models with the last one, whole.
template <class Engine>
void staged_commits_land_whole_or_not_at_all() {
  sharded_group_of<Engine> g(2, 2, true);
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

// Fleet-atomic over a sharded engine (what worker_group drives: each worker's
// session undoable, a vote, then commits): each worker stages its own slices;
// worker 1's commit fails and loads its previous slices back itself, worker 0,
// committed, rolls back: both hold the last version, whole, clean. The next
// update commits on both, and a rollback returns both to the version before it.
template <class Engine>
void fleet_atomic_commits_can_be_undone_on_every_worker() {
  sharded_group_of<Engine> g(2, 2, true);
  g.commit = "staged";
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  full_model first(checkpoint(), 5);
  auto [sent, got] = g.update(first, shards);
  expect_ok(sent, got);
  for (int w = 0; w < 2; ++w) g.sessions.push_back(std::make_unique<weight_update_session>(*g.engines[w]));
  auto run = [&](auto make) {
    std::exception_ptr failure;
    auto go = [&]() -> asio::awaitable<void> {
      try {
        co_await make();
      } catch (...) {
        failure = std::current_exception();
      }
    };
    run_to_completion(g.io, go());
    return failure;
  };
  auto stage = [&](const full_model& model) {
    for (auto& s : g.sessions) {
      s->start_weight_update();
      s->require_undo();
    }
    auto [sent2, got2] = g.update(model, shards);
    expect_ok(sent2, got2);
    for (auto& s : g.sessions) EXPECT_FALSE(run([&] { return s->prepare_weight_update(); })) << "a worker voted no";
  };

  full_model second(checkpoint(), 6);
  stage(second);
  g.models[1]->fail_next_load = true;
  EXPECT_FALSE(run([&] { return g.sessions[0]->finish_weight_update(6); }));
  const std::exception_ptr failed = run([&] { return g.sessions[1]->finish_weight_update(6); });
  ASSERT_TRUE(failed) << "worker 1's commit did not fail";
  EXPECT_NE(describe_error(failed).find("load_weights failed"), std::string::npos) << describe_error(failed);
  EXPECT_FALSE(run([&] { return g.sessions[0]->rollback_weight_update(); }));
  expect_holds(g, layouts, first, "after the failed commit and the rollback");
  for (int w = 0; w < 2; ++w) {
    EXPECT_FALSE(g.engines[w]->weights_dirty()) << g.engines[w]->dirty_reason();
    EXPECT_FALSE(g.sessions[w]->holds_undo()) << "worker " << w;
  }

  full_model third(checkpoint(), 7);
  stage(third);
  for (auto& s : g.sessions) EXPECT_FALSE(run([&] { return s->finish_weight_update(7); }));
  expect_holds(g, layouts, third, "after the commit");
  for (auto& s : g.sessions) {
    ASSERT_TRUE(s->holds_undo());
    EXPECT_FALSE(run([&] { return s->rollback_weight_update(); }));
  }
  expect_holds(g, layouts, first, "after rolling the committed update back");
}

}  // namespace refit::testing
