// Delta updates over the tcp engine's star (docs/delta.md): the trainer sends each
// bucket encoded against the version its workers hold; a worker that does not hold
// it is sent the update full, automatically. Every update is checked byte for byte
// and by fingerprint on every worker.
#include <refit/engines/tcp/tcp.h>

#include <map>
#include <mutex>
#include <random>

#include <gtest/gtest.h>
#include <asio/io_context.hpp>

#include <refit/backend/links/wire.h>
#include <refit/integrity/fingerprint.h>
#include <refit/model/host_copy_target.h>
#include <refit/session.h>

#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {
namespace {

weight_transfer_config tcp_config() {
  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = std::chrono::seconds(10);
  return config;
}

// A model whose tensors live in host memory it offers to the engine (direct
// receive: what deltas decode against). Loads of views elsewhere (a staged
// commit's stage, staging slots) are copied in.
class host_model final : public model_target {
 public:
  explicit host_model(const update_metadata& meta, bool offer = true) : offer_(offer) {
    for (const auto& t : meta.tensors) {
      specs_.push_back(t);
      bytes_[t.name].assign(t.nbytes(), std::byte{0});
    }
  }
  void load_weights(std::span<const tensor_view> weights) override {
    std::lock_guard lock(mutex_);
    if (fail_next_load_) {
      fail_next_load_ = false;
      throw std::runtime_error("the model failed this load (test)");
    }
    for (const auto& v : weights) {
      auto& mine = bytes_.at(std::string(v.name));
      if (mine.size() != v.nbytes()) throw std::runtime_error("size differs");
      if (v.data != mine.data() && v.nbytes() != 0) std::memcpy(mine.data(), v.data, v.nbytes());
    }
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    if (!offer_) return std::nullopt;
    auto& mine = bytes_.at(spec.name);
    return tensor_view(spec, mine.data());
  }
  std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names) override {
    return fingerprint_all(views(), names);
  }
  std::vector<tensor_view> views() {
    std::vector<tensor_view> out;
    for (const auto& s : specs_) out.emplace_back(s, bytes_.at(s.name).data());
    return out;
  }
  const std::vector<std::byte>& bytes(const std::string& name) const { return bytes_.at(name); }
  // Changes bytes of `name` behind the engine's back (several, far apart: a delta
  // that happens to rewrite one of their elements does not undo them all).
  void tamper(const std::string& name) {
    std::lock_guard lock(mutex_);
    auto& b = bytes_.at(name);
    for (std::size_t i = 1; i < b.size(); i += 1001) b[i] ^= std::byte{0xff};
  }
  void fail_next_load() {
    std::lock_guard lock(mutex_);
    fail_next_load_ = true;
  }

 private:
  bool offer_;
  std::mutex mutex_;
  bool fail_next_load_ = false;
  std::vector<tensor_spec> specs_;
  std::map<std::string, std::vector<std::byte>> bytes_;
};

asio::awaitable<void> send(tcp::sender& sender, const update_metadata& meta, std::vector<tensor_view> views) {
  co_await trainer_send_weights(sender, meta, views);
}

asio::awaitable<void> receive(tcp::engine& engine, std::unique_ptr<update_info> info, load_weights_fn load) {
  co_await engine.receive_weights(*info, std::move(load));
  co_await engine.drain_pending();
}

// A trainer with deltas on and `workers` tcp workers (a star, or `topology`), each
// with its model.
struct rig {
  asio::io_context io;
  tcp::sender sender{tcp_config(), trainer_context{io.get_executor(), {}}};
  tensor_set set;
  std::vector<std::unique_ptr<host_model>> models;
  std::vector<std::unique_ptr<host_copy_target>> copies;  // by worker, with `copy` (else null)
  std::vector<std::unique_ptr<tcp::engine>> engines;
  json args;
  std::mt19937 rng{7};
  bool copy_ = false;

  // copy: each worker's engine gets a host_copy_target over its model (which then
  // usually offers no memory of its own: offer = false).
  rig(int workers, bool checksums, bool offer = true, const std::string& topology = "star", bool copy = false)
      : copy_(copy) {
    // bf16 weights around bucket-sized and larger (split over buckets), an fp32
    // norm, an odd-sized tensor, padding between them.
    set.add("embed", dtype::bfloat16, {40000}, 1);  // 80000 bytes: split over 16 KiB buckets
    set.add("norm", dtype::float32, {333}, 2);
    set.add("w1", dtype::bfloat16, {64, 100}, 3);
    set.add("bias", dtype::bfloat16, {7}, 4);
    set.add("w2", dtype::bfloat16, {3000}, 5);
    args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", workers + 1},
            {"buffer_bytes", 16384},         {"num_buffers", 3}, {"checksums", checksums},
            {"topology", topology},          {"delta", true}};
    for (int i = 0; i < workers; ++i) add_worker(offer);
    connect();
  }
  void add_worker(bool offer) {
    models.push_back(std::make_unique<host_model>(set.meta, offer));
    copies.push_back(copy_ ? std::make_unique<host_copy_target>(models.back().get()) : nullptr);
    model_target* target = copy_ ? static_cast<model_target*>(copies.back().get()) : models.back().get();
    engines.push_back(std::make_unique<tcp::engine>(tcp_config(), engine_context{io.get_executor(), {}, {}, target}));
  }
  load_weights_fn load_of(std::size_t i) {
    auto load = models[i]->as_load_weights();
    return copies[i] ? copies[i]->loading_through(std::move(load)) : load;
  }
  // (Re)connects every worker.
  void connect() {
    json init = sender.prepare(args);
    std::vector<std::shared_ptr<outcome>> all{spawn(io, sender.connect_workers())};
    std::vector<std::unique_ptr<init_info>> infos;
    for (std::size_t i = 0; i < engines.size(); ++i) {
      init["rank_offset"] = 1 + static_cast<int>(i);
      infos.push_back(engines[i]->parse_init_info(init));
      all.push_back(spawn(io, engines[i]->init_transfer_engine(*infos.back())));
    }
    ASSERT_TRUE(run_until(io, [&] {
      for (auto& o : all)
        if (!o->done) return false;
      return true;
    })) << "a hang";
    for (auto& o : all) ASSERT_FALSE(o->error) << o->message();
  }
  // Changes about `fraction` of every tensor's elements (a bf16 ulp step; fp32: one
  // mantissa bit); fraction 1: every byte new and random.
  void change(double fraction) {
    std::bernoulli_distribution pick(fraction);
    for (std::size_t t = 0; t < set.data.size(); ++t) {
      auto& d = set.data[t];
      if (fraction >= 1) {
        for (auto& b : d) b = static_cast<std::byte>(rng());
        continue;
      }
      const std::size_t elem = element_size(set.meta.tensors[t].dtype);
      for (std::size_t i = 0; i < d.size() / elem; ++i)
        if (pick(rng)) d[i * elem] ^= std::byte{1};
    }
  }
  // One update to every worker; returns each receive's outcome, then the send's.
  std::vector<std::shared_ptr<outcome>> update(const char* commit = "in_place") {
    json j = json::object();
    write_update_metadata(set.meta, j);
    j["commit"] = commit;
    std::vector<std::shared_ptr<outcome>> all;
    std::vector<std::unique_ptr<update_info>> infos;
    for (std::size_t i = 0; i < engines.size(); ++i)
      all.push_back(spawn(io, receive(*engines[i], engines[i]->parse_update_info(j), load_of(i))));
    all.push_back(spawn(io, send(sender, set.meta, set.views())));
    EXPECT_TRUE(run_until(io, [&] {
      for (auto& o : all)
        if (!o->done) return false;
      return true;
    })) << "a hang";
    return all;
  }
  void update_ok(const char* commit = "in_place") {
    for (auto& o : update(commit)) ASSERT_FALSE(o->error) << o->message();
  }
  // Every worker holds exactly the trainer's bytes, by bytes and by fingerprint,
  // and knows the version the trainer sent with the trainer's fingerprint.
  void expect_exact(const std::string& when) {
    const auto expected = fingerprint_all(set.views());
    const auto& st = sender.last_delta_stats();
    for (std::size_t w = 0; w < models.size(); ++w) {
      for (std::size_t t = 0; t < set.data.size(); ++t)
        EXPECT_TRUE(models[w]->bytes(set.meta.tensors[t].name) == set.data[t])
            << when << ": worker " << w << " tensor '" << set.meta.tensors[t].name << "' differs";
      EXPECT_TRUE(compare_fingerprints(expected, models[w]->fingerprint({})).empty())
          << when << ": worker " << w << "'s fingerprints differ from the trainer's";
      auto held = engines[w]->held();
      ASSERT_TRUE(held) << when << ": worker " << w << " does not know its version";
      EXPECT_EQ(held->version, st.version) << when;
      EXPECT_EQ(held->fingerprint, st.fingerprint) << when;
    }
  }
  ~rig() {
    for (auto& e : engines) e->shutdown();
    sender.shutdown();
  }
};

class delta_updates : public ::testing::TestWithParam<bool> {};  // checksums

TEST_P(delta_updates, sparse_updates_in_a_row_are_sent_as_deltas_and_land_exactly) {
  rig r(2, GetParam());
  r.update_ok();
  auto st = r.sender.last_delta_stats();
  EXPECT_EQ(st.version, 1u);
  EXPECT_EQ(st.base_version, 0u) << "the first update has no base";
  EXPECT_EQ(st.delta_workers, 0u);
  EXPECT_EQ(st.encoded_buckets, 0u);
  r.expect_exact("first (full) update");
  for (int k = 0; k < 4; ++k) {
    r.change(0.01);
    r.update_ok();
    st = r.sender.last_delta_stats();
    const std::string when = "delta update " + std::to_string(k + 1);
    EXPECT_EQ(st.base_version, st.version - 1) << when;
    EXPECT_EQ(st.delta_workers, 2u) << when;
    EXPECT_EQ(st.full_fallbacks, 0u) << when;
    EXPECT_EQ(st.encoded_buckets, r.sender.last_send_stats().buckets) << when << ": every bucket as a delta";
    EXPECT_LT(st.delta_bytes * 5, st.full_bytes) << when << ": 1% changed should cost far less than full";
    r.expect_exact(when);
  }
  // Nothing changed at all: still exact.
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 2u);
  r.expect_exact("an unchanged update");
}

TEST_P(delta_updates, one_update_asked_full_goes_full_and_the_next_is_a_delta_again) {
  rig r(2, GetParam());
  r.update_ok();
  r.change(0.01);
  r.sender.set_next_send({.delta = false});
  r.update_ok();
  auto st = r.sender.last_delta_stats();
  EXPECT_EQ(st.version, 2u) << "a full update is still a numbered version";
  EXPECT_EQ(st.base_version, 0u) << "no base offered";
  EXPECT_EQ(st.delta_workers + st.full_fallbacks, 0u);
  for (auto& e : r.engines) EXPECT_GE(e->last_update_stats().wire_bytes, e->last_update_stats().bytes);  // (padding)
  r.expect_exact("the update asked full");
  // The choice held for that send only.
  r.change(0.01);
  r.update_ok();
  st = r.sender.last_delta_stats();
  EXPECT_EQ(st.base_version, 2u);
  EXPECT_EQ(st.delta_workers, 2u);
  r.expect_exact("the delta after it");
}

TEST_P(delta_updates, a_host_copy_lets_a_model_without_readable_memory_take_deltas) {
  // The models offer no memory (vLLM's fused parameters, device memory): each
  // engine keeps a host copy, which deltas decode against, in place and staged.
  rig r(2, GetParam(), /*offer=*/false, "star", /*copy=*/true);
  r.update_ok();
  r.expect_exact("first (full) update");
  for (const char* commit : {"in_place", "in_place", "staged", "staged", "in_place"}) {
    r.change(0.01);
    r.update_ok(commit);
    const auto st = r.sender.last_delta_stats();
    EXPECT_EQ(st.delta_workers, 2u) << commit;
    EXPECT_EQ(st.full_fallbacks, 0u) << commit;
    for (auto& e : r.engines) EXPECT_LT(e->last_update_stats().wire_bytes * 5, e->last_update_stats().bytes) << commit;
    r.expect_exact(std::string("a delta through the host copy, ") + commit);
  }
  for (auto& c : r.copies) EXPECT_EQ(c->bytes(), r.set.meta.total_bytes());
  // A failed load leaves the copy ahead of what the model got: refused, sent full.
  r.models[1]->fail_next_load();
  r.change(0.01);
  auto outcomes = r.update();
  EXPECT_TRUE(outcomes[1]->error) << "the failed load is the worker's error";
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().full_fallbacks, 1u);
  r.expect_exact("after the failed load");
}

TEST_P(delta_updates, every_element_new_falls_back_to_full_buckets) {
  rig r(1, GetParam());
  r.update_ok();
  r.change(1.0);
  r.update_ok();
  const auto st = r.sender.last_delta_stats();
  EXPECT_EQ(st.delta_workers, 1u) << "the worker held the base and took the offer";
  EXPECT_EQ(st.encoded_buckets, 0u) << "random new bytes: no delta is smaller than the bucket";
  r.expect_exact("a 100% change");
  r.change(0.02);
  r.update_ok();
  EXPECT_GT(r.sender.last_delta_stats().encoded_buckets, 0u);
  r.expect_exact("a delta after it");
}

TEST_P(delta_updates, staged_commits_decode_into_the_stage_from_the_model) {
  rig r(2, GetParam());
  r.update_ok("staged");
  r.expect_exact("first staged update");
  for (int k = 0; k < 3; ++k) {
    r.change(0.01);
    r.update_ok("staged");
    const auto st = r.sender.last_delta_stats();
    EXPECT_EQ(st.delta_workers, 2u);
    EXPECT_GT(st.encoded_buckets, 0u);
    r.expect_exact("staged delta " + std::to_string(k + 1));
    for (auto& e : r.engines) EXPECT_FALSE(e->weights_dirty());
  }
  // In place and staged updates mix: the base is the version, not the mode.
  r.change(0.01);
  r.update_ok("in_place");
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 2u);
  r.expect_exact("in place after staged");
}

TEST_P(delta_updates, a_dirty_worker_refuses_the_base_and_is_sent_the_update_full) {
  rig r(2, GetParam());
  r.update_ok();
  // Worker 0's model fails a load: its weights are a mix of two versions (dirty).
  r.change(0.01);
  r.models[0]->fail_next_load();
  auto got = r.update();
  ASSERT_TRUE(got[0]->error) << "the load failure is reported on worker 0";
  EXPECT_FALSE(got[1]->error) << got[1]->message();
  EXPECT_FALSE(got[2]->error) << "the trainer's send completes: " << got[2]->message();
  EXPECT_TRUE(r.engines[0]->weights_dirty());
  // The next delta: worker 0 does not hold the base (dirty) and gets it full.
  r.change(0.01);
  r.update_ok();
  auto st = r.sender.last_delta_stats();
  EXPECT_EQ(st.full_fallbacks, 1u);
  EXPECT_EQ(st.delta_workers, 1u);
  r.expect_exact("after a fallback for a dirty worker");
  // A direct user marks the weights clean after a full update (sessions do it
  // themselves); from then on worker 0 takes deltas again.
  r.engines[0]->mark_weights_clean();
  r.change(0.01);
  r.update_ok();
  st = r.sender.last_delta_stats();
  EXPECT_EQ(st.full_fallbacks, 0u);
  EXPECT_EQ(st.delta_workers, 2u);
  r.expect_exact("deltas again");
}

TEST_P(delta_updates, a_worker_that_missed_updates_is_sent_the_update_full) {
  rig r(2, GetParam());
  r.update_ok();
  r.change(0.01);
  r.update_ok();
  // Worker 1 is replaced by a new one (its model zeroed: it missed every update);
  // the trainer keeps its base across the reconnection, and so does worker 0.
  r.engines[1]->shutdown();
  r.engines.pop_back();
  r.models.pop_back();
  r.add_worker(true);
  r.connect();
  r.change(0.01);
  r.update_ok();
  auto st = r.sender.last_delta_stats();
  EXPECT_EQ(st.delta_workers, 1u) << "worker 0 still holds the base";
  EXPECT_EQ(st.full_fallbacks, 1u) << "the new worker does not";
  r.expect_exact("after a fallback for a new worker");
  r.change(0.01);
  r.update_ok();
  st = r.sender.last_delta_stats();
  EXPECT_EQ(st.delta_workers, 2u);
  r.expect_exact("both on deltas");
}

TEST_P(delta_updates, a_model_without_memory_to_decode_into_is_sent_full) {
  rig r(1, GetParam(), /*offer=*/false);
  for (int k = 0; k < 3; ++k) {
    r.update_ok();
    const auto st = r.sender.last_delta_stats();
    EXPECT_EQ(st.delta_workers, 0u);
    EXPECT_EQ(st.full_fallbacks, k == 0 ? 0u : 1u);
    r.expect_exact("update " + std::to_string(k));
    r.change(0.01);
  }
}

// Bytes changed behind refit's back: the worker still names the base, decodes the
// delta against other bytes and gets other bytes. With checksums the bucket fails
// its check (integrity_error); without, the worker's fingerprint (of the bytes it
// holds) differs from the trainer's, so the next offer is refused and the worker is
// sent the update full. Either way it ends exact.
// Bytes written into the model outside refit since the base arrived (a reload, a
// tensor changed in place): the worker's record of the version still matches the
// trainer's offer, but the tensors do not. The worker hashes what they hold before
// it answers the offer, refuses the base and is sent the update full: exact, with
// checksums or without.
TEST_P(delta_updates, bytes_changed_behind_refits_back_get_the_update_full) {
  const bool checksums = GetParam();
  rig r(1, checksums);
  r.update_ok();
  r.change(0.01);
  r.update_ok();
  ASSERT_EQ(r.sender.last_delta_stats().delta_workers, 1u);
  r.models[0]->tamper("w1");
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().full_fallbacks, 1u);
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 0u);
  ASSERT_TRUE(r.engines[0]->held());
  EXPECT_EQ(r.engines[0]->held()->fingerprint, r.sender.last_delta_stats().fingerprint);
  r.expect_exact("after the full fallback");
  // And the next update is a delta again.
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 1u);
  r.expect_exact("after the next delta");
}

// A chunk staged in an update session is committed by the session, or never: the
// worker takes its version as the base once the session commits; after an abort
// (the model still holds the version before) it holds that one again, so the next
// delta offer (against the aborted version) is refused and the update sent full.
TEST_P(delta_updates, a_chunk_staged_in_a_session_is_the_base_once_committed_and_not_after_an_abort) {
  rig r(1, GetParam());
  r.update_ok();
  const auto first = r.engines[0]->held();
  ASSERT_TRUE(first);
  // One staged chunk in a session of its own; `finish`: commit it (else abort).
  const auto staged_session = [&r](bool finish, std::int64_t version) {
    weight_update_session session(*r.engines[0]);
    session.start_weight_update();
    json j = json::object();
    write_update_metadata(r.set.meta, j);
    j["commit"] = "staged";
    auto info = r.engines[0]->parse_update_info(j);
    auto staged = spawn(r.io, session.update_weights(*info, r.models[0]->as_load_weights()));
    auto sent = spawn(r.io, send(r.sender, r.set.meta, r.set.views()));
    ASSERT_TRUE(run_until(r.io, [&] { return staged->done && sent->done; })) << "a hang";
    ASSERT_FALSE(staged->error) << staged->message();
    ASSERT_FALSE(sent->error) << sent->message();
    EXPECT_FALSE(r.engines[0]->held()) << "a staged chunk of an open session is no base yet";
    if (finish)
      run_to_completion(r.io, session.finish_weight_update(version));
    else
      run_to_completion(r.io, session.abort_weight_update("test"));
  };
  const auto before = r.set.data;
  r.change(0.01);
  staged_session(false, 2);
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 1u) << "the chunk itself came as deltas";
  for (std::size_t t = 0; t < before.size(); ++t)
    EXPECT_TRUE(r.models[0]->bytes(r.set.meta.tensors[t].name) == before[t]) << "the abort left the model as it was";
  ASSERT_TRUE(r.engines[0]->held()) << "after the abort the model holds the version before again";
  EXPECT_EQ(r.engines[0]->held()->version, first->version);
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().full_fallbacks, 1u) << "the offer was against the aborted version";
  r.expect_exact("after an aborted staged session");
  // A committed session: its version is the next base.
  r.change(0.01);
  staged_session(true, 4);
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 1u);
  r.expect_exact("after a committed staged session");
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 1u) << "the committed chunk was taken as the base";
  EXPECT_EQ(r.sender.last_delta_stats().full_fallbacks, 0u);
  r.expect_exact("a delta after a committed staged session");
}

TEST(delta_options, an_update_larger_than_the_snapshot_bound_goes_plain_and_lets_the_snapshot_go) {
  rig r(1, false);
  r.update_ok();
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 1u);
  EXPECT_GE(r.sender.last_delta_stats().snapshot_bytes, r.sender.last_delta_stats().full_bytes);
  // A bound below the update: plain updates, no snapshot, no version claimed.
  r.args["delta_max_bytes"] = 1000;
  r.connect();
  r.change(0.01);
  r.update_ok();
  auto st = r.sender.last_delta_stats();
  EXPECT_TRUE(st.over_bound);
  EXPECT_EQ(st.snapshot_bytes, 0u);
  EXPECT_EQ(st.version, 0u);
  EXPECT_EQ(st.delta_workers + st.full_fallbacks, 0u);
  EXPECT_TRUE(r.sender.last_send_info().at("delta").at("over_bound").get<bool>());
  EXPECT_FALSE(r.engines[0]->held()) << "a plain update leaves no version to take deltas against";
  for (std::size_t t = 0; t < r.set.data.size(); ++t)
    EXPECT_TRUE(r.models[0]->bytes(r.set.meta.tensors[t].name) == r.set.data[t]) << r.set.meta.tensors[t].name;
  // A bound above it: deltas again (the first update after has no base).
  r.args["delta_max_bytes"] = 1 << 30;
  r.connect();
  for (int k = 0; k < 2; ++k) {
    r.change(0.01);
    r.update_ok();
  }
  st = r.sender.last_delta_stats();
  EXPECT_FALSE(st.over_bound);
  EXPECT_EQ(st.delta_workers, 1u);
  r.expect_exact("deltas again under the bound");
}

TEST(delta_options, a_delta_asked_of_a_sender_without_deltas_is_refused) {
  asio::io_context io;
  tcp::sender plain(tcp_config(), trainer_context{io.get_executor(), {}});
  plain.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
  try {
    plain.set_next_send({.delta = true});
    FAIL() << "accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument) << e.message();
    EXPECT_NE(e.message().find("prepared without"), std::string::npos) << e.message();
  }
  plain.set_next_send({.delta = false});  // full: what it does anyway
  plain.shutdown();
  // An engine that sends no deltas at all (weight_sender's own answer).
  struct no_deltas final : weight_sender {
    std::string_view backend() const noexcept override { return "test"; }
    json prepare(const json&) override { return json::object(); }
    asio::awaitable<void> connect_workers() override { co_return; }
    asio::awaitable<void> send_weights(const update_metadata&, tensor_source&) override { co_return; }
    void shutdown() override {}
  } other;
  try {
    other.set_next_send({.delta = true});
    FAIL() << "accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported) << e.message();
  }
  other.set_next_send({.delta = false});
  other.set_next_send({});
}

TEST(delta_wire, headers_are_checked_strictly) {
  namespace wire = links::wire;
  wire::delta_header d;
  d.version = 2;
  EXPECT_EQ(wire::check_delta_header(d), "");
  d.flags = wire::delta_flag_has_base;
  d.base_version = 1;
  d.base_fingerprint = 42;
  EXPECT_EQ(wire::check_delta_header(d), "");
  auto bad = d;
  bad.base_version = 2;  // not before the version
  EXPECT_NE(wire::check_delta_header(bad), "");
  bad = d;
  bad.flags |= 2;
  EXPECT_NE(wire::check_delta_header(bad), "");
  bad = d;
  bad.magic ^= 1;
  EXPECT_NE(wire::check_delta_header(bad), "");
  bad = d;
  bad.flags = 0;  // a base named without an offer
  EXPECT_NE(wire::check_delta_header(bad), "");
  bad = d;
  bad.version = 0;
  EXPECT_NE(wire::check_delta_header(bad), "");

  wire::bucket_header h;
  h.index = 3;
  h.payload_bytes = 1000;
  EXPECT_EQ(wire::check_delta_bucket_header(h, 3, 1000, false, false), "") << "a full bucket";
  h.flags = wire::flag_delta;
  h.payload_bytes = 999;
  EXPECT_EQ(wire::check_delta_bucket_header(h, 3, 1000, false, true), "");
  EXPECT_NE(wire::check_delta_bucket_header(h, 3, 1000, false, false), "") << "deltas not accepted";
  h.payload_bytes = 1000;
  EXPECT_NE(wire::check_delta_bucket_header(h, 3, 1000, false, true), "") << "a delta as large as the bucket";
  h.payload_bytes = 10;
  EXPECT_NE(wire::check_delta_bucket_header(h, 4, 1000, false, true), "") << "another bucket";
  EXPECT_NE(wire::check_delta_bucket_header(h, 3, 1000, true, true), "") << "checksum flag missing";
  h.flags |= 8;
  EXPECT_NE(wire::check_delta_bucket_header(h, 3, 1000, false, true), "") << "unknown flags";
}

INSTANTIATE_TEST_SUITE_P(checksums, delta_updates, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "with_checksums" : "without_checksums"; });

// Relays forward the encoded bytes: every worker of a chain or a tree decodes the
// same delta against its own base.
class delta_relays : public ::testing::TestWithParam<const char*> {};

TEST_P(delta_relays, every_worker_below_a_relay_takes_the_deltas_exactly) {
  rig r(4, true, true, GetParam());
  r.update_ok();
  r.expect_exact("the first update");
  for (int i = 0; i < 3; ++i) {
    r.change(0.01);
    r.update_ok();
    const auto st = r.sender.last_delta_stats();
    EXPECT_EQ(st.delta_workers, 4u);
    EXPECT_EQ(st.full_fallbacks, 0u);
    EXPECT_GT(st.encoded_buckets, 0u);
    r.expect_exact("delta " + std::to_string(i + 1));
    for (std::size_t w = 0; w < r.engines.size(); ++w) {
      const auto& u = r.engines[w]->last_update_stats();
      EXPECT_LT(u.wire_bytes * 5, u.bytes) << "worker " << w << " received the bucket bytes, not their deltas";
    }
  }
}

TEST_P(delta_relays, a_worker_without_the_base_gets_its_stream_full_and_deltas_resume) {
  rig r(4, true, true, GetParam());
  r.update_ok();
  r.change(0.01);
  r.update_ok();
  // Worker rank 3: the third of the chain; in tree:2 a child of rank 1 (the
  // trainer's streams go to ranks 1 and 2).
  r.models[2]->tamper("w1");
  r.change(0.01);
  r.update_ok();
  const auto st = r.sender.last_delta_stats();
  const bool chain = std::string(GetParam()) == "chain";
  EXPECT_EQ(st.full_fallbacks, chain ? 4u : 3u) << "every worker the refusing worker's stream reaches";
  EXPECT_EQ(st.delta_workers, chain ? 0u : 1u);
  r.expect_exact("after the full stream");
  r.change(0.01);
  r.update_ok();
  EXPECT_EQ(r.sender.last_delta_stats().delta_workers, 4u);
  r.expect_exact("deltas again");
}

INSTANTIATE_TEST_SUITE_P(topologies, delta_relays, ::testing::Values("chain", "tree:2"),
                         [](const auto& info) { return std::string(info.param) == "chain" ? "chain" : "tree2"; });

}  // namespace
}  // namespace refit::testing
