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
#include "tests/support/sharded_group.h"
#include "tests/support/tensors.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

struct tcp_engine {
  using sender = tcp::sharded_sender;
  using engine = tcp::sharded_engine;
  static constexpr const char* name = "tcp_sharded";
};
using sharded_group = sharded_group_of<tcp_engine>;

weight_transfer_config config(std::chrono::milliseconds timeout = 5s) { return sharded_config("tcp_sharded", timeout); }

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

TEST(tcp_sharded, one_rank_to_four_workers_sends_each_a_quarter) { one_rank_to_four_workers<tcp_engine>(); }
TEST(tcp_sharded, a_worker_with_another_layout_refuses_before_any_byte) {
  another_layout_is_refused_before_any_byte<tcp_engine>();
}
TEST(tcp_sharded, a_trainer_rank_lost_before_its_send_fails_every_side_with_a_typed_error) {
  a_lost_rank_fails_every_side<tcp_engine>();
}
TEST(tcp_sharded, staged_commits_land_whole_or_not_at_all) { staged_commits_land_whole_or_not_at_all<tcp_engine>(); }
TEST(tcp_sharded, fleet_atomic_commits_can_be_undone_on_every_worker) {
  fleet_atomic_commits_can_be_undone_on_every_worker<tcp_engine>();
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
  backend::layout_cache cache;
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
