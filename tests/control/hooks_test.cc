// The worker host's application hooks (update_hooks) and what a server reads of
// its own state (worker_host::weight_info), with the control-plane details that go
// with them: a frame that is not JSON is answered and the connection serves on,
// fingerprints_from_json reads the weight_fingerprint answer, and weight_info's
// "commit" is each update's own.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include <asio/read.hpp>
#include <asio/write.hpp>

#include <refit/backend/handshake.h>
#include <refit/backend/net.h>
#include <refit/control/internal/frame.h>
#include "tests/support/control_fixture.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

tensor_set small_set(int n = 4, std::uint64_t seed = 1) {
  tensor_set set;
  for (int i = 0; i < n; ++i) set.add("w" + std::to_string(i), dtype::float32, {500}, seed);
  return set;
}

class hooks_test : public control_fixture {
 protected:
  // What the hooks saw, in order; `throw_in` names a hook that throws.
  std::vector<std::string> events_;
  std::vector<json> info_in_hook_;  // host_->weight_info() as each hook saw it
  std::vector<errc> failed_kinds_;  // the kind of each on_update_failed
  std::string throw_in_;

  void start(weight_transfer_config config = tcp_config(), control::host_limits limits = {}) {
    control::update_hooks hooks;
    hooks.on_update_started = [this](const std::string& owner) {
      events_.push_back("started by " + owner);
      info_in_hook_.push_back(host_->weight_info());
      if (throw_in_ == "started") throw std::runtime_error("the server is not ready for weights");
    };
    hooks.on_update_finished = [this](std::int64_t version, const json& stats) {
      events_.push_back("finished " + std::to_string(version) + " tensors=" + stats["tensors"].dump());
      info_in_hook_.push_back(host_->weight_info());
      if (throw_in_ == "finished") throw_error(errc::io_error, "the KV cache flush failed");
    };
    hooks.on_update_failed = [this](const std::string& reason, errc kind) {
      events_.push_back("failed: " + reason);
      failed_kinds_.push_back(kind);
      info_in_hook_.push_back(host_->weight_info());
      if (throw_in_ == "failed") throw std::runtime_error("the failure hook failed too");
    };
    start_host(config, engine_context{io_.get_executor(), {}, {}, &model_}, model_.as_load_weights(), limits,
               std::move(hooks));
  }

  holding_model model_;
};

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- the hooks

TEST_F(hooks_test, a_successful_update_calls_started_then_finished_with_its_version_before_the_answer) {
  start();
  init();
  ASSERT_TRUE(events_.empty()) << "init opens no session";
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  ASSERT_EQ(events_.size(), 1u);
  EXPECT_TRUE(has(events_[0], "started by connection #1 (127.0.0.1:")) << events_[0];
  EXPECT_EQ(info_in_hook_[0]["state"], "updating") << "the session is open when on_update_started runs";
  chunk(set);
  EXPECT_EQ(events_.size(), 1u) << "a chunk calls no hook";
  call(trainer_, "finish_weight_update", {{"weight_version", 7}});
  events_.push_back("finish answered");
  ASSERT_EQ(events_.size(), 3u);
  EXPECT_EQ(events_[1], "finished 7 tensors=4");
  EXPECT_EQ(events_[2], "finish answered") << "on_update_finished runs before the answer";
  // When on_update_finished runs, the state is clean at its version.
  EXPECT_EQ(info_in_hook_[1]["state"], "clean") << info_in_hook_[1];
  EXPECT_EQ(info_in_hook_[1]["weight_version"], 7) << info_in_hook_[1];
  EXPECT_FALSE(info_in_hook_[1]["session_active"].get<bool>());

  // A finish without a version: the version recorded before.
  events_.clear();
  tensor_set next = small_set(4, 2);
  full_update(next, std::nullopt);
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[1], "finished 7 tensors=4");
  EXPECT_TRUE(info()["last_hook_error"].is_null());
}

TEST_F(hooks_test, a_finish_without_any_version_ever_recorded_reports_minus_one) {
  start();
  init();
  tensor_set set = small_set();
  full_update(set, std::nullopt);
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[1], "finished -1 tensors=4");
}

TEST_F(hooks_test, the_owner_dropping_mid_session_calls_failed_with_the_reason_and_never_finished) {
  start();
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set);
  trainer_->close();  // the trainer dies between its chunk and finish_weight_update
  ASSERT_TRUE(run_until(
      io_, [&] { return events_.size() >= 2; }, 5s))
      << "on_update_failed was not called";
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[0], "started by connection #1")) << events_[0];
  EXPECT_TRUE(has(events_[1], "failed: the weight update session was aborted: its owner, connection #1")) << events_[1];
  EXPECT_TRUE(has(events_[1], "closed its connection before finishing it")) << events_[1];
  // The bookkeeping is the built-in one, already in place when the hook runs.
  EXPECT_EQ(info_in_hook_[1]["state"], "dirty") << info_in_hook_[1];
  EXPECT_FALSE(info_in_hook_[1]["session_active"].get<bool>());
  EXPECT_TRUE(info_in_hook_[1]["weight_version"].is_null());
  EXPECT_TRUE(info_in_hook_[1]["session_owner"].is_null());
  // The kind is a field, in the hook and in weight_info: the trainer is gone.
  EXPECT_EQ(failed_kinds_, std::vector<errc>{errc::peer_lost});
  EXPECT_EQ(info_in_hook_[1]["last_error_kind"], "peer_lost") << info_in_hook_[1];
  EXPECT_EQ(host_->weight_info()["last_error_kind"], "peer_lost");
}

TEST_F(hooks_test, a_failed_update_calls_failed_and_a_later_full_update_finished) {
  start();
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set);
  // The second chunk is refused before its first byte (the model refuses it).
  tensor_set bad;
  bad.add("forbidden", dtype::float32, {100});
  auto views = bad.views();
  auto sent = spawn(io_, trainer_send_weights(*sender_, bad.meta, views));
  auto msg = call_error(trainer_, "update_weights", update_body(bad), errc::invalid_argument);
  ASSERT_TRUE(run_until(
      io_, [&] { return sent->done; }, 10s));
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[1], "failed: update_weights: invalid_argument: ")) << events_[1];
  EXPECT_TRUE(has(events_[1], "no tensor may be named 'forbidden'")) << events_[1];
  EXPECT_EQ(failed_kinds_, std::vector<errc>{errc::invalid_argument});
  EXPECT_EQ(info_in_hook_[1]["last_error_kind"], "invalid_argument") << info_in_hook_[1];
  EXPECT_EQ(info_in_hook_[1]["state"], "dirty") << "its first chunk had been applied: " << info_in_hook_[1];
  EXPECT_FALSE(info_in_hook_[1]["session_active"].get<bool>());

  // An update_info the host cannot read fails the same way (nothing applied: clean).
  init();  // the refusal closed the data path
  events_.clear();
  call(trainer_, "start_weight_update");
  json unreadable = update_body(set);
  unreadable["update_info"]["surprise"] = 1;
  call_error(trainer_, "update_weights", unreadable, errc::invalid_argument);
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[1], "failed: update_weights: invalid_argument: ")) << events_[1];
  EXPECT_TRUE(has(events_[1], "'surprise'")) << events_[1];

  // The weights are made whole by a full update: started, finished.
  init();
  events_.clear();
  full_update(set, 3);
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[1], "finished 3 tensors=4");
  json after = info();
  EXPECT_EQ(after["state"], "clean");
  EXPECT_TRUE(after["last_error"].is_null()) << "a clean finish clears it: " << after;
  EXPECT_TRUE(after["last_error_kind"].is_null()) << after;
}

TEST_F(hooks_test, the_owners_re_init_mid_session_calls_failed) {
  start();
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set);
  init();
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[1],
                  "failed: init_weight_transfer_engine: the weight update session was aborted: "
                  "the engine was re-initialised during it"))
      << events_[1];
  EXPECT_EQ(failed_kinds_, std::vector<errc>{errc::cancelled}) << "its owner gave it up";
  EXPECT_EQ(info_in_hook_[1]["state"], "dirty") << info_in_hook_[1];
}

// ---- the kind of a failure, a field of its own (never parsed from the text)

TEST_F(hooks_test, a_silent_owners_session_fails_with_timeout) {
  control::host_limits limits;
  limits.session_timeout = 300ms;
  start(tcp_config(5s), limits);
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set, "staged");
  // The trainer sends nothing more: the session is aborted at its deadline.
  ASSERT_TRUE(run_until(
      io_, [&] { return events_.size() >= 2; }, 5s))
      << "on_update_failed was not called";
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[1], "sent nothing for")) << events_[1];
  EXPECT_EQ(failed_kinds_, std::vector<errc>{errc::timeout});
  EXPECT_EQ(info_in_hook_[1]["last_error_kind"], "timeout") << info_in_hook_[1];
  json after = info();
  EXPECT_EQ(after["last_error_kind"], "timeout") << after;
  EXPECT_TRUE(has(after["last_error"].get<std::string>(), "sent nothing for")) << after;
  EXPECT_EQ(after["state"], "clean") << "a staged session leaves the weights as they were: " << after;
}

TEST_F(hooks_test, an_abort_carries_the_kind_the_trainer_names_and_cancelled_by_default) {
  start();
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set, "staged");
  json answer =
      call(trainer_, "abort_weight_update", {{"why", "worker 2 failed its checksum"}, {"kind", "integrity_error"}});
  EXPECT_TRUE(answer["aborted"].get<bool>()) << answer;
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_TRUE(has(events_[1], "the trainer aborted it: worker 2 failed its checksum")) << events_[1];
  EXPECT_EQ(failed_kinds_, std::vector<errc>{errc::integrity_error});
  EXPECT_EQ(info_in_hook_[1]["last_error_kind"], "integrity_error") << info_in_hook_[1];
  EXPECT_EQ(info()["last_error_kind"], "integrity_error");

  // Without a kind: cancelled.
  call(trainer_, "start_weight_update");
  chunk(set, "staged");
  call(trainer_, "abort_weight_update", {{"why", "the step was cancelled"}});
  EXPECT_EQ(failed_kinds_, (std::vector<errc>{errc::integrity_error, errc::cancelled}));
  EXPECT_EQ(info()["last_error_kind"], "cancelled");

  // A kind that is not one is refused like any bad param; the session stays open.
  call(trainer_, "start_weight_update");
  auto msg = call_error(trainer_, "abort_weight_update", {{"kind", "oops"}}, errc::invalid_argument);
  EXPECT_TRUE(has(msg, "abort_weight_update params")) << msg;
  EXPECT_TRUE(has(msg, "'kind' must name an error kind")) << msg;
  EXPECT_TRUE(has(msg, "\"oops\"")) << msg;
  EXPECT_TRUE(info()["session_active"].get<bool>());
  call_error(trainer_, "abort_weight_update", {{"kind", 3}}, errc::invalid_argument);
  EXPECT_EQ(failed_kinds_.size(), 2u) << "a refused abort ends nothing";
  call(trainer_, "abort_weight_update");
  EXPECT_EQ(failed_kinds_.back(), errc::cancelled);
}

TEST_F(hooks_test, a_rolled_back_update_says_cancelled) {
  start();
  init();
  tensor_set first = small_set(4, 1), second = small_set(4, 2);
  full_update(first, 1, "staged");
  call(trainer_, "start_weight_update", {{"fleet_atomic", true}});
  chunk(second, "staged");
  call(trainer_, "prepare_weight_update");
  call(trainer_, "finish_weight_update", {{"weight_version", 2}});
  json committed = info();
  EXPECT_TRUE(committed["last_error_kind"].is_null()) << committed;
  call(trainer_, "rollback_weight_update");
  json after = info();
  EXPECT_EQ(after["weight_version"], 1) << after;
  EXPECT_TRUE(has(after["last_error"].get<std::string>(), "update 2 was rolled back by the trainer")) << after;
  EXPECT_EQ(after["last_error_kind"], "cancelled") << after;
  EXPECT_TRUE(failed_kinds_.empty()) << "a rollback calls on_update_finished";
}

TEST_F(hooks_test, refusals_that_end_no_session_call_no_hook) {
  start();
  init();
  call(trainer_, "start_weight_update");
  auto* stale = connect();
  call_error(stale, "start_weight_update", json::object(), errc::invalid_state);
  call_error(stale, "finish_weight_update", json::object(), errc::invalid_state);
  call_error(stale, "update_weights", update_body(small_set()), errc::invalid_state);
  call_error(trainer_, "finish_weight_update", {{"surprise", 1}}, errc::invalid_argument);
  EXPECT_EQ(events_.size(), 1u) << "only started: " << ::testing::PrintToString(events_);
  EXPECT_TRUE(info()["session_active"].get<bool>());
}

TEST_F(hooks_test, a_throwing_started_hook_refuses_the_session) {
  start();
  init();
  throw_in_ = "started";
  auto msg = call_error(trainer_, "start_weight_update", json::object(), errc::processing_failed);
  EXPECT_TRUE(has(msg,
                  "start_weight_update: the application's on_update_started hook failed: "
                  "the server is not ready for weights"))
      << msg;
  json after = info();
  EXPECT_FALSE(after["session_active"].get<bool>()) << after;
  EXPECT_EQ(after["state"], "clean") << after;
  EXPECT_TRUE(has(after["last_hook_error"].get<std::string>(), "on_update_started: ")) << after;
  EXPECT_TRUE(has(after["last_error"].get<std::string>(), "start_weight_update: processing_failed:")) << after;
  EXPECT_EQ(after["last_error_kind"], "processing_failed") << after;
  EXPECT_EQ(events_.size(), 1u) << "no failed hook for a session the application refused";
  // Once the hook accepts, updates go through.
  throw_in_.clear();
  events_.clear();
  tensor_set set = small_set();
  full_update(set, 1);
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[1], "finished 1 tensors=4");
}

TEST_F(hooks_test, a_throwing_finished_hook_is_the_finishs_answer_and_the_update_stays_committed) {
  start();
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set);
  throw_in_ = "finished";
  auto msg = call_error(trainer_, "finish_weight_update", {{"weight_version", 9}}, errc::io_error);
  EXPECT_TRUE(has(msg,
                  "finish_weight_update: the application's on_update_finished hook failed: "
                  "the KV cache flush failed"))
      << msg;
  json after = info();
  EXPECT_EQ(after["state"], "clean") << after;
  EXPECT_EQ(after["weight_version"], 9) << after;
  EXPECT_TRUE(has(after["last_error"].get<std::string>(), "on_update_finished hook failed")) << after;
  EXPECT_TRUE(has(after["last_hook_error"].get<std::string>(), "on_update_finished: io_error: the KV cache flush"))
      << after;
}

TEST_F(hooks_test, a_throwing_failed_hook_leaves_the_verbs_own_answer) {
  start();
  init();
  throw_in_ = "failed";
  call(trainer_, "start_weight_update");
  json unreadable = update_body(small_set());
  unreadable["update_info"]["surprise"] = 1;
  auto msg = call_error(trainer_, "update_weights", unreadable, errc::invalid_argument);
  EXPECT_TRUE(has(msg, "'surprise'")) << msg;
  json after = info();
  EXPECT_TRUE(has(after["last_hook_error"].get<std::string>(), "on_update_failed: ")) << after;
  EXPECT_TRUE(has(after["last_error"].get<std::string>(), "update_weights: invalid_argument")) << after;
  EXPECT_FALSE(after["session_active"].get<bool>());
}

// ---- weight_info without a connection

TEST_F(hooks_test, the_public_weight_info_is_the_verbs_answer) {
  start();
  init();
  tensor_set set = small_set();
  full_update(set, 5);
  json answered = info();
  json local = host_->weight_info();
  EXPECT_EQ(local, answered);
  EXPECT_EQ(local["weight_version"], 5);
  EXPECT_EQ(local["state"], "clean");
  EXPECT_EQ(local["connections"], 1);
}

// ---- malformed frames

asio::awaitable<void> raw_exchange(std::uint16_t port, std::vector<json>* answers, bool* closed_after) {
  auto s = co_await net::connect_with_retry("127.0.0.1", port, 5s, "raw");
  co_await auth::as_client(s, "", 5s, "raw");  // the handshake runs even without a secret
  control::frame_stream f(std::move(s));
  auto send_raw = [](control::frame_stream& f, std::string body) -> asio::awaitable<void> {
    const auto n = static_cast<std::uint32_t>(body.size());
    std::string frame = {char(n >> 24), char(n >> 16), char(n >> 8), char(n)};
    frame += body;
    co_await asio::async_write(f.socket(), asio::buffer(frame), asio::use_awaitable);
  };
  co_await send_raw(f, R"({"id": 1, "method": "weight_info", "params": {)");  // cut short
  answers->push_back(co_await f.read(5s, false, "raw"));
  co_await send_raw(f, "not json at all");
  answers->push_back(co_await f.read(5s, false, "raw"));
  // The same connection serves a valid request next.
  json ok = {{"id", 5}, {"method", "weight_info"}};
  co_await send_raw(f, ok.dump());
  answers->push_back(co_await f.read(5s, false, "raw"));
  *closed_after = !f.is_open();
}

// tensor_map_hooks over a reader_lock target: a fleet-atomic commit whose
// load_weights throws part-way loads the previous version back, so the target is
// finished at that version (readers see it, not a dirty mix); the application's
// own hooks run after. A failure that leaves the weights dirty aborts the target.
TEST_F(hooks_test, tensor_map_hooks_serve_the_version_a_failed_commit_loaded_back) {
  tensor_set first = small_set(4, 1);
  tensor_map_target_options options;
  options.mode = reader_mode::reader_lock;
  tensor_map_target target(options);
  for (const auto& t : first.meta.tensors) target.add(t);
  std::atomic<int> fail_after{-1};  // load_weights calls that succeed before one throws
  load_weights_fn load = [&target, &fail_after](std::span<const tensor_view> views) {
    if (fail_after.load() >= 0 && fail_after.fetch_sub(1) == 0)
      throw_error(errc::processing_failed, "the loader failed");
    target.as_load_weights()(views);
  };
  control::update_hooks also;
  also.on_update_finished = [this](std::int64_t version, const json&) {
    events_.push_back("finished " + std::to_string(version));
  };
  also.on_update_failed = [this](const std::string&, errc) { events_.push_back("failed"); };
  weight_transfer_config config = tcp_config();
  start_host(config, engine_context{io_.get_executor(), {}, {}, &target}, load);
  host_->set_hooks(control::tensor_map_hooks(*host_, target, std::move(also)));
  init();
  full_update(first, 1, "staged");
  EXPECT_EQ(target.version(), 1);

  tensor_set second = small_set(4, 2);
  call(trainer_, "start_weight_update", {{"fleet_atomic", true}});
  chunk(second, "staged");
  call(trainer_, "prepare_weight_update");
  fail_after = 0;  // the commit's (one batch) load throws; its restore loads
  call_error(trainer_, "finish_weight_update", {{"weight_version", 2}}, errc::processing_failed);
  EXPECT_EQ(events_, (std::vector<std::string>{"finished 1", "failed"}));
  EXPECT_FALSE(target.dirty()) << target.dirty_reason();
  EXPECT_FALSE(target.updating());
  EXPECT_EQ(target.version(), 1);
  {
    auto r = target.read();
    for (const auto& v : first.views())
      EXPECT_EQ(std::memcmp(r.view(v.name).data, v.data, v.nbytes()), 0) << v.name << " is not update 1's";
  }

  // in_place, failing after its first chunk reached the target: dirty, aborted.
  events_.clear();
  call(trainer_, "start_weight_update");
  chunk(second, "in_place");
  tensor_set bad;
  bad.add("forbidden", dtype::float32, {100});
  auto views = bad.views();
  auto sent = spawn(io_, trainer_send_weights(*sender_, bad.meta, views));
  call_error(trainer_, "update_weights", update_body(bad), errc::invalid_argument);
  ASSERT_TRUE(run_until(
      io_, [&] { return sent->done; }, 10s));
  EXPECT_EQ(events_, std::vector<std::string>{"failed"});
  EXPECT_TRUE(target.dirty());
  EXPECT_EQ(target.version(), std::nullopt);
}

TEST_F(hooks_test, a_frame_that_is_not_json_is_answered_and_the_connection_serves_on) {
  start();
  std::vector<json> answers;
  bool closed = true;
  run_to_completion(io_, raw_exchange(port_, &answers, &closed));
  ASSERT_EQ(answers.size(), 3u);
  for (int i : {0, 1}) {
    const json& a = answers[i];
    EXPECT_TRUE(a["id"].is_null()) << a;
    EXPECT_EQ(a["error"]["kind"], "protocol_error") << a;
    const std::string m = a["error"]["message"].get<std::string>();
    EXPECT_TRUE(has(m, "control request: malformed JSON frame of ")) << m;
    EXPECT_TRUE(has(m, "id cannot be read")) << m;
  }
  EXPECT_TRUE(has(answers[0]["error"]["message"].get<std::string>(),
                  "of 46 bytes, at byte 47: parse error at line 1, column 47: syntax error"))
      << answers[0];
  EXPECT_TRUE(has(answers[1]["error"]["message"].get<std::string>(), "invalid literal")) << answers[1];
  EXPECT_EQ(answers[2]["id"], 5) << answers[2];
  EXPECT_EQ(answers[2]["result"]["backend"], "tcp") << answers[2];
  EXPECT_FALSE(closed);
  EXPECT_EQ(info()["backend"], "tcp");
}

// ---- fingerprints

TEST_F(hooks_test, fingerprints_from_json_reads_the_weight_fingerprint_answer) {
  start();
  init();
  tensor_set set = small_set();
  full_update(set, 4);
  json answer = call(trainer_, "weight_fingerprint");
  EXPECT_EQ(answer["weight_version"], 4) << answer;
  EXPECT_EQ(answer["state"], "clean") << answer;
  fingerprint_list got;
  ASSERT_NO_THROW(got = fingerprints_from_json(answer)) << answer;
  EXPECT_EQ(got.size(), 4u);
  EXPECT_TRUE(compare_fingerprints(fingerprint_all(set.views()), got).empty());
  // Before any version: weight_version null.
  answer["weight_version"] = nullptr;
  EXPECT_NO_THROW(fingerprints_from_json(answer));
  // Typos and mistyped members are still refused.
  json typo = answer;
  typo["stat"] = "clean";
  try {
    fingerprints_from_json(typo);
    ADD_FAILURE() << "a typo was accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_TRUE(has(e.message(), "'stat'")) << e.message();
  }
  json mistyped = answer;
  mistyped["weight_version"] = "four";
  EXPECT_THROW(fingerprints_from_json(mistyped), error);
}

// ---- commit modes

asio::awaitable<void> call_update(control::client* c, json body) { co_await c->call("update_weights", body); }

TEST_F(hooks_test, weight_info_commit_is_the_updates_own) {
  start();
  init();
  EXPECT_EQ(info()["commit"], "in_place") << "no update yet: the config's";
  EXPECT_EQ(info()["default_commit"], "in_place");
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  // While a staged chunk is being received (the bytes are not sent yet).
  auto updating = spawn(io_, call_update(trainer_, update_body(set, "staged")));
  ASSERT_TRUE(run_until(
      io_, [&] { return host_->session().receiving() || updating->done; }, 5s));
  ASSERT_FALSE(updating->done) << updating->message();
  json during = host_->weight_info();
  EXPECT_EQ(during["commit"], "staged") << during;
  EXPECT_EQ(during["default_commit"], "in_place") << during;
  auto views = set.views();
  auto sent = spawn(io_, trainer_send_weights(*sender_, set.meta, views));
  ASSERT_TRUE(run_until(
      io_, [&] { return sent->done && updating->done; }, 10s));
  ASSERT_FALSE(updating->error) << updating->message();
  ASSERT_FALSE(sent->error) << sent->message();
  call(trainer_, "finish_weight_update", {{"weight_version", 1}});
  json after = info();
  EXPECT_EQ(after["commit"], "staged") << "the last update applied was staged: " << after;
  EXPECT_EQ(after["default_commit"], "in_place") << after;
  // The next update names none: the config's.
  full_update(set, 2);
  EXPECT_EQ(info()["commit"], "in_place");
  // A refused update does not change what was applied last.
  call(trainer_, "start_weight_update");
  json unreadable = update_body(set, "staged");
  unreadable["update_info"]["surprise"] = 1;
  call_error(trainer_, "update_weights", unreadable, errc::invalid_argument);
  EXPECT_EQ(info()["commit"], "in_place");
}

TEST_F(hooks_test, a_staged_default_shows_in_both) {
  auto config = tcp_config();
  config.commit = commit_mode::staged;
  start(config);
  init();
  tensor_set set = small_set();
  call(trainer_, "start_weight_update");
  chunk(set, "in_place");
  call(trainer_, "finish_weight_update", {{"weight_version", 1}});
  json after = info();
  EXPECT_EQ(after["commit"], "in_place") << after;
  EXPECT_EQ(after["default_commit"], "staged") << after;
}

}  // namespace
}  // namespace refit::testing
