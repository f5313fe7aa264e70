// The coroutine primitives: event, drain_scope, slot_ring, offload, with_deadline.
// Everything runs on an io_context driven by the test thread (poll / run with a
// watchdog); nothing sleeps.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <asio/bind_executor.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <asio/strand.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/deadline.h>
#include <refit/backend/async/drain_scope.h>
#include <refit/backend/async/event.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/async/slot_ring.h>
#include <refit/internal/lag_probe.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using testing::spawn;
using namespace std::chrono_literals;

// Runs every handler that is ready now; returns without waiting for timers.
void poll(asio::io_context& io) {
  io.restart();
  io.poll();
}

// ---- event ----

TEST(event, waiters_suspend_until_set_and_set_wakes_all) {
  asio::io_context io;
  async::event ev(io.get_executor());
  EXPECT_FALSE(ev.is_set());
  auto a = spawn(io, ev.wait());
  auto b = spawn(io, ev.wait());
  poll(io);
  EXPECT_FALSE(a->done);
  EXPECT_FALSE(b->done);
  ev.set();
  EXPECT_TRUE(ev.is_set());
  poll(io);
  EXPECT_TRUE(a->done && !a->error) << a->message();
  EXPECT_TRUE(b->done && !b->error) << b->message();
}

TEST(event, stays_set_until_reset) {
  asio::io_context io;
  async::event ev(io.get_executor());
  ev.set();
  auto a = spawn(io, ev.wait());
  poll(io);
  EXPECT_TRUE(a->done) << "a set event completes waits at once";
  ev.reset();
  EXPECT_FALSE(ev.is_set());
  auto b = spawn(io, ev.wait());
  poll(io);
  EXPECT_FALSE(b->done) << "reset makes waits suspend again";
  ev.set();
  poll(io);
  EXPECT_TRUE(b->done && !b->error);
}

TEST(event, reset_while_unset_does_not_release_waiters) {
  asio::io_context io;
  async::event ev(io.get_executor());
  auto a = spawn(io, ev.wait());
  poll(io);
  ev.reset();  // re-arms the internal timer, waking the waiter spuriously
  poll(io);
  EXPECT_FALSE(a->done) << "a spurious wake-up must not complete the wait";
  ev.set();
  poll(io);
  EXPECT_TRUE(a->done);
}

// ---- drain_scope ----

asio::awaitable<void> wait_then_fail(async::event& gate, errc kind, std::string message) {
  co_await gate.wait();
  if (kind != errc{}) throw_error(kind, message);
}

TEST(drain_scope, join_with_nothing_pending_completes_at_once_and_is_idempotent) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  for (int i = 0; i < 3; ++i) {
    auto j = spawn(io, scope.join());
    poll(io);
    EXPECT_TRUE(j->done && !j->error) << "join #" << i;
  }
  EXPECT_EQ(scope.pending(), 0u);
  EXPECT_FALSE(scope.has_error());
}

TEST(drain_scope, join_waits_for_every_piece_of_work) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  async::event g1(io.get_executor()), g2(io.get_executor());
  scope.spawn(wait_then_fail(g1, errc{}, ""));
  scope.spawn(wait_then_fail(g2, errc{}, ""));
  EXPECT_EQ(scope.pending(), 2u);
  auto j = spawn(io, scope.join());
  poll(io);
  EXPECT_FALSE(j->done);
  g2.set();
  poll(io);
  EXPECT_EQ(scope.pending(), 1u);
  EXPECT_FALSE(j->done) << "one piece of work is still running";
  g1.set();
  poll(io);
  EXPECT_TRUE(j->done && !j->error) << j->message();
  EXPECT_EQ(scope.pending(), 0u);
}

TEST(drain_scope, first_error_is_rethrown_once_after_all_work_finished) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  async::event g1(io.get_executor()), g2(io.get_executor()), g3(io.get_executor());
  scope.spawn(wait_then_fail(g1, errc::processing_failed, "bucket 0 failed"));
  scope.spawn(wait_then_fail(g2, errc::io_error, "bucket 1 failed too"));
  scope.spawn(wait_then_fail(g3, errc{}, ""));
  auto j = spawn(io, scope.join());
  g1.set();
  poll(io);
  EXPECT_TRUE(scope.has_error());
  EXPECT_FALSE(j->done) << "join must wait for the rest even after an error";
  g2.set();
  poll(io);
  EXPECT_FALSE(j->done);
  g3.set();
  poll(io);
  ASSERT_TRUE(j->done);
  ASSERT_TRUE(j->error);
  EXPECT_EQ(j->kind(), static_cast<int>(errc::processing_failed));
  EXPECT_EQ(j->message(), "bucket 0 failed");
  EXPECT_FALSE(scope.has_error()) << "the error is forgotten once reported";
  auto again = spawn(io, scope.join());
  poll(io);
  EXPECT_TRUE(again->done && !again->error) << "reported once: " << again->message();
}

TEST(drain_scope, concurrent_joiners_report_the_error_exactly_once) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  async::event gate(io.get_executor());
  scope.spawn(wait_then_fail(gate, errc::peer_lost, "gone"));
  auto a = spawn(io, scope.join());
  auto b = spawn(io, scope.join());
  poll(io);
  gate.set();
  poll(io);
  ASSERT_TRUE(a->done && b->done);
  EXPECT_EQ((a->error ? 1 : 0) + (b->error ? 1 : 0), 1);
}

TEST(drain_scope, errors_of_a_later_round_are_reported_again) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  async::event open(io.get_executor());
  open.set();
  scope.spawn(wait_then_fail(open, errc::io_error, "round 1"));
  auto j1 = spawn(io, scope.join());
  poll(io);
  EXPECT_EQ(j1->message(), "round 1");
  scope.spawn(wait_then_fail(open, errc::timeout, "round 2"));
  auto j2 = spawn(io, scope.join());
  poll(io);
  EXPECT_EQ(j2->kind(), static_cast<int>(errc::timeout));
  EXPECT_EQ(j2->message(), "round 2");
}

TEST(drain_scope, manual_add_and_done_count_like_spawn) {
  asio::io_context io;
  async::drain_scope scope(io.get_executor());
  scope.add();
  scope.add();
  auto j = spawn(io, scope.join());
  poll(io);
  EXPECT_FALSE(j->done);
  scope.done(std::make_exception_ptr(error(errc::integrity_error, "checksum mismatch")));
  scope.done(std::make_exception_ptr(error(errc::io_error, "later")));
  poll(io);
  ASSERT_TRUE(j->done);
  EXPECT_EQ(j->kind(), static_cast<int>(errc::integrity_error));
  EXPECT_EQ(j->message(), "checksum mismatch");
}

// ---- slot_ring ----

asio::awaitable<void> acquire_into(async::slot_ring& ring, std::optional<std::size_t>& out) {
  out = co_await ring.acquire();
}

TEST(slot_ring, size_zero_is_rejected) {
  asio::io_context io;
  auto e = REFIT_THROWN(async::slot_ring(io.get_executor(), 0));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "slot_ring: size must be at least 1");
}

TEST(slot_ring, hands_out_slots_in_order_and_blocks_when_empty) {
  asio::io_context io;
  async::slot_ring ring(io.get_executor(), 3);
  EXPECT_EQ(ring.size(), 3u);
  EXPECT_EQ(ring.available(), 3u);
  std::optional<std::size_t> s[4];
  for (int i = 0; i < 3; ++i) spawn(io, acquire_into(ring, s[i]));
  poll(io);
  EXPECT_EQ(s[0], 0u);
  EXPECT_EQ(s[1], 1u);
  EXPECT_EQ(s[2], 2u);
  EXPECT_EQ(ring.available(), 0u);
  auto blocked = spawn(io, acquire_into(ring, s[3]));
  poll(io);
  EXPECT_FALSE(blocked->done) << "acquire must wait while every slot is held";
  EXPECT_FALSE(s[3]);
  ring.release(1);
  poll(io);
  EXPECT_TRUE(blocked->done);
  EXPECT_EQ(s[3], 1u) << "the waiter gets the released slot";
  EXPECT_EQ(ring.available(), 0u);
}

TEST(slot_ring, released_slots_come_back_in_release_order) {
  asio::io_context io;
  async::slot_ring ring(io.get_executor(), 3);
  std::optional<std::size_t> s[6];
  for (int i = 0; i < 3; ++i) spawn(io, acquire_into(ring, s[i]));
  poll(io);
  ring.release(2);
  ring.release(0);
  ring.release(1);
  EXPECT_EQ(ring.available(), 3u);
  for (int i = 3; i < 6; ++i) spawn(io, acquire_into(ring, s[i]));
  poll(io);
  EXPECT_EQ(s[3], 2u);
  EXPECT_EQ(s[4], 0u);
  EXPECT_EQ(s[5], 1u);
}

TEST(slot_ring, waiters_are_served_first_come_first_served) {
  asio::io_context io;
  async::slot_ring ring(io.get_executor(), 1);
  std::optional<std::size_t> first, a, b;
  spawn(io, acquire_into(ring, first));
  poll(io);
  auto wa = spawn(io, acquire_into(ring, a));
  poll(io);
  auto wb = spawn(io, acquire_into(ring, b));
  poll(io);
  ring.release(0);
  poll(io);
  EXPECT_TRUE(wa->done) << "the earlier waiter is served first";
  EXPECT_FALSE(wb->done);
  ring.release(0);
  poll(io);
  EXPECT_TRUE(wb->done);
}

TEST(slot_ring, release_of_a_slot_not_held_is_an_error) {
  asio::io_context io;
  async::slot_ring ring(io.get_executor(), 2);
  auto e = REFIT_THROWN(ring.release(0));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_EQ(e.message(), "slot_ring: release of slot 0 that is not held");
  e = REFIT_THROWN(ring.release(7));
  EXPECT_EQ(e.message(), "slot_ring: release of slot 7 that is not held");
  std::optional<std::size_t> s;
  spawn(io, acquire_into(ring, s));
  poll(io);
  ASSERT_EQ(s, 0u);
  ring.release(0);
  e = REFIT_THROWN(ring.release(0));  // double release
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_EQ(ring.available(), 2u) << "a bad release must not inflate the count";
}

TEST(slot_ring, generation_advances_on_each_release) {
  asio::io_context io;
  async::slot_ring ring(io.get_executor(), 2);
  EXPECT_EQ(ring.generation(0), 0u);
  std::optional<std::size_t> s;
  for (int round = 1; round <= 3; ++round) {
    s.reset();
    spawn(io, acquire_into(ring, s));
    poll(io);
    ring.release(*s);
  }
  EXPECT_EQ(ring.generation(0) + ring.generation(1), 3u);
  EXPECT_THROW(ring.generation(2), std::out_of_range);
}

// ---- yield_now ----

asio::awaitable<void> count_with_yields(std::vector<int>& order, int who, int steps) {
  for (int i = 0; i < steps; ++i) {
    order.push_back(who);
    co_await async::yield_now();
  }
}

TEST(yield_now, lets_the_other_handlers_of_the_loop_run_in_between) {
  asio::io_context io;
  std::vector<int> order;
  auto a = testing::spawn(io, count_with_yields(order, 1, 3));
  auto b = testing::spawn(io, count_with_yields(order, 2, 3));
  ASSERT_TRUE(testing::run(io));
  EXPECT_TRUE(a->done && !a->error && b->done && !b->error);
  // Without the yields each would run its three steps in one stretch.
  EXPECT_EQ(order, (std::vector<int>{1, 2, 1, 2, 1, 2}));
}

// ---- offload ----

struct offload_record {
  std::thread::id worker, resumed;
  bool resumed_on_caller = false;
  int value = 0;
  std::string error;
  int kind = 0;
};

asio::awaitable<void> offload_value(asio::any_io_executor pool, asio::io_context& io, offload_record& r) {
  r.value = co_await async::offload(pool, [&r] {
    r.worker = std::this_thread::get_id();
    return 42;
  });
  r.resumed = std::this_thread::get_id();
  r.resumed_on_caller = io.get_executor().running_in_this_thread();
}

asio::awaitable<void> offload_throwing(asio::any_io_executor pool, asio::io_context& io, offload_record& r) {
  try {
    co_await async::offload(pool, [&r]() -> int {
      r.worker = std::this_thread::get_id();
      throw error(errc::io_error, "disk on fire");
    });
    r.error = "<no exception>";
  } catch (const error& e) {
    r.error = e.message();
    r.kind = static_cast<int>(e.kind());
  }
  r.resumed = std::this_thread::get_id();
  r.resumed_on_caller = io.get_executor().running_in_this_thread();
}

asio::awaitable<void> offload_void(asio::any_io_executor pool, asio::io_context& io, offload_record& r, bool fail) {
  try {
    co_await async::offload(pool, [&r, fail] {
      r.worker = std::this_thread::get_id();
      if (fail) throw std::runtime_error("void work failed");
      r.value = 1;
    });
  } catch (const std::runtime_error& e) {
    r.error = e.what();
  }
  r.resumed = std::this_thread::get_id();
  r.resumed_on_caller = io.get_executor().running_in_this_thread();
}

TEST(offload, runs_on_the_pool_and_resumes_on_the_callers_executor) {
  asio::io_context io;
  asio::thread_pool pool(1);
  offload_record r;
  testing::run_to_completion(io, offload_value(pool.get_executor(), io, r));
  EXPECT_EQ(r.value, 42);
  EXPECT_NE(r.worker, std::this_thread::get_id()) << "work must leave the event loop";
  EXPECT_EQ(r.resumed, std::this_thread::get_id());
  EXPECT_TRUE(r.resumed_on_caller);
  pool.join();
}

TEST(offload, exception_is_rethrown_in_the_caller_on_its_executor) {
  asio::io_context io;
  asio::thread_pool pool(1);
  offload_record r;
  testing::run_to_completion(io, offload_throwing(pool.get_executor(), io, r));
  EXPECT_EQ(r.error, "disk on fire");
  EXPECT_EQ(r.kind, static_cast<int>(errc::io_error));
  EXPECT_NE(r.worker, std::this_thread::get_id());
  EXPECT_EQ(r.resumed, std::this_thread::get_id());
  EXPECT_TRUE(r.resumed_on_caller);
  pool.join();
}

TEST(offload, void_work_completes_and_its_exception_reaches_the_caller) {
  asio::io_context io;
  asio::thread_pool pool(2);
  offload_record ok, bad;
  testing::run_to_completion(io, offload_void(pool.get_executor(), io, ok, false));
  testing::run_to_completion(io, offload_void(pool.get_executor(), io, bad, true));
  EXPECT_EQ(ok.value, 1);
  EXPECT_TRUE(ok.error.empty());
  EXPECT_TRUE(ok.resumed_on_caller);
  EXPECT_EQ(bad.error, "void work failed");
  EXPECT_TRUE(bad.resumed_on_caller);
  EXPECT_NE(bad.worker, std::this_thread::get_id());
  pool.join();
}

asio::awaitable<void> offload_move_only(asio::any_io_executor pool, std::unique_ptr<int>& out) {
  out = co_await async::offload(pool, [] { return std::make_unique<int>(7); });
}

TEST(offload, move_only_results_are_delivered) {
  asio::io_context io;
  asio::thread_pool pool(1);
  std::unique_ptr<int> out;
  testing::run_to_completion(io, offload_move_only(pool.get_executor(), out));
  ASSERT_TRUE(out);
  EXPECT_EQ(*out, 7);
  pool.join();
}

TEST(offload, callback_handler_runs_on_its_bound_executor) {
  asio::io_context io;
  asio::thread_pool pool(1);
  std::thread::id worker, handler_thread;
  bool on_io = false, called = false;
  int got = 0;
  std::exception_ptr err;
  async::offload(
      pool.get_executor(),
      [&worker] {
        worker = std::this_thread::get_id();
        return 5;
      },
      asio::bind_executor(io.get_executor(), [&](std::exception_ptr e, int v) {
        called = true;
        err = e;
        got = v;
        handler_thread = std::this_thread::get_id();
        on_io = io.get_executor().running_in_this_thread();
      }));
  ASSERT_TRUE(testing::run(io, 30s)) << "the handler never came back to the io_context";
  ASSERT_TRUE(called);
  EXPECT_FALSE(err);
  EXPECT_EQ(got, 5);
  EXPECT_NE(worker, std::this_thread::get_id());
  EXPECT_EQ(handler_thread, std::this_thread::get_id());
  EXPECT_TRUE(on_io);
  pool.join();
}

TEST(offload, work_on_a_strand_runs_in_order) {
  asio::io_context io;
  asio::thread_pool pool(4);
  auto strand = asio::make_strand(pool.get_executor());
  std::vector<int> order;  // touched only by the strand
  int done = 0;
  for (int i = 0; i < 20; ++i)
    async::offload(
        strand, [&order, i] { order.push_back(i); },
        asio::bind_executor(io.get_executor(), [&done](std::exception_ptr) { ++done; }));
  ASSERT_TRUE(testing::run(io, 30s));
  pool.join();
  EXPECT_EQ(done, 20);
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
}

// ---- with_deadline ----

asio::awaitable<int> answer() { co_return 42; }

asio::awaitable<void> nothing() { co_return; }

asio::awaitable<void> fail_now(errc kind, std::string message) {
  throw_error(kind, message);
  co_return;
}

// Sets `flag` when the coroutine frame goes away, however it ends.
struct set_on_exit {
  bool& flag;
  ~set_on_exit() { flag = true; }
};

// A peer that never answers: waits an hour on a timer.
asio::awaitable<void> silent_peer(bool& unwound) {
  set_on_exit guard{unwound};
  asio::steady_timer forever(co_await asio::this_coro::executor, std::chrono::hours(1));
  co_await forever.async_wait(asio::use_awaitable);
}

asio::awaitable<void> expect_value(int& out) {
  out = co_await async::with_deadline(answer(), std::chrono::hours(1), "answer");
}

TEST(with_deadline, passes_the_result_through_and_cancels_its_timer) {
  asio::io_context io;
  int out = 0;
  auto r = spawn(io, expect_value(out));
  // run() returns only once nothing is pending: an hour-long timer left armed
  // would keep it running until the watchdog.
  ASSERT_TRUE(testing::run(io, 30s)) << "the deadline timer was left running";
  EXPECT_TRUE(r->done && !r->error) << r->message();
  EXPECT_EQ(out, 42);
}

TEST(with_deadline, void_operations_complete) {
  asio::io_context io;
  auto r = spawn(io, async::with_deadline(nothing(), std::chrono::hours(1), "nothing"));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_TRUE(r->done && !r->error) << r->message();
}

TEST(with_deadline, expiry_is_a_timeout_naming_what_was_awaited_and_cancels_the_operation) {
  asio::io_context io;
  bool unwound = false;
  auto r = spawn(io, async::with_deadline(silent_peer(unwound), 5ms, "tcp: waiting for the trainer's hello"));
  ASSERT_TRUE(testing::run(io, 30s)) << "with_deadline did not give up";
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::timeout));
  EXPECT_EQ(r->message(), "tcp: waiting for the trainer's hello: no progress within 5 ms");
  EXPECT_TRUE(unwound) << "the timed-out operation must be cancelled, not left running";
}

TEST(with_deadline, an_event_wait_is_cancelled_by_the_deadline) {
  asio::io_context io;
  async::event never(io.get_executor());
  auto r = spawn(io, async::with_deadline(never.wait(), 2ms, "drain"));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_EQ(r->kind(), static_cast<int>(errc::timeout));
  EXPECT_THAT(r->message(), HasSubstr("drain: no progress within 2 ms"));
}

// Regression test: with_deadline used to race `op || timer` with asio's awaitable
// operator||, which waits for the first operation to *succeed*; a failing `op` (peer
// lost) was then reported as errc::timeout once the whole deadline had passed.
TEST(with_deadline, failure_of_the_operation_is_reported_not_masked_as_timeout) {
  asio::io_context io;
  auto r = spawn(
      io, async::with_deadline(fail_now(errc::peer_lost, "tcp: connection reset by trainer"), 200ms, "tcp: bucket 0"));
  ASSERT_TRUE(testing::run(io, 30s));
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::peer_lost)) << r->message();
  EXPECT_EQ(r->message(), "tcp: connection reset by trainer");
}

asio::awaitable<void> fail_after_a_wait(async::event& trigger) {
  co_await trigger.wait();
  throw_error(errc::protocol_error, "tcp: bad frame header");
}

TEST(with_deadline, failure_after_suspending_is_reported_at_once) {
  asio::io_context io;
  async::event trigger(io.get_executor());
  // An hour-long deadline: the error must not wait for it.
  auto r = spawn(io, async::with_deadline(fail_after_a_wait(trigger), std::chrono::hours(1), "tcp: bucket 2"));
  poll(io);
  EXPECT_FALSE(r->done);
  trigger.set();
  ASSERT_TRUE(testing::run(io, 30s)) << "the error waited for the deadline";
  EXPECT_EQ(r->kind(), static_cast<int>(errc::protocol_error)) << r->message();
  EXPECT_EQ(r->message(), "tcp: bad frame header");
}

// ---- all_of ----

asio::awaitable<void> finish_after(async::event& gate, int id, std::vector<int>& finished, errc fail = errc{}) {
  co_await gate.wait();
  finished.push_back(id);
  if (fail != errc{}) throw_error(fail, "op " + std::to_string(id) + " failed");
}

asio::awaitable<void> run_all(std::vector<asio::awaitable<void>> ops) { co_await async::all_of(std::move(ops)); }

TEST(all_of, empty_list_completes_at_once) {
  asio::io_context io;
  auto r = spawn(io, run_all({}));
  poll(io);
  EXPECT_TRUE(r->done && !r->error);
}

TEST(all_of, waits_for_every_operation) {
  asio::io_context io;
  async::event g0(io.get_executor()), g1(io.get_executor()), g2(io.get_executor());
  std::vector<int> finished;
  std::vector<asio::awaitable<void>> ops;
  ops.push_back(finish_after(g0, 0, finished));
  ops.push_back(finish_after(g1, 1, finished));
  ops.push_back(finish_after(g2, 2, finished));
  auto r = spawn(io, run_all(std::move(ops)));
  poll(io);
  g2.set();
  g0.set();
  poll(io);
  EXPECT_FALSE(r->done);
  EXPECT_EQ(finished, (std::vector<int>{2, 0})) << "operations run concurrently";
  g1.set();
  poll(io);
  EXPECT_TRUE(r->done && !r->error) << r->message();
}

TEST(all_of, rethrows_the_first_error_only_after_all_finished) {
  asio::io_context io;
  async::event g0(io.get_executor()), g1(io.get_executor()), g2(io.get_executor());
  std::vector<int> finished;
  std::vector<asio::awaitable<void>> ops;
  ops.push_back(finish_after(g0, 0, finished, errc::io_error));
  ops.push_back(finish_after(g1, 1, finished, errc::peer_lost));
  ops.push_back(finish_after(g2, 2, finished));
  auto r = spawn(io, run_all(std::move(ops)));
  poll(io);
  g1.set();
  poll(io);
  EXPECT_FALSE(r->done) << "no operation is abandoned half way";
  g0.set();
  g2.set();
  poll(io);
  ASSERT_TRUE(r->done);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::peer_lost));
  EXPECT_EQ(r->message(), "op 1 failed");
  EXPECT_EQ(finished.size(), 3u);
}

// The probe sees a handler that holds the loop for 40 ms, and take() starts afresh.
TEST(lag_probe, reports_the_largest_stall_of_the_loop_and_resets) {
  asio::io_context io;
  async::lag_probe probe(io.get_executor());
  testing::run_until(
      io, [] { return false; }, 50ms);
  auto quiet = probe.take();
  EXPECT_GT(quiet.samples, 10u);
  EXPECT_LT(quiet.max_ms, 40.0);
  // The sleep is what is measured (a handler that blocks the loop), not a wait.
  asio::post(io, [] { std::this_thread::sleep_for(40ms); });
  testing::run_until(
      io, [] { return false; }, 100ms);
  auto stalled = probe.take();
  EXPECT_GE(stalled.max_ms, 35.0) << "the 40 ms stall went unseen";
  EXPECT_GT(stalled.samples, 0u);
  auto after = probe.take();
  EXPECT_EQ(after.samples, 0u) << "take() resets";
  probe.stop();
  EXPECT_TRUE(testing::run(io, 5s)) << "stop() leaves nothing running";
}

}  // namespace
}  // namespace refit
