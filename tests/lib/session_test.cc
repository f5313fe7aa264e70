// weight_update_session: vLLM's start -> update (chunks) -> finish(version) verbs
// around a real engine (loopback, which defers processing) fed by its sender.
#include <refit/internal/engine_access.h>
#include <refit/session.h>

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <asio/io_context.hpp>

#include <refit/engines/loopback/loopback.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit {
namespace {

using testing::capture;
using ::testing::HasSubstr;
using testing::outcome;
using testing::spawn;
using testing::tensor_set;

void poll(asio::io_context& io) {
  io.restart();
  io.poll();
}

// Coroutine parameters (not lambda captures) keep the arguments alive.
asio::awaitable<void> send(weight_sender& sender, update_metadata meta, std::vector<tensor_view> views) {
  co_await trainer_send_weights(sender, meta, views);
}
asio::awaitable<void> update_json(weight_update_session& s, json info, load_weights_fn load) {
  co_await s.update_weights(info, std::move(load));
}
asio::awaitable<void> update_typed(weight_update_session& s, std::shared_ptr<update_info> info, load_weights_fn load) {
  co_await s.update_weights(*info, std::move(load));
}
asio::awaitable<void> finish(weight_update_session& s, std::optional<std::int64_t> version) {
  co_await s.finish_weight_update(version);
}

json metadata_json(const update_metadata& meta) {
  json j = json::object();
  write_update_metadata(meta, j);
  return j;
}

tensor_set chunk(int index) {
  tensor_set set;
  for (int i = 0; i < 3; ++i)
    set.add("layers." + std::to_string(index) + ".w" + std::to_string(i), dtype::bfloat16, {50 + i, 40},
            static_cast<std::uint64_t>(index));
  return set;
}

class session_test : public ::testing::Test {
 protected:
  session_test() {
    weight_transfer_config config;
    config.backend = "loopback";
    config.timeout = std::chrono::seconds(20);
    engine_context ectx;
    ectx.executor = io.get_executor();
    trainer_context tctx;
    tctx.executor = io.get_executor();
    sender = std::make_unique<loopback::sender>(config, tctx);
    engine = std::make_unique<loopback::engine>(config, ectx);
  }

  void connect() {
    static std::atomic<int> counter{0};
    json args = {
        {"channel", "session-test-" + std::to_string(counter++)}, {"buffer_bytes", 16 << 10}, {"num_buffers", 2}};
    testing::run_to_completion(io, sender->init(args));
    auto info = engine->parse_init_info(args);
    testing::run_to_completion(io, engine->init_transfer_engine(*info));
  }

  // One chunk: the trainer sends `set` (or `sent_set`, when the trainer sends
  // something else) while the session receives it, with `commit` in its update_info
  // when given.
  std::pair<std::shared_ptr<outcome>, std::shared_ptr<outcome>> transfer(weight_update_session& s, tensor_set& set,
                                                                         load_weights_fn load,
                                                                         const char* commit = nullptr,
                                                                         tensor_set* sent_set = nullptr) {
    json info = metadata_json(set.meta);
    if (commit) info["commit"] = commit;
    auto recv = spawn(io, update_json(s, info, std::move(load)));
    tensor_set& out = sent_set ? *sent_set : set;
    auto sent = spawn(io, send(*sender, out.meta, out.views()));
    EXPECT_TRUE(testing::run(io)) << "chunk did not finish";
    return {sent, recv};
  }

  // A chunk the session refuses before the trainer would send anything: only the
  // worker's side runs.
  std::shared_ptr<outcome> refused_chunk(weight_update_session& s, const tensor_set& set, const char* commit,
                                         load_weights_fn load) {
    json info = metadata_json(set.meta);
    if (commit) info["commit"] = commit;
    auto r = spawn(io, update_json(s, info, std::move(load)));
    EXPECT_TRUE(testing::run(io));
    return r;
  }

  std::shared_ptr<outcome> run_finish(weight_update_session& s, std::optional<std::int64_t> version) {
    auto r = spawn(io, finish(s, version));
    EXPECT_TRUE(testing::run(io));
    return r;
  }

  asio::io_context io;
  std::unique_ptr<loopback::sender> sender;
  std::unique_ptr<loopback::engine> engine;
};

TEST_F(session_test, start_update_chunks_finish_records_the_version) {
  connect();
  weight_update_session session(*engine);
  EXPECT_FALSE(session.active());
  EXPECT_EQ(session.weight_version(), std::nullopt);
  session.start_weight_update();
  EXPECT_TRUE(session.active());
  tensor_set a = chunk(0), b = chunk(1);
  capture got_a, got_b;
  auto [sa, ra] = transfer(session, a, got_a.fn());
  EXPECT_FALSE(sa->error) << sa->message();
  EXPECT_FALSE(ra->error) << ra->message();
  auto [sb, rb] = transfer(session, b, got_b.fn());
  EXPECT_FALSE(sb->error) << sb->message();
  EXPECT_FALSE(rb->error) << rb->message();
  EXPECT_EQ(session.chunks(), 2u);
  auto f = run_finish(session, 7);
  EXPECT_TRUE(f->done && !f->error) << f->message();
  EXPECT_FALSE(session.active());
  EXPECT_EQ(session.weight_version(), 7);
  EXPECT_EQ(session.chunks(), 2u) << "chunks of the last session stay readable";
  EXPECT_NO_THROW(got_a.check_equals(a));
  EXPECT_NO_THROW(got_b.check_equals(b));

  // The next session starts clean and records its own version.
  session.start_weight_update();
  EXPECT_EQ(session.chunks(), 0u);
  tensor_set c = chunk(2);
  capture got_c;
  auto [sc, rc] = transfer(session, c, got_c.fn());
  EXPECT_FALSE(rc->error) << rc->message();
  EXPECT_TRUE(run_finish(session, 8)->done);
  EXPECT_EQ(session.weight_version(), 8);
}

// update_weights answers once a chunk's bytes are in, while its processing may still
// run (loopback defers it): the next chunk waits for that work instead of being
// refused ("previous update's processing is pending"), seen as a flaky hooks_test.
TEST_F(session_test, a_chunk_arriving_while_the_previous_one_is_processed_waits_for_it) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set a = chunk(0), b = chunk(1);
  capture got_a, got_b;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  load_weights_fn slow = [released, inner = got_a.fn()](std::span<const tensor_view> w) {
    // Held until the test releases it (at most 10 s: a test that fails first
    // must not leave this thread blocked).
    released.wait_for(std::chrono::seconds(10));
    inner(w);
  };
  auto recv_a = spawn(io, update_json(session, metadata_json(a.meta), slow));
  auto sent_a = spawn(io, send(*sender, a.meta, a.views()));
  ASSERT_TRUE(testing::run_until(
      io, [&] { return recv_a->done; }, std::chrono::seconds(10)));
  ASSERT_FALSE(recv_a->error) << recv_a->message();
  auto recv_b = spawn(io, update_json(session, metadata_json(b.meta), got_b.fn()));
  auto sent_b = spawn(io, send(*sender, b.meta, b.views()));
  poll(io);
  EXPECT_FALSE(recv_b->done) << "chunk b was taken (or refused) while chunk a was still being processed: "
                             << recv_b->message();
  release.set_value();
  EXPECT_TRUE(testing::run(io));
  EXPECT_FALSE(sent_a->error) << sent_a->message();
  EXPECT_FALSE(recv_b->error) << recv_b->message();
  EXPECT_FALSE(sent_b->error) << sent_b->message();
  auto f = run_finish(session, 3);
  EXPECT_TRUE(f->done && !f->error) << f->message();
  EXPECT_EQ(session.weight_version(), 3);
  EXPECT_NO_THROW(got_a.check_equals(a));
  EXPECT_NO_THROW(got_b.check_equals(b));
}

TEST_F(session_test, typed_update_info_is_accepted_too) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set set = chunk(0);
  capture got;
  std::shared_ptr<update_info> info = engine->parse_update_info(metadata_json(set.meta));
  auto recv = spawn(io, update_typed(session, info, got.fn()));
  auto sent = spawn(io, send(*sender, set.meta, set.views()));
  ASSERT_TRUE(testing::run(io));
  EXPECT_FALSE(recv->error) << recv->message();
  EXPECT_FALSE(run_finish(session, 1)->error);
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_F(session_test, start_twice_is_invalid_state) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  auto e = REFIT_THROWN(session.start_weight_update());
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_EQ(e.message(), "start_weight_update: a weight update is already active (finish it first)");
  EXPECT_TRUE(session.active());
}

TEST_F(session_test, start_before_the_engine_is_initialised_is_invalid_state) {
  weight_update_session session(*engine);
  auto e = REFIT_THROWN(session.start_weight_update());
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_THAT(e.message(), HasSubstr("start_weight_update: the weight transfer engine is not initialised"));
  EXPECT_FALSE(session.active());
}

TEST_F(session_test, update_without_start_is_invalid_state) {
  connect();
  weight_update_session session(*engine);
  tensor_set set = chunk(0);
  capture got;
  auto by_json = spawn(io, update_json(session, metadata_json(set.meta), got.fn()));
  std::shared_ptr<update_info> info = engine->parse_update_info(metadata_json(set.meta));
  auto by_info = spawn(io, update_typed(session, info, got.fn()));
  ASSERT_TRUE(testing::run(io));
  for (const auto& r : {by_json, by_info}) {
    ASSERT_TRUE(r->error);
    EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_state));
    EXPECT_EQ(r->message(), "update_weights: no active weight update (call start_weight_update first)");
  }
  EXPECT_EQ(got.calls(), 0u);
}

TEST_F(session_test, finish_without_start_is_invalid_state_and_records_nothing) {
  connect();
  weight_update_session session(*engine);
  auto r = run_finish(session, 3);
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_state));
  EXPECT_EQ(r->message(), "finish_weight_update: no active weight update (call start_weight_update first)");
  EXPECT_EQ(session.weight_version(), std::nullopt);
}

TEST_F(session_test, finish_without_a_version_records_none) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  EXPECT_FALSE(run_finish(session, std::nullopt)->error);
  EXPECT_FALSE(session.active());
  EXPECT_EQ(session.weight_version(), std::nullopt);
}

TEST_F(session_test, overlapping_chunk_and_finish_during_a_chunk_are_refused) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set set = chunk(0);
  capture got;
  auto first = spawn(io, update_json(session, metadata_json(set.meta), got.fn()));
  poll(io);  // the chunk now waits for the trainer
  ASSERT_FALSE(first->done);
  auto second = spawn(io, update_json(session, metadata_json(set.meta), got.fn()));
  auto early_finish = spawn(io, finish(session, 1));
  poll(io);
  ASSERT_TRUE(second->done);
  EXPECT_EQ(second->kind(), static_cast<int>(errc::invalid_state));
  EXPECT_EQ(second->message(), "update_weights: another chunk of this update is still being received");
  ASSERT_TRUE(early_finish->done);
  EXPECT_EQ(early_finish->kind(), static_cast<int>(errc::invalid_state));
  EXPECT_EQ(early_finish->message(), "finish_weight_update: a chunk is still being received");
  EXPECT_TRUE(session.active()) << "a refused finish must not close the session";
  auto sent = spawn(io, send(*sender, set.meta, set.views()));
  ASSERT_TRUE(testing::run(io));
  EXPECT_FALSE(first->error) << first->message();
  EXPECT_FALSE(sent->error) << sent->message();
  EXPECT_FALSE(run_finish(session, 2)->error);
  EXPECT_EQ(session.weight_version(), 2);
  EXPECT_EQ(session.chunks(), 1u);
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_F(session_test, malformed_update_info_is_rejected_and_the_session_stays_open) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  capture got;
  json bad = {{"names", {"a"}}, {"dtype_names", {"float32"}}, {"shapes", {{2}}}, {"versoin", 3}};
  auto r = spawn(io, update_json(session, bad, got.fn()));
  ASSERT_TRUE(testing::run(io));
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_argument));
  EXPECT_THAT(r->message(), HasSubstr("loopback update_info: unknown member 'versoin'"));
  EXPECT_TRUE(session.active());
  EXPECT_EQ(session.chunks(), 0u);
}

TEST_F(session_test, processing_error_surfaces_at_finish_which_still_closes_without_a_version) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set first = chunk(0);
  capture ok;
  transfer(session, first, ok.fn());
  ASSERT_FALSE(run_finish(session, 1)->error);

  session.start_weight_update();
  tensor_set set = chunk(1);
  auto load = [](std::span<const tensor_view> views) {
    for (const auto& v : views)
      if (v.name == "layers.1.w1") throw std::runtime_error("no such parameter in the model");
  };
  auto [sent, recv] = transfer(session, set, load);
  EXPECT_FALSE(sent->error) << sent->message();
  EXPECT_FALSE(recv->error) << "loopback defers processing: " << recv->message();
  auto f = run_finish(session, 2);
  ASSERT_TRUE(f->error);
  EXPECT_EQ(f->kind(), static_cast<int>(errc::processing_failed));
  EXPECT_THAT(f->message(), HasSubstr("no such parameter in the model"));
  EXPECT_THAT(f->message(), HasSubstr("'layers.1.w1'"));
  EXPECT_FALSE(session.active()) << "a failed finish still closes the session";
  EXPECT_EQ(session.weight_version(), 1) << "the failed update's version must not be recorded";
  session.start_weight_update();  // and a new one may start
  EXPECT_TRUE(session.active());
}

TEST_F(session_test, abort_closes_without_recording_and_swallows_the_drain_error) {
  connect();
  weight_update_session session(*engine);
  asio::co_spawn(io, session.abort_weight_update(), [](std::exception_ptr e) { EXPECT_FALSE(e); });
  ASSERT_TRUE(testing::run(io));  // no-op when nothing is active
  session.start_weight_update();
  tensor_set set = chunk(0);
  auto failing = [](std::span<const tensor_view>) { throw std::runtime_error("model is gone"); };
  transfer(session, set, failing);
  auto a = spawn(io, session.abort_weight_update());
  ASSERT_TRUE(testing::run(io));
  EXPECT_TRUE(a->done && !a->error) << a->message();
  EXPECT_FALSE(session.active());
  EXPECT_EQ(session.weight_version(), std::nullopt);
  // The failed update's error is not left for the next one.
  session.start_weight_update();
  tensor_set next = chunk(1);
  capture got;
  auto [s2, r2] = transfer(session, next, got.fn());
  EXPECT_FALSE(r2->error) << r2->message();
  auto f = run_finish(session, 5);
  EXPECT_FALSE(f->error) << f->message();
  EXPECT_EQ(session.weight_version(), 5);
}

// ---- staged sessions: all or nothing

// A load_weights that records which chunk it was given (`tag`), where each view
// points, and passes the views on to a capture.
load_weights_fn recording(std::vector<std::string>& order, std::vector<const std::byte*>& where, capture& into,
                          std::string tag) {
  auto inner = into.fn();
  return [&order, &where, inner, tag](std::span<const tensor_view> views) {
    order.push_back(tag);
    for (const auto& v : views) where.push_back(v.data);
    inner(views);
  };
}

// The model sees nothing of a staged session until finish_weight_update, which
// calls each chunk's own load_weights with that chunk's tensors, chunk by chunk in
// order, and records the version in the same step.
TEST_F(session_test, a_staged_session_is_committed_whole_at_finish_chunk_by_chunk_in_order) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set a = chunk(0), b = chunk(1);
  capture got_a, got_b;
  std::vector<std::string> order;
  std::vector<const std::byte*> where;
  auto [sa, ra] = transfer(session, a, recording(order, where, got_a, "a"), "staged");
  ASSERT_FALSE(ra->error) << ra->message();
  EXPECT_FALSE(sa->error) << sa->message();
  auto [sb, rb] = transfer(session, b, recording(order, where, got_b, "b"), "staged");
  ASSERT_FALSE(rb->error) << rb->message();
  EXPECT_TRUE(order.empty()) << "load_weights ran before finish_weight_update";
  EXPECT_EQ(internal::engine_access::staged_chunks(*engine), 2u);
  EXPECT_GE(engine->staged_bytes(), a.meta.total_bytes() + b.meta.total_bytes());
  EXPECT_EQ(session.weight_version(), std::nullopt);
  auto f = run_finish(session, 5);
  ASSERT_FALSE(f->error) << f->message();
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b"}));
  EXPECT_NO_THROW(got_a.check_equals(a));
  EXPECT_NO_THROW(got_b.check_equals(b));
  EXPECT_EQ(session.weight_version(), 5);
  EXPECT_EQ(internal::engine_access::staged_chunks(*engine), 0u);
  EXPECT_FALSE(engine->weights_dirty());
}

// An aborted staged session, and one whose chunk failed, leave everything as it
// was: nothing loaded, the version and the clean state unchanged. The stage is
// the same memory for every session of the same size (not allocated again).
TEST_F(session_test, an_aborted_or_failed_staged_session_changes_nothing_and_the_stage_is_reused) {
  connect();
  weight_update_session session(*engine);
  tensor_set a = chunk(0), b = chunk(1), other;
  other.add("elsewhere", dtype::float32, {7});
  std::vector<std::string> order;
  std::vector<const std::byte*> first_where, last_where;
  {
    session.start_weight_update();
    capture got;
    auto [s, r] = transfer(session, a, recording(order, first_where, got, "v1"), "staged");
    ASSERT_FALSE(r->error) << r->message();
    ASSERT_FALSE(run_finish(session, 1)->error);
  }
  const std::uint64_t stage = engine->staged_bytes();
  ASSERT_GT(stage, 0u);
  order.clear();
  std::vector<const std::byte*> ignored;
  {
    // Aborted after its chunk arrived.
    session.start_weight_update();
    capture got;
    auto [s, r] = transfer(session, b, recording(order, ignored, got, "aborted"), "staged");
    ASSERT_FALSE(r->error) << r->message();
    auto ab = spawn(io, session.abort_weight_update("the trainer went away"));
    ASSERT_TRUE(testing::run(io));
    EXPECT_FALSE(ab->error) << ab->message();
  }
  EXPECT_TRUE(order.empty()) << "an aborted staged session reached the model";
  EXPECT_FALSE(engine->weights_dirty()) << engine->dirty_reason();
  EXPECT_EQ(session.weight_version(), 1);
  EXPECT_EQ(internal::engine_access::staged_chunks(*engine), 0u);
  {
    // Its chunk fails (the trainer sends other tensors than the update_info says).
    session.start_weight_update();
    capture got;
    auto [s, r] = transfer(session, b, recording(order, ignored, got, "failed"), "staged", &other);
    ASSERT_TRUE(r->error);
    EXPECT_EQ(r->kind(), static_cast<int>(errc::protocol_error)) << r->message();
    // Another chunk is refused (before the trainer sends anything), and finish
    // closes the session without a version.
    capture more;
    auto r2 = refused_chunk(session, a, "staged", more.fn());
    ASSERT_TRUE(r2->error);
    EXPECT_EQ(r2->kind(), static_cast<int>(errc::invalid_state)) << r2->message();
    EXPECT_THAT(r2->message(), HasSubstr("chunk 1 failed: protocol_error"));
    EXPECT_EQ(more.calls(), 0u);
    auto f = run_finish(session, 3);
    ASSERT_TRUE(f->error);
    EXPECT_EQ(f->kind(), static_cast<int>(errc::invalid_state)) << f->message();
    EXPECT_THAT(f->message(), HasSubstr("finish_weight_update: chunk 1 failed: protocol_error"));
    EXPECT_THAT(f->message(), HasSubstr("closed without a version (nothing of it was committed)"));
    EXPECT_FALSE(session.active());
  }
  EXPECT_TRUE(order.empty()) << "a failed staged session reached the model";
  EXPECT_FALSE(engine->weights_dirty()) << engine->dirty_reason();
  EXPECT_EQ(session.weight_version(), 1);
  {
    session.start_weight_update();
    capture got;
    auto [s, r] = transfer(session, a, recording(order, last_where, got, "v2"), "staged");
    ASSERT_FALSE(r->error) << r->message();
    ASSERT_FALSE(run_finish(session, 2)->error);
    EXPECT_NO_THROW(got.check_equals(a));
  }
  EXPECT_EQ(session.weight_version(), 2);
  EXPECT_EQ(engine->staged_bytes(), stage) << "the stage was reallocated";
  EXPECT_EQ(last_where, first_where) << "a session of the same size uses the same stage memory";
}

// A load_weights that throws during the commit leaves the weights dirty (the
// model may hold part of the update), and no version is recorded.
TEST_F(session_test, a_load_weights_that_throws_during_a_staged_commit_leaves_the_weights_dirty) {
  connect();
  weight_update_session session(*engine);
  session.start_weight_update();
  tensor_set a = chunk(0), b = chunk(1);
  capture got_a;
  transfer(session, a, got_a.fn(), "staged");
  auto failing = [](std::span<const tensor_view>) { throw std::runtime_error("device full"); };
  auto [s, r] = transfer(session, b, failing, "staged");
  ASSERT_FALSE(r->error) << r->message();
  auto f = run_finish(session, 4);
  ASSERT_TRUE(f->error);
  EXPECT_THAT(f->message(), HasSubstr("device full"));
  EXPECT_NO_THROW(got_a.check_equals(a)) << "the first chunk was committed before the second failed";
  EXPECT_TRUE(engine->weights_dirty());
  EXPECT_THAT(engine->dirty_reason(), HasSubstr("commit of a staged update"));
  EXPECT_EQ(session.weight_version(), std::nullopt);
  EXPECT_FALSE(session.active());
}

// One session commits one way, and stages each tensor once: either is refused
// before any byte of the chunk moves.
TEST_F(session_test, a_chunk_of_another_commit_mode_or_a_tensor_staged_twice_is_refused) {
  connect();
  {
    weight_update_session session(*engine);
    session.start_weight_update();
    tensor_set a = chunk(0), b = chunk(1);
    capture got;
    transfer(session, a, got.fn(), "staged");
    auto recv = refused_chunk(session, b, nullptr, got.fn());  // in_place (the default)
    ASSERT_TRUE(recv->error);
    EXPECT_EQ(recv->kind(), static_cast<int>(errc::invalid_argument)) << recv->message();
    EXPECT_THAT(recv->message(), HasSubstr("a chunk with commit \"in_place\" in an update session whose earlier "
                                           "chunks are \"staged\""));
    EXPECT_EQ(got.calls(), 0u);
    auto a2 = spawn(io, session.abort_weight_update());
    ASSERT_TRUE(testing::run(io));
    EXPECT_FALSE(engine->weights_dirty());
  }
  connect();
  {
    weight_update_session session(*engine);
    session.start_weight_update();
    tensor_set a = chunk(0);
    capture got;
    transfer(session, a, got.fn(), "staged");
    auto recv = refused_chunk(session, a, "staged", got.fn());
    ASSERT_TRUE(recv->error);
    EXPECT_EQ(recv->kind(), static_cast<int>(errc::invalid_argument)) << recv->message();
    EXPECT_THAT(recv->message(), HasSubstr("tensor 'layers.0.w0' is already staged by chunk 1 of this update session"));
    EXPECT_EQ(got.calls(), 0u);
  }
}

}  // namespace
}  // namespace refit
