// ucx_sharded in one process, over the transports of REFIT_TEST_UCX_TLS (shared
// memory or tcp on loopback): M trainer ranks holding FSDP Shard(0) shards, N
// workers in vLLM's tensor-parallel layout, every byte each worker holds checked
// against a reference slicing of the full model (tests/support/sharded_group.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include <refit/engines/ucx/sharded.h>
#include <refit/error.h>
#include "tests/engines/ucx/transports.h"
#include "tests/support/run.h"
#include "tests/support/sharded_group.h"
#include "tests/support/tensors.h"

namespace {
// Before any test: the family's UCX settings (tests/engines/ucx/transports.h).
const std::string tls_family = refit::testing::use_ucx_test_transports();
const bool ucx_env = !tls_family.empty();
const bool shared_memory = tls_family.starts_with("sm");

std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}
}  // namespace

namespace refit::testing {
namespace {

struct ucx_engine {
  using sender = ucx::sharded_sender;
  using engine = ucx::sharded_engine;
  static constexpr const char* name = "ucx_sharded";
};
using sharded_group = sharded_group_of<ucx_engine>;

TEST(ucx_sharded, two_ranks_to_two_workers_every_byte_verified_and_the_transports_reported) {
  ASSERT_TRUE(ucx_env);
  sharded_group g(2, 2, /*checksums=*/true);
  g.connect();
  const auto layouts = g.read_layout();
  std::vector<std::vector<std::vector<std::byte>>> shards;
  for (std::uint64_t round = 1; round <= 3; ++round) {
    full_model model(checkpoint(), round);
    auto [sent, got] = g.update(model, shards);
    for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
    for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
    expect_holds(g, layouts, model);
    for (int w = 0; w < 2; ++w) {
      // Each worker received only what it keeps: its tensors' bytes less padding.
      EXPECT_EQ(g.engines[w]->last_update_stats().bytes, layouts.plan->ingress[w]);
      EXPECT_EQ(g.engines[w]->last_update_stats().wire_bytes, layouts.plan->ingress[w]);
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(g.senders[r]->last_send_stats().bytes, layouts.plan->egress[r]);
      for (int w = 0; w < 2; ++w) EXPECT_GT(g.senders[r]->last_bytes_per_worker()[w], 0u);
    }
  }
  // What UCX chose, on both sides: tagged messages over the transports asked for
  // (puts into the tensors by default only over RDMA).
  for (int w = 0; w < 2; ++w) {
    const json t = g.engines[w]->transport_info();
    ASSERT_TRUE(t.is_object()) << t.dump();
    EXPECT_EQ(t["mode"], "tag");
    EXPECT_EQ(g.engines[w]->last_put_regions(), 0u);
    EXPECT_EQ(t["worker"], w);
    ASSERT_EQ(t["trainer_ranks"].size(), 2u) << t.dump();
    const std::string all = t["transports"].dump();
    EXPECT_NE(all.find(shared_memory ? "cma" : "tcp"), std::string::npos) << all;
  }
  // The rank's side: what its endpoint offers (puts over cma, tagged over tcp).
  const json s = g.senders[0]->transport_info();
  ASSERT_EQ(s.size(), 2u) << s.dump();
  EXPECT_EQ(s["1"]["mode"], shared_memory ? "put" : "tag") << s.dump();
}

// "put_into_model": true: where the endpoint carries puts (cma), every frame is
// written by the rank's puts straight into the worker's tensors (each registered
// for the update, keys sent again every update); over tcp still tagged.
TEST(ucx_sharded, frames_are_put_into_the_tensors_where_asked_and_ucx_carries_puts) {
  for (const bool staged : {false, true}) {
    sharded_group g(2, 2, /*checksums=*/true);
    g.init["put_into_model"] = true;
    if (staged) g.commit = "staged";
    g.connect();
    const auto layouts = g.read_layout();
    std::vector<std::vector<std::vector<std::byte>>> shards;
    for (std::uint64_t round = 1; round <= 2; ++round) {
      full_model model(checkpoint(), 20 + round);
      auto [sent, got] = g.update(model, shards);
      for (auto& o : sent) ASSERT_FALSE(o->error) << o->message();
      for (auto& o : got) ASSERT_FALSE(o->error) << o->message();
      expect_holds(g, layouts, model);
      for (int w = 0; w < 2; ++w) {
        EXPECT_EQ(g.engines[w]->transport_info()["mode"], shared_memory ? "put" : "tag");
        if (shared_memory)
          EXPECT_EQ(g.engines[w]->last_put_regions(), layouts.workers[w].tensors.size()) << "worker " << w;
        else
          EXPECT_EQ(g.engines[w]->last_put_regions(), 0u);
      }
    }
  }
}

TEST(ucx_sharded, one_rank_to_four_workers_sends_each_a_quarter) { one_rank_to_four_workers<ucx_engine>(); }
TEST(ucx_sharded, a_worker_with_another_layout_refuses_before_any_byte) {
  another_layout_is_refused_before_any_byte<ucx_engine>();
}
TEST(ucx_sharded, a_trainer_rank_lost_before_its_send_fails_every_side_within_the_deadline) {
  a_lost_rank_fails_every_side<ucx_engine>();
}
TEST(ucx_sharded, staged_commits_land_whole_or_not_at_all) { staged_commits_land_whole_or_not_at_all<ucx_engine>(); }
TEST(ucx_sharded, fleet_atomic_commits_can_be_undone_on_every_worker) {
  fleet_atomic_commits_can_be_undone_on_every_worker<ucx_engine>();
}

TEST(ucx_sharded, unmet_required_transports_refuse_init_on_both_sides) {
  sharded_group g(1, 2, false);
  g.init["require_transports"] = {"rc", "dc"};
  std::vector<asio::awaitable<void>> all;
  std::vector<std::shared_ptr<outcome>> inits;
  auto sent = spawn(g.io, g.senders[0]->connect_workers());
  for (int w = 0; w < 2; ++w) {
    json info = g.init;
    info["rank_offset"] = w + 1;
    inits.push_back(spawn(g.io, sharded_group::init_one(*g.engines[w], info)));
  }
  ASSERT_TRUE(run_until(
      g.io, [&] { return sent->done && inits[0]->done && inits[1]->done; }, 30s));
  for (auto& o : inits) {
    ASSERT_TRUE(o->error);
    EXPECT_EQ(o->kind(), static_cast<int>(errc::unsupported)) << o->message();
    EXPECT_NE(o->message().find("require_transports [rc, dc] not met"), std::string::npos) << o->message();
  }
  ASSERT_TRUE(sent->error);
  EXPECT_EQ(sent->kind(), static_cast<int>(errc::unsupported)) << sent->message();
}

TEST(ucx_sharded, bad_init_and_update_info_are_typed_errors) {
  asio::io_context io;
  ucx::sharded_engine e(sharded_config("ucx_sharded", 5s), engine_context{io.get_executor()});
  json j = json::object();
  write_update_metadata(checkpoint(), j);
  j["layout"] = layout_spec(1, 2);
  try {
    e.parse_update_info(j);
    FAIL() << "parsed before init";
  } catch (const error& err) {
    EXPECT_EQ(err.kind(), errc::invalid_state) << err.message();
  }
  try {
    e.parse_init_info({{"trainers", json::array()}, {"workers", 2}});
    FAIL() << "no trainers accepted";
  } catch (const error& err) {
    EXPECT_EQ(err.kind(), errc::invalid_argument) << err.message();
  }
  try {
    e.parse_init_info({{"trainers", {{{"address", "127.0.0.1"}, {"port", 5}}}}, {"workers", 2}, {"delta", true}});
    FAIL() << "an unknown member accepted";
  } catch (const error& err) {
    EXPECT_EQ(err.kind(), errc::invalid_argument) << err.message();
  }
  ucx::sharded_sender s(sharded_config("ucx_sharded", 5s), trainer_context{io.get_executor(), {}});
  EXPECT_THROW(s.set_next_send({.delta = true}), error);
}

TEST(ucx_sharded, repeated_jobs_and_failed_updates_leave_no_descriptor_open) {
  const std::size_t before = open_descriptors();
  for (int round = 0; round < 6; ++round) {
    sharded_group g(2, 2, true, 2s);
    g.connect();
    std::vector<std::vector<std::vector<std::byte>>> shards;
    full_model model(checkpoint(), 10 + round);
    if (round % 2 == 1) g.senders[1]->shutdown();  // every other job loses a rank
    auto [sent, got] = g.update(model, shards);
    for (auto& o : got) EXPECT_EQ(static_cast<bool>(o->error), round % 2 == 1) << o->message();
  }
  EXPECT_LE(open_descriptors(), before + 2) << "descriptors leaked";
}

}  // namespace
}  // namespace refit::testing
