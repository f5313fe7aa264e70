// control::worker_group (lib/control/worker_group.h): the trainer's whole update
// sequence against in-process worker hosts over the tcp engine, and
// control::client::call's awaitables built from temporaries.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/write.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/control/worker_group.h>
#include "tests/support/control_fixture.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

// An engine that refuses every init (registered as "tcp" for one worker).
class refusing_engine final : public backend::engine {
 public:
  refusing_engine(const weight_transfer_config& config, const engine_context& context)
      : engine(config, context, capabilities_of()) {}
  static engine_capabilities capabilities_of() { return {}; }
  std::string_view backend() const noexcept override { return "tcp"; }
  std::unique_ptr<init_info> parse_init_info(const json&) const override { return std::make_unique<init_info>(); }
  std::unique_ptr<update_info> parse_update_info(const json&) const override { return std::make_unique<update_info>(); }

 protected:
  asio::awaitable<void> do_init(const init_info&) override {
    throw_error(errc::invalid_state, "this worker refuses every init");
    co_return;
  }
  asio::awaitable<void> do_receive(const update_info&, load_weights_fn) override { co_return; }
  void do_shutdown() override {}
};

// One in-process worker: a host with its own factory and model.
struct worker {
  worker(asio::io_context& io, std::string tamper, bool refuse_init, std::uint64_t max_stage_bytes)
      : model(std::move(tamper)) {
    if (refuse_init)
      factory.register_engine<refusing_engine, void>("tcp");
    else
      factory.register_engine<tcp::engine, tcp::sender>("tcp");
    weight_transfer_config config = tcp_config();
    config.max_stage_bytes = max_stage_bytes;
    host = std::make_unique<control::worker_host>(config, engine_context{io.get_executor(), {}, {}, &model},
                                                  model.as_load_weights(), factory);
    port = host->listen("127.0.0.1", 0);
    spawn(io, host->serve());
  }
  engine_factory factory;
  holding_model model;
  std::unique_ptr<control::worker_host> host;
  std::uint16_t port = 0;
};

struct worker_setup {
  std::string tamper;  // a tensor whose bytes this worker alters
  bool refuse_init = false;
  std::uint64_t max_stage_bytes = 0;  // its stage's bound (0: none)
  bool linked = false;                // the trainer reaches its control port through a control_link
};

// A TCP link from the trainer's group to one worker's control port that can be cut
// silently, as a partition or a stopped process would: once frozen, what either
// side sends is swallowed, nothing is refused and no connection closes.
class control_link {
 public:
  control_link(asio::io_context& io, std::uint16_t to)
      : io_(io), to_(to), acceptor_(io, {asio::ip::make_address("127.0.0.1"), 0}) {
    asio::co_spawn(io_, accept(), asio::detached);
  }
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  void freeze() { *frozen_ = true; }
  void close() {
    std::error_code ec;
    acceptor_.close(ec);
    for (auto& s : sockets_) s->close(ec);
  }

 private:
  using socket = asio::ip::tcp::socket;
  asio::awaitable<void> accept() {
    for (;;) {
      std::error_code ec;
      auto from = std::make_shared<socket>(io_);
      co_await acceptor_.async_accept(*from, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return;
      auto to = std::make_shared<socket>(io_);
      co_await to->async_connect({asio::ip::make_address("127.0.0.1"), to_},
                                 asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        from->close(ec);
        continue;
      }
      sockets_.push_back(from);
      sockets_.push_back(to);
      asio::co_spawn(io_, pump(from, to, frozen_), asio::detached);
      asio::co_spawn(io_, pump(to, from, frozen_), asio::detached);
    }
  }
  static asio::awaitable<void> pump(std::shared_ptr<socket> from, std::shared_ptr<socket> to,
                                    std::shared_ptr<bool> frozen) {
    std::vector<char> buf(64 << 10);
    for (;;) {
      std::error_code ec;
      const std::size_t n =
          co_await from->async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
      if (*frozen) continue;
      co_await asio::async_write(*to, asio::buffer(buf.data(), n), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
    }
    std::error_code ec;
    to->close(ec);
  }

  asio::io_context& io_;
  std::uint16_t to_;
  asio::ip::tcp::acceptor acceptor_;
  std::vector<std::shared_ptr<socket>> sockets_;
  std::shared_ptr<bool> frozen_ = std::make_shared<bool>(false);
};

class worker_group_test : public ::testing::Test {
 protected:
  void start(std::vector<worker_setup> setups, std::chrono::milliseconds deadline = 5s) {
    std::vector<control::worker_endpoint> endpoints;
    for (auto& s : setups) {
      workers_.push_back(std::make_unique<worker>(io_, s.tamper, s.refuse_init, s.max_stage_bytes));
      links_.push_back(s.linked ? std::make_unique<control_link>(io_, workers_.back()->port) : nullptr);
      endpoints.push_back({"127.0.0.1", s.linked ? links_.back()->port() : workers_.back()->port});
    }
    endpoints_ = endpoints;
    group_ = std::make_unique<control::worker_group>(io_.get_executor(), deadline, "", std::move(endpoints));
    sender_ = std::make_unique<tcp::sender>(tcp_config(), trainer_context{io_.get_executor(), {}});
    run_to_completion(io_, group_->connect());
  }
  // How the group names worker i in its errors.
  std::string named(std::size_t i) const {
    return "worker " + std::to_string(i) + " (127.0.0.1:" + std::to_string(endpoints_[i].port) + ")";
  }
  static control::update_options fleet_atomic() {
    control::update_options o;
    o.fleet_atomic = true;
    return o;
  }
  // A new trainer's group over the same workers (the old one closed), reaching
  // each directly (no control_link).
  void reconnect() {
    group_->close();
    run(io_, 200ms);
    endpoints_.clear();
    for (auto& w : workers_) endpoints_.push_back({"127.0.0.1", w->port});
    group_ = std::make_unique<control::worker_group>(io_.get_executor(), 5s, "", endpoints_);
    run_to_completion(io_, group_->connect());
  }
  // Polls worker i's weight_info (through the current group) until `done` holds
  // or 15 s pass (sanitizer builds are slow).
  bool wait_for(std::size_t i, const std::function<bool(const json&)>& done) {
    for (int tries = 0; tries < 150; ++tries) {
      json info;
      auto fetch = [&]() -> asio::awaitable<void> { info = co_await group_->at(i).call("weight_info"); };
      run_to_completion(io_, fetch());
      if (done(info)) return true;
      run(io_, 100ms);
    }
    return false;
  }
  json reconcile() {
    json report;
    auto go = [&]() -> asio::awaitable<void> { report = co_await group_->reconcile(); };
    run_to_completion(io_, go());
    return report;
  }
  void TearDown() override {
    if (group_) group_->close();
    for (auto& l : links_)
      if (l) l->close();
    for (auto& w : workers_) w->host->stop();
    if (sender_) sender_->shutdown();
    EXPECT_TRUE(run(io_, 5s)) << "stop() leaves nothing running";
  }

  json trainer_args() const {
    return {{"master_address", "127.0.0.1"},
            {"master_port", 0},
            {"world_size", workers_.size() + 1},
            {"buffer_bytes", 16384},
            {"num_buffers", 2}};
  }
  asio::awaitable<void> init() { co_await group_->init(*sender_, trainer_args()); }
  asio::awaitable<void> update_into(control::update_result& out, tensor_set& set, std::int64_t version,
                                    control::update_options options) {
    auto views = set.views();
    out = co_await group_->update(*sender_, set.meta, views, version, std::move(options));
  }
  // Runs an update; its error (or nullopt).
  std::optional<error> try_update(tensor_set& set, std::int64_t version, control::update_result& result,
                                  control::update_options options = {}) {
    try {
      run_to_completion(io_, update_into(result, set, version, std::move(options)));
    } catch (const error& e) {
      return e;
    }
    return std::nullopt;
  }
  std::vector<json> call_all(const std::string& method) {
    std::vector<json> out;
    run_to_completion(io_, call_all_into(method, out));
    return out;
  }
  asio::awaitable<void> call_all_into(std::string method, std::vector<json>& out) {
    out = co_await group_->call_all(std::move(method));
  }

  // Every worker holds exactly `set` at `version`, clean, with no session open.
  void expect_at(tensor_set& set, std::int64_t version) {
    std::vector<std::vector<std::string>> diffs;
    auto fetch = [&]() -> asio::awaitable<void> {
      diffs = co_await group_->fingerprint_differences(fingerprint_all(set.views()), version);
    };
    run_to_completion(io_, fetch());
    for (std::size_t w = 0; w < diffs.size(); ++w)
      EXPECT_TRUE(diffs[w].empty()) << "worker " << w << ": " << diffs[w][0];
    for (const auto& info : call_all("weight_info")) EXPECT_EQ(info["session_active"], false) << info.dump();
  }

  static tensor_set model_tensors(std::uint64_t seed) {
    tensor_set set;
    for (int i = 0; i < 6; ++i) set.add("layer." + std::to_string(i), dtype::bfloat16, {64, 96}, seed);
    return set;
  }

  // init, then a first (staged) update of model_tensors(version) to every worker.
  tensor_set initialised_at(std::int64_t version) {
    run_to_completion(io_, init());
    tensor_set set = model_tensors(version);
    control::update_result result;
    const auto failure = try_update(set, version, result);
    EXPECT_FALSE(failure) << failure->message();
    return set;
  }
  // Worker i holds exactly `set` at `version`, clean (asked through the group).
  void expect_worker_at(std::size_t i, tensor_set& set, std::int64_t version) {
    json fp;
    auto fetch = [&]() -> asio::awaitable<void> { fp = co_await group_->at(i).call("weight_fingerprint"); };
    run_to_completion(io_, fetch());
    EXPECT_EQ(fp["state"], "clean") << "worker " << i << ": " << fp.dump();
    EXPECT_EQ(fp["weight_version"], version) << "worker " << i << ": " << fp.dump();
    json list = json::object();
    list["algorithm"] = fp["algorithm"];
    list["tensors"] = fp["tensors"];
    EXPECT_TRUE(compare_fingerprints(fingerprint_all(set.views()), fingerprints_from_json(list)).empty())
        << "worker " << i;
  }
  // reconcile()'s error message ("" if it succeeded).
  std::string reconcile_error() {
    std::string refused;
    auto go = [&]() -> asio::awaitable<void> {
      try {
        co_await group_->reconcile();
      } catch (const error& e) {
        refused = e.message();
      }
    };
    run_to_completion(io_, go());
    return refused;
  }

  asio::io_context io_;
  std::vector<std::unique_ptr<worker>> workers_;
  std::vector<std::unique_ptr<control_link>> links_;  // per worker; null where none
  std::vector<control::worker_endpoint> endpoints_;   // the current group's
  std::unique_ptr<control::worker_group> group_;
  std::unique_ptr<tcp::sender> sender_;
};

TEST_F(worker_group_test, a_full_update_of_two_workers_ends_verified_at_its_version) {
  start({{}, {}});
  run_to_completion(io_, init());
  for (std::int64_t version : {7, 8}) {
    tensor_set set = model_tensors(static_cast<std::uint64_t>(version));
    control::update_result result;
    control::update_options options;
    options.commit = version == 8 ? commit_mode::staged : commit_mode::in_place;
    auto failure = try_update(set, version, result, options);
    ASSERT_FALSE(failure) << failure->message();
    EXPECT_TRUE(result.verified);
    EXPECT_EQ(result.version, version);
    EXPECT_GT(result.seconds, 0);
    ASSERT_EQ(result.workers.size(), 2u);
    for (const auto& w : result.workers) {
      EXPECT_EQ(w.stats["tensors"], 6) << w.finish.dump();
      EXPECT_EQ(w.stats["bytes"], set.meta.total_bytes()) << w.finish.dump();
      EXPECT_GT(w.seconds, 0);
      EXPECT_LE(w.seconds, result.seconds);
    }
    const auto infos = call_all("weight_info");
    for (const auto& info : infos) {
      EXPECT_EQ(info["weight_version"], version) << info.dump();
      EXPECT_EQ(info["state"], "clean") << info.dump();
    }
  }
}

// GCC 12 destroys an aggregate temporary passed by value to a coroutine in a
// co_await twice; the default options (a json inside) were a double free in the
// natural `co_await workers.update(sender, meta, views, version)` (seen in the
// consumer demo). The option structs are not aggregates, so this runs clean
// (and ASan, in ./refit check, would see a second destruction).
asio::awaitable<void> update_with_default_options(control::worker_group& group, tcp::sender& sender, tensor_set& set,
                                                  int& verified) {
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  co_await group.init(sender, args);
  auto views = set.views();
  for (std::int64_t version = 1; version <= 2; ++version) {
    auto result = co_await group.update(sender, set.meta, views, version);
    if (result.verified) ++verified;
  }
}

TEST_F(worker_group_test, default_options_passed_inside_co_await_are_destroyed_once) {
  start({{}});
  tensor_set set = model_tensors(3);
  int verified = 0;
  run_to_completion(io_, update_with_default_options(*group_, *sender_, set, verified));
  EXPECT_EQ(verified, 2);
}

TEST_F(worker_group_test, a_worker_holding_other_bytes_is_a_fingerprint_mismatch_naming_it) {
  start({{}, {"layer.3"}});
  run_to_completion(io_, init());
  tensor_set set = model_tensors(1);
  control::update_result result;
  auto failure = try_update(set, 5, result);
  ASSERT_TRUE(failure) << "the tampered worker passed the check";
  EXPECT_EQ(failure->kind(), errc::integrity_error) << failure->message();
  const std::string expected_name = named(1);
  EXPECT_NE(failure->message().find(expected_name), std::string::npos) << failure->message();
  EXPECT_NE(failure->message().find("'layer.3' differs"), std::string::npos) << failure->message();
  EXPECT_EQ(failure->message().find("worker 0"), std::string::npos) << failure->message();

  // Without the check the update itself succeeds; the differences, by worker.
  auto differences = [&]() -> asio::awaitable<std::vector<std::vector<std::string>>> {
    co_return co_await group_->fingerprint_differences(fingerprint_all(set.views()), 6);
  };
  control::update_options unchecked;
  unchecked.verify = false;
  failure = try_update(set, 6, result, unchecked);
  ASSERT_FALSE(failure) << failure->message();
  EXPECT_FALSE(result.verified);
  std::vector<std::vector<std::string>> diffs;
  auto fetch = [&]() -> asio::awaitable<void> { diffs = co_await differences(); };
  run_to_completion(io_, fetch());
  ASSERT_EQ(diffs.size(), 2u);
  EXPECT_TRUE(diffs[0].empty()) << diffs[0][0];
  ASSERT_EQ(diffs[1].size(), 1u);
  EXPECT_NE(diffs[1][0].find("'layer.3' differs"), std::string::npos) << diffs[1][0];
}

TEST_F(worker_group_test, the_check_also_wants_the_version) {
  start({{}, {}});
  run_to_completion(io_, init());
  tensor_set set = model_tensors(2);
  control::update_result result;
  control::update_options unchecked;
  unchecked.verify = false;
  ASSERT_FALSE(try_update(set, 3, result, unchecked));
  std::string message;
  auto check = [&]() -> asio::awaitable<void> {
    try {
      co_await group_->verify(fingerprint_all(set.views()), 4);
    } catch (const error& e) {
      message = e.message();
    }
  };
  run_to_completion(io_, check());
  EXPECT_NE(message.find("worker 0"), std::string::npos) << message;
  EXPECT_NE(message.find("version is 3"), std::string::npos) << message;
}

// Every worker's weight_info and fingerprints say `version` of `set`, clean, no
// session open.
TEST_F(worker_group_test, a_fleet_atomic_update_votes_then_commits_on_every_worker) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(10);
  control::update_result result;
  tensor_set set = model_tensors(11);
  control::update_options atomic = fleet_atomic();
  auto failure = try_update(set, 11, result, atomic);
  ASSERT_FALSE(failure) << failure->message();
  EXPECT_TRUE(result.verified);
  expect_at(set, 11);
  // Each worker keeps the version before it until the next update starts.
  for (const auto& info : call_all("weight_info")) {
    EXPECT_EQ(info["holds_undo"], true) << info.dump();
    EXPECT_EQ(info["undo_version"], 10) << info.dump();
  }
}

// A worker whose model cannot read its weights back (here: it holds none yet)
// cannot undo a commit: it refuses a fleet-atomic update before any byte moves.
TEST_F(worker_group_test, a_worker_that_cannot_undo_refuses_a_fleet_atomic_update_up_front) {
  start({{}, {}});
  run_to_completion(io_, init());
  tensor_set set = model_tensors(13);
  control::update_result result;
  control::update_options atomic = fleet_atomic();
  auto failure = try_update(set, 13, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::unsupported) << failure->message();
  EXPECT_NE(failure->message().find("cannot read back 'layer.0'"), std::string::npos) << failure->message();
  for (const auto& info : call_all("weight_info")) {
    EXPECT_EQ(info["session_active"], false) << info.dump();
    EXPECT_EQ(info["weight_version"], nullptr) << info.dump();
    EXPECT_EQ(info["last_update"]["bytes"], 0) << info.dump();
  }
}

TEST_F(worker_group_test, fleet_atomic_in_place_is_refused_before_any_worker_is_told) {
  start({{}, {}});
  run_to_completion(io_, init());
  tensor_set set = model_tensors(12);
  control::update_result result;
  control::update_options atomic = fleet_atomic();
  atomic.commit = commit_mode::in_place;
  auto failure = try_update(set, 12, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::invalid_argument) << failure->message();
  for (const auto& info : call_all("weight_info")) {
    EXPECT_EQ(info["session_active"], false) << info.dump();
    EXPECT_EQ(info["weight_version"], nullptr) << info.dump();
  }
}

// One worker refuses the update before a byte moves. Fleet-atomic or not, every
// worker's session is aborted, each keeps the old version untouched, and the
// same trainer's next update lands at once (before, the others' sessions stayed
// open until their idle deadline and refused it).
class worker_group_failure_test : public worker_group_test, public ::testing::WithParamInterface<bool> {};

TEST_P(worker_group_failure_test, a_worker_refusing_an_update_leaves_every_worker_at_the_old_version) {
  const bool atomic = GetParam();
  start({{}, {}, {}});
  run_to_completion(io_, init());
  tensor_set old_set = model_tensors(20);
  control::update_result result;
  control::update_options options;
  options.fleet_atomic = atomic;
  options.commit = commit_mode::staged;
  ASSERT_FALSE(try_update(old_set, 20, result));  // a fleet-atomic update needs weights to undo to

  tensor_set new_set = model_tensors(21);
  workers_[2]->model.refuse_next = true;
  auto failure = try_update(new_set, 21, result, options);
  ASSERT_TRUE(failure) << "the refusal was not reported";
  EXPECT_EQ(failure->kind(), errc::invalid_argument) << failure->message();
  const std::string refused = named(2);
  EXPECT_NE(failure->message().find(refused), std::string::npos) << failure->message();
  if (atomic) {
    EXPECT_NE(failure->message().find("no worker committed"), std::string::npos) << failure->message();
    // The workers relay as a chain: the refusal reaches the others as theirs.
    EXPECT_NE(failure->message().find(refused +
                                      ": failed in update_weights: invalid_argument: update_weights failed "
                                      "on worker 127.0.0.1:" +
                                      std::to_string(workers_[2]->port) + ": holding model: refused this update"),
              std::string::npos)
        << failure->message();
  }
  expect_at(old_set, 20);
  for (const auto& info : call_all("weight_info")) EXPECT_NE(info["last_error"], nullptr) << info.dump();

  // The tcp engine's data connections end with a failed update: init again.
  run_to_completion(io_, init());
  failure = try_update(new_set, 22, result, options);
  ASSERT_FALSE(failure) << failure->message();
  EXPECT_TRUE(result.verified);
  expect_at(new_set, 22);
}

INSTANTIATE_TEST_SUITE_P(fleet_atomic, worker_group_failure_test, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "fleet_atomic" : "staged"; });

// After every vote, one worker's commit fails (its load_weights throws on the
// first batch). It loads its previous version back itself, the workers that
// committed are rolled back, and every worker ends at the old version, whole; the
// error names each worker's outcome. The next update lands on all.
TEST_F(worker_group_test, a_commit_failing_after_every_vote_rolls_the_fleet_back) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(29);
  control::update_result result;
  tensor_set set = model_tensors(30);
  control::update_options atomic = fleet_atomic();
  workers_[1]->model.fail_next_load = true;
  auto failure = try_update(set, 30, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::processing_failed) << failure->message();
  const std::string& m = failure->message();
  EXPECT_NE(m.find("every worker keeps its previous version"), std::string::npos) << m;
  EXPECT_NE(m.find(named(1) + ": failed at its commit"), std::string::npos) << m;
  EXPECT_NE(m.find(named(0) + ": committed, rolled back"), std::string::npos) << m;
  EXPECT_NE(m.find(named(2) + ": committed, rolled back"), std::string::npos) << m;
  expect_at(old_set, 29);
  for (const auto& info : call_all("weight_info")) EXPECT_EQ(info["holds_undo"], false) << info.dump();

  failure = try_update(set, 31, result, atomic);
  ASSERT_FALSE(failure) << failure->message();
  expect_at(set, 31);
}

// A rollback that fails fences its worker: dirty, claiming no version; the others
// are at the old version. reconcile() then reports it fenced and leaves the rest;
// a full update makes every worker whole again.
TEST_F(worker_group_test, a_worker_whose_rollback_fails_is_fenced_and_reconcile_says_so) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(60);
  control::update_result result;
  tensor_set set = model_tensors(61);
  control::update_options atomic = fleet_atomic();
  workers_[1]->model.fail_next_load = true;  // its commit fails
  workers_[0]->model.fail_load_after = 1;    // its commit (one batch) loads, its rollback does not
  auto failure = try_update(set, 61, result, atomic);
  ASSERT_TRUE(failure);
  const std::string w0 = named(0);
  EXPECT_NE(failure->message().find(w0 + ": committed, and its rollback failed (fenced"), std::string::npos)
      << failure->message();
  EXPECT_NE(failure->message().find("the workers not fenced keep their previous version"), std::string::npos)
      << failure->message();
  auto infos = call_all("weight_info");
  EXPECT_EQ(infos[0]["state"], "dirty") << infos[0].dump();
  EXPECT_EQ(infos[0]["weight_version"], nullptr) << infos[0].dump();
  for (std::size_t i : {1u, 2u}) {
    EXPECT_EQ(infos[i]["state"], "clean") << infos[i].dump();
    EXPECT_EQ(infos[i]["weight_version"], 60) << infos[i].dump();
  }
  json report = reconcile();
  EXPECT_EQ(report["version"], 60) << report.dump();
  EXPECT_EQ(report["workers"][0]["action"], "fenced") << report.dump();
  EXPECT_EQ(report["workers"][1]["action"], "none") << report.dump();
  ASSERT_FALSE(try_update(set, 62, result));
  expect_at(set, 62);
}

// The restore inside a failing commit: the failure comes after a first batch
// was loaded (a model over 64 MiB, two batches), and the worker's whole previous
// version is back, not just the failing batch's.
TEST_F(worker_group_test, a_commit_failing_in_its_second_batch_loads_the_first_back_too) {
  start({{}});
  // Buckets of 4 MiB: 72 MiB in 16 KiB ones outlast the deadline under TSan.
  auto init_big = [&]() -> asio::awaitable<void> {
    json args = trainer_args();
    args["buffer_bytes"] = 4 << 20;
    co_await group_->init(*sender_, std::move(args));
  };
  run_to_completion(io_, init_big());
  auto big = [](std::uint64_t seed) {  // two batches: 36 + 36 MiB is over the commit's 64 MiB
    tensor_set set;
    for (int i = 0; i < 2; ++i) set.add("big." + std::to_string(i), dtype::uint8, {36ll << 20}, seed);
    return set;
  };
  tensor_set old_set = big(40);
  control::update_result result;
  ASSERT_FALSE(try_update(old_set, 40, result));
  tensor_set set = big(41);
  control::update_options atomic = fleet_atomic();
  workers_[0]->model.fail_load_after = 1;
  auto failure = try_update(set, 41, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_NE(failure->message().find("failed at its commit"), std::string::npos) << failure->message();
  expect_at(old_set, 40);
}

// Worker 2 goes away after its stream is in and before its vote (its host stops
// during the trainer's hold): its prepare fails, every other session is aborted,
// and workers 0 and 1 keep the old version, whole. reconcile() then fails naming
// the worker it cannot reach.
TEST_F(worker_group_test, a_worker_lost_before_its_vote_leaves_the_others_at_the_old_version) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(70);
  control::update_result result;
  tensor_set set = model_tensors(71);
  control::update_options atomic = fleet_atomic();
  atomic.hold_before_finish = 2s;  // the window between the streams and the votes
  asio::steady_timer lose(io_, 500ms);
  lose.async_wait([&](std::error_code) { workers_[2]->host->stop(); });
  auto failure = try_update(set, 71, result, atomic);
  ASSERT_TRUE(failure);
  const std::string w2 = named(2);
  EXPECT_NE(failure->message().find("no worker committed"), std::string::npos) << failure->message();
  EXPECT_NE(failure->message().find(w2 + ": failed in prepare_weight_update"), std::string::npos) << failure->message();
  for (std::size_t i : {0u, 1u}) expect_worker_at(i, old_set, 70);
  EXPECT_NE(reconcile_error().find(w2), std::string::npos);
}

// A trainer lost between its commits: workers 0 and 1 committed update 51, worker
// 2 voted yes and never heard; the trainer's connections close (its session on
// worker 2 is aborted: the old version, untouched). A new trainer's reconcile()
// rolls 0 and 1 back: every worker at 50, whole.
asio::awaitable<void> commit_on_some(control::worker_group& group, tcp::sender& sender, tensor_set& set,
                                     std::int64_t version, std::vector<std::size_t> committed) {
  json start = json::object();
  start["fleet_atomic"] = true;
  co_await group.call_all("start_weight_update", std::move(start));
  json info = json::object();
  write_update_metadata(set.meta, info);
  info["commit"] = "staged";
  auto views = set.views();
  std::span<const tensor_view> all(views);
  range_source<std::span<const tensor_view>> source(all);
  json body = json::object();
  body["update_info"] = std::move(info);
  co_await control::both(group.call_all("update_weights", std::move(body)), sender.send_weights(set.meta, source));
  co_await group.call_all("prepare_weight_update");
  for (std::size_t i : committed) {
    json finish = json::object();
    finish["weight_version"] = version;
    co_await group.at(i).call("finish_weight_update", std::move(finish));
  }
}

TEST_F(worker_group_test, reconcile_rolls_back_what_a_lost_trainer_committed_on_some_workers) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(50);
  control::update_result result;
  tensor_set new_set = model_tensors(51);
  run_to_completion(io_, commit_on_some(*group_, *sender_, new_set, 51, {0, 1}));
  reconnect();  // the trainer is gone; a new one connects
  json report = reconcile();
  EXPECT_EQ(report["version"], 50) << report.dump();
  ASSERT_EQ(report["workers"].size(), 3u) << report.dump();
  EXPECT_EQ(report["workers"][0]["action"], "rolled back") << report.dump();
  EXPECT_EQ(report["workers"][1]["action"], "rolled back") << report.dump();
  EXPECT_EQ(report["workers"][2]["action"], "none") << report.dump();
  expect_at(old_set, 50);
  // Once one version, reconcile has nothing to do.
  report = reconcile();
  EXPECT_EQ(report["version"], 50) << report.dump();
  for (const auto& w : report["workers"]) EXPECT_EQ(w["action"], "none") << report.dump();
}

// reconcile()'s own rollback failing (worker 0's load_weights throws): it fails
// naming that worker, which is fenced (dirty, no version); worker 1 was rolled
// back and worker 2 never committed, both at the old version. Called again,
// reconcile() reports the fenced worker and nothing else to do.
TEST_F(worker_group_test, reconcile_fences_a_worker_whose_rollback_fails) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(170);
  control::update_result result;
  tensor_set new_set = model_tensors(171);
  run_to_completion(io_, commit_on_some(*group_, *sender_, new_set, 171, {0, 1}));
  reconnect();
  workers_[0]->model.fail_next_load = true;  // its rollback's load
  const std::string refused = reconcile_error();
  EXPECT_NE(refused.find(named(0)), std::string::npos) << refused;
  for (std::size_t i : {1u, 2u}) expect_worker_at(i, old_set, 170);
  json report = reconcile();
  EXPECT_EQ(report["version"], 170) << report.dump();
  EXPECT_EQ(report["workers"][0]["action"], "fenced") << report.dump();
  EXPECT_EQ(report["workers"][0]["weight_version"], nullptr) << report.dump();
  for (std::size_t i : {1u, 2u}) EXPECT_EQ(report["workers"][i]["action"], "none") << report.dump();
}

// A worker whose commit outlasts the trainer's deadline (the call times out; the
// commit runs on): the trainer rolls the others back and names it in doubt, not
// at the old version. Once its late commit ends, a new trainer's reconcile()
// rolls it back too: every worker at the old version, whole.
TEST_F(worker_group_test, a_commit_past_its_deadline_is_in_doubt_and_reconcile_settles_it) {
  start({{}, {}, {}}, 2s);
  tensor_set old_set = initialised_at(80);
  control::update_result result;
  tensor_set set = model_tensors(81);
  control::update_options atomic = fleet_atomic();
  workers_[2]->model.stall_ms = 3000;
  workers_[2]->model.stall_load_after = 0;  // its commit's load
  auto failure = try_update(set, 81, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::timeout) << failure->message();
  const std::string w2 = named(2);
  const std::string& m = failure->message();
  EXPECT_NE(m.find(w2 + ": its commit's outcome is unknown (in doubt)"), std::string::npos) << m;
  EXPECT_NE(m.find("reconcile() brings those in doubt"), std::string::npos) << m;
  EXPECT_EQ(m.find("every worker keeps its previous version"), std::string::npos) << m;
  reconnect();
  ASSERT_TRUE(wait_for(2, [](const json& info) { return info.value("holds_undo", false); }))
      << "its late commit did not end";  // it holds 81, and the undo to 80
  json report = reconcile();
  EXPECT_EQ(report["version"], 80) << report.dump();
  EXPECT_EQ(report["workers"][2]["action"], "rolled back") << report.dump();
  expect_at(old_set, 80);
}

// The same for a rollback past the deadline: the worker is named in doubt, not
// fenced; its rollback ends on its own, and reconcile() finds one version.
TEST_F(worker_group_test, a_rollback_past_its_deadline_is_in_doubt_and_reconcile_finds_one_version) {
  start({{}, {}, {}}, 2s);
  tensor_set old_set = initialised_at(90);
  control::update_result result;
  tensor_set set = model_tensors(91);
  control::update_options atomic = fleet_atomic();
  workers_[1]->model.fail_next_load = true;  // its commit fails
  workers_[0]->model.stall_ms = 3000;
  workers_[0]->model.stall_load_after = 1;  // its commit loads (one batch), its rollback stalls
  auto failure = try_update(set, 91, result, atomic);
  ASSERT_TRUE(failure);
  const std::string w0 = named(0);
  const std::string& m = failure->message();
  EXPECT_NE(m.find(w0 + ": committed; its rollback's outcome is unknown (in doubt)"), std::string::npos) << m;
  EXPECT_EQ(m.find("fenced"), std::string::npos) << m;
  reconnect();
  ASSERT_TRUE(wait_for(0, [](const json& info) { return info.value("weight_version", json()) == json(90); }))
      << "its late rollback did not end";
  json report = reconcile();
  EXPECT_EQ(report["version"], 90) << report.dump();
  for (const auto& w : report["workers"]) EXPECT_EQ(w["action"], "none") << report.dump();
  expect_at(old_set, 90);
}

// A worker whose stage cannot hold the update (host memory bounded by
// max_stage_bytes) refuses it before a byte moves; every session is aborted and
// every worker keeps the old version.
TEST_F(worker_group_test, a_stage_too_small_on_one_worker_leaves_every_worker_at_the_old_version) {
  start({{}, {"", false, 16 << 10}, {}});  // the update is 72 KiB
  run_to_completion(io_, init());
  tensor_set old_set = model_tensors(100);
  control::update_result result;
  control::update_options in_place;  // the first update needs no stage
  in_place.commit = commit_mode::in_place;
  ASSERT_FALSE(try_update(old_set, 100, result, in_place));
  tensor_set set = model_tensors(101);
  control::update_options atomic = fleet_atomic();
  auto failure = try_update(set, 101, result, atomic);
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::resource_exhausted) << failure->message();
  const std::string w1 = named(1);
  EXPECT_NE(failure->message().find(w1 + ": failed in update_weights"), std::string::npos) << failure->message();
  EXPECT_NE(failure->message().find("no worker committed"), std::string::npos) << failure->message();
  expect_at(old_set, 100);
}

// A trainer lost after every worker voted and before any commit: each prepared
// session ends with its connection (staged: nothing reached a model), and a new
// trainer's reconcile() finds one version with nothing to do.
TEST_F(worker_group_test, a_trainer_lost_after_the_votes_leaves_every_worker_at_the_old_version) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(110);
  control::update_result result;
  tensor_set new_set = model_tensors(111);
  run_to_completion(io_, commit_on_some(*group_, *sender_, new_set, 111, {}));
  reconnect();
  json report = reconcile();
  EXPECT_EQ(report["version"], 110) << report.dump();
  for (const auto& w : report["workers"]) EXPECT_EQ(w["action"], "none") << report.dump();
  expect_at(old_set, 110);
  for (const auto& info : call_all("weight_info")) EXPECT_EQ(info["holds_undo"], false) << info.dump();
}

// Models that exchange (their own loader swaps model and stage bytes): the same
// outcomes as read back and load. A commit failing on worker 1 leaves every
// worker at the old version; the next commits exchange, and a rollback returns.
TEST_F(worker_group_test, models_that_exchange_commit_and_roll_back_the_same) {
  start({{}, {}, {}});
  for (auto& w : workers_) w->model.exchanges = true;
  tensor_set old_set = initialised_at(160);
  control::update_result result;
  tensor_set set = model_tensors(161);
  workers_[1]->model.fail_next_load = true;
  auto failure = try_update(set, 161, result, fleet_atomic());
  ASSERT_TRUE(failure);
  EXPECT_NE(failure->message().find(named(1) + ": failed at its commit"), std::string::npos) << failure->message();
  expect_at(old_set, 160);
  ASSERT_FALSE(try_update(set, 162, result, fleet_atomic()));
  expect_at(set, 162);
  for (auto& w : workers_) EXPECT_GE(w->model.exchanged.load(), 1) << "the commit did not exchange";
  for (const auto& a : call_all("rollback_weight_update")) EXPECT_EQ(a["weight_version"], 160) << a.dump();
  expect_at(old_set, 160);
}

// A worker that cannot reserve its undo's scratch (its stage's bound holds the
// update but not the scratch beside it) votes no: no worker commits, and every
// worker keeps the old version. Host memory cannot run out at a commit.
TEST_F(worker_group_test, a_worker_that_cannot_reserve_its_undo_votes_no) {
  start({{}, {"", false, 100 << 10}, {}});  // a 72 KiB stage and a 72 KiB scratch
  tensor_set old_set = initialised_at(120);
  control::update_result result;
  tensor_set set = model_tensors(121);
  auto failure = try_update(set, 121, result, fleet_atomic());
  ASSERT_TRUE(failure);
  EXPECT_EQ(failure->kind(), errc::resource_exhausted) << failure->message();
  const std::string& m = failure->message();
  EXPECT_NE(m.find(named(1) + ": failed in prepare_weight_update"), std::string::npos) << m;
  EXPECT_NE(m.find("needs a scratch of 73728 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("no worker committed"), std::string::npos) << m;
  expect_at(old_set, 120);
  // Without fleet-atomic the same worker takes it.
  ASSERT_FALSE(try_update(set, 122, result));
  expect_at(set, 122);
}

// A worker cut off from the trainer (its control link goes silent: a partition,
// a stopped process) once its stream is in: its vote never comes, the call's
// deadline passes, every other session is aborted and those workers keep the old
// version. Its own session ends with the trainer's connection (or its idle
// deadline): the old version, untouched, on every worker.
TEST_F(worker_group_test, a_worker_unreachable_at_its_vote_leaves_every_worker_at_the_old_version) {
  start({{}, {}, {"", false, 0, true}}, 2s);
  tensor_set old_set = initialised_at(130);
  control::update_result result;
  tensor_set set = model_tensors(131);
  control::update_options atomic = fleet_atomic();
  atomic.hold_before_finish = 1s;  // the window between the streams and the votes
  asio::steady_timer cut(io_, 300ms);
  cut.async_wait([&](std::error_code) { links_[2]->freeze(); });
  auto failure = try_update(set, 131, result, atomic);
  ASSERT_TRUE(failure);
  const std::string& m = failure->message();
  EXPECT_EQ(failure->kind(), errc::timeout) << m;
  EXPECT_NE(m.find(named(2) + ": failed in prepare_weight_update"), std::string::npos) << m;
  EXPECT_NE(m.find("no worker committed"), std::string::npos) << m;
  for (std::size_t i : {0u, 1u}) expect_worker_at(i, old_set, 130);
  // reconcile() through the silent link: its deadline, naming the worker.
  const std::string refused = reconcile_error();
  EXPECT_NE(refused.find(named(2)), std::string::npos) << refused;
  EXPECT_NE(refused.find("no progress within"), std::string::npos) << refused;
  links_[2]->close();  // the partition ends the trainer's connection to it
  reconnect();
  ASSERT_TRUE(wait_for(2, [](const json& info) { return info["session_active"] == false; }))
      << "its session did not end";
  expect_at(old_set, 130);
  json report = reconcile();
  for (const auto& w : report["workers"]) EXPECT_EQ(w["action"], "none") << report.dump();
}

// A worker killed inside its commit (its host stops while load_weights runs): the
// trainer cannot know how far it got and names it in doubt; every worker that
// committed is rolled back, so those that live are at the old version, whole, and
// reconcile() names the one it cannot reach.
TEST_F(worker_group_test, a_worker_killed_in_its_commit_leaves_the_others_at_the_old_version) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(140);
  control::update_result result;
  tensor_set set = model_tensors(141);
  workers_[2]->model.stall_ms = 500;
  workers_[2]->model.stall_load_after = 0;  // its commit's load
  workers_[2]->model.on_stall = [&] { asio::post(io_, [&] { workers_[2]->host->stop(); }); };
  auto failure = try_update(set, 141, result, fleet_atomic());
  ASSERT_TRUE(failure);
  const std::string w2 = named(2);
  const std::string& m = failure->message();
  EXPECT_NE(m.find(w2 + ": its commit's outcome is unknown (in doubt)"), std::string::npos) << m;
  EXPECT_NE(m.find(named(0) + ": committed, rolled back"), std::string::npos) << m;
  EXPECT_NE(m.find(named(1) + ": committed, rolled back"), std::string::npos) << m;
  for (std::size_t i : {0u, 1u}) expect_worker_at(i, old_set, 140);
  EXPECT_NE(reconcile_error().find(w2), std::string::npos);
}

// A worker killed inside its rollback (worker 1's commit failed; worker 0's
// rollback is under way when its host stops): it is named in doubt, not claimed
// at any version; the other two are at the old version, whole.
TEST_F(worker_group_test, a_worker_killed_in_its_rollback_is_named_and_the_others_hold_the_old_version) {
  start({{}, {}, {}});
  tensor_set old_set = initialised_at(150);
  control::update_result result;
  tensor_set set = model_tensors(151);
  workers_[1]->model.fail_next_load = true;  // its commit fails
  workers_[0]->model.stall_ms = 500;
  workers_[0]->model.stall_load_after = 1;  // its commit loads (one batch), its rollback stalls
  workers_[0]->model.on_stall = [&] { asio::post(io_, [&] { workers_[0]->host->stop(); }); };
  auto failure = try_update(set, 151, result, fleet_atomic());
  ASSERT_TRUE(failure);
  const std::string w0 = named(0);
  const std::string& m = failure->message();
  EXPECT_NE(m.find(w0 + ": committed; its rollback's outcome is unknown (in doubt)"), std::string::npos) << m;
  EXPECT_NE(m.find(named(1) + ": failed at its commit"), std::string::npos) << m;
  for (std::size_t i : {1u, 2u}) expect_worker_at(i, old_set, 150);
  EXPECT_NE(reconcile_error().find(w0), std::string::npos);
}

TEST_F(worker_group_test, a_worker_refusing_init_is_named_and_init_fails_at_once) {
  start({{}, {"", true}});
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<error> failure;
  try {
    run_to_completion(io_, init());
  } catch (const error& e) {
    failure = e;
  }
  ASSERT_TRUE(failure) << "init succeeded with a refusing worker";
  EXPECT_EQ(failure->kind(), errc::invalid_state) << failure->message();
  const std::string expected_name = named(1);
  EXPECT_EQ(failure->message().rfind(expected_name, 0), 0u) << failure->message();
  EXPECT_NE(failure->message().find("refuses every init"), std::string::npos) << failure->message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s) << "waited for the sender's deadline";
}

TEST_F(worker_group_test, errors_of_application_calls_name_the_worker_by_the_naming_function) {
  start({{}, {}});
  workers_[0]->host->add_method("only_on_rank_1", [](const json&) -> asio::awaitable<json> { co_return json(1); });
  std::vector<control::worker_endpoint> endpoints = {{"127.0.0.1", workers_[0]->port},
                                                     {"127.0.0.1", workers_[1]->port}};
  control::worker_group named(io_.get_executor(), 5s, "", endpoints,
                              [](std::size_t i) { return "worker rank " + std::to_string(i + 1); });
  run_to_completion(io_, named.connect());
  std::string message;
  auto call = [&]() -> asio::awaitable<void> {
    try {
      co_await named.call_all("only_on_rank_1");
    } catch (const error& e) {
      message = e.message();
    }
  };
  run_to_completion(io_, call());
  EXPECT_EQ(message.rfind("worker rank 2: ", 0), 0u) << message;
  EXPECT_NE(message.find("only_on_rank_1"), std::string::npos) << message;
  named.close();
}

// ---- client::call's awaitables own their arguments

asio::awaitable<void> into(json& out, asio::awaitable<json> op) { out = co_await std::move(op); }

TEST(control_client, awaitables_built_from_temporaries_can_be_awaited_later) {
  asio::io_context io;
  engine_factory factory;
  factory.register_engine<tcp::engine, tcp::sender>("tcp");
  capture got;
  control::worker_host host(tcp_config(), engine_context{io.get_executor()}, got.fn(), factory);
  const int n = 8;
  // Long names (beyond the small-string buffer): a dangling reference to a freed
  // temporary reads garbage.
  auto method_name = [](int i) { return "echo_method_with_a_name_longer_than_sso_" + std::to_string(i); };
  for (int i = 0; i < n; ++i)
    host.add_method(method_name(i), [i](const json& params) -> asio::awaitable<json> {
      json answer = params;
      answer["method"] = i;
      co_return answer;
    });
  const auto port = host.listen("127.0.0.1", 0);
  spawn(io, host.serve());
  control::client c(io.get_executor(), 5s);
  run_to_completion(io, c.connect("127.0.0.1", port));

  std::vector<json> answers(n);
  auto all = [&]() -> asio::awaitable<void> {
    std::vector<asio::awaitable<void>> ops;
    for (int i = 0; i < n; ++i) {
      // Method and params are temporaries of this statement; the call runs later.
      ops.push_back(into(answers[i], c.call(method_name(i), json{{"payload", std::string(40, 'a' + i)}})));
    }
    co_await async::all_of(std::move(ops));
    // The documented braced form's replacement compiles inside co_await.
    const std::vector<int> list = {1, 2};
    json p = co_await c.call(method_name(0), control::params("k", 1, "name", "x", "list", list));
    EXPECT_EQ(p["k"], 1);
    EXPECT_EQ(p["name"], "x");
    EXPECT_EQ(p["list"], json::array({1, 2}));
    EXPECT_EQ(control::params(), json::object());
  };
  run_to_completion(io, all());
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(answers[i]["method"], i) << answers[i].dump();
    EXPECT_EQ(answers[i]["payload"], std::string(40, 'a' + i)) << answers[i].dump();
  }
  c.close();
  host.stop();
  EXPECT_TRUE(run(io, 5s));
}

}  // namespace
}  // namespace refit::testing
