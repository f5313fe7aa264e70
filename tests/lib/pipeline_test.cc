// The shared receive pipeline and host staging, driven by an in-process transport
// that fills each bucket from a send_cursor (the trainer's side of the same plan).
#include <refit/backend/pipeline.h>

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <asio/buffer.hpp>
#include <asio/io_context.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/async/event.h>
#include <refit/backend/send_cursor.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit {
namespace {

using testing::capture;
using ::testing::HasSubstr;
using testing::spawn;
using testing::tensor_set;
using namespace std::chrono_literals;

void poll(asio::io_context& io) {
  io.restart();
  io.poll();
}

wire_params wire(std::uint64_t buffer_bytes, std::uint32_t num_buffers) {
  wire_params w;
  w.buffer_bytes = buffer_bytes;
  w.num_buffers = num_buffers;
  return w;
}

// The trainer in the same process: bucket k's bytes come from a send_cursor over
// `set`. Can fail at a chosen bucket.
class cursor_transport final : public bucket_transport {
 public:
  cursor_transport(tensor_set& set, const wire_params& w)
      : plan_(plan_buckets(set.meta, w)), views_(set.views()), source_(views_), cursor_(set.meta, plan_, source_) {}

  asio::awaitable<void> begin(const bucket& b) override {
    if (fail_header_at && *fail_header_at == b.index)
      throw_error(errc::protocol_error, "fake transport: bucket " + std::to_string(b.index) + " header refused");
    co_return;
  }
  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    started.push_back(b.index);
    if (fail_at && *fail_at == b.index)
      throw_error(errc::peer_lost, "fake transport: trainer lost at bucket " + std::to_string(b.index));
    EXPECT_EQ(asio::buffer_size(dest), b.payload_bytes);
    const auto& buffers = cursor_.gather(plan_.buckets.at(b.index));
    EXPECT_EQ(asio::buffer_copy(dest, buffers), b.payload_bytes);
    co_return;
  }

  const bucket_plan& plan() const { return plan_; }
  std::vector<std::uint64_t> started;
  std::optional<std::uint64_t> fail_at;
  std::optional<std::uint64_t> fail_header_at;

 private:
  bucket_plan plan_;
  std::vector<tensor_view> views_;
  range_source<std::vector<tensor_view>> source_;
  send_cursor cursor_;
};

asio::awaitable<void> receive_all(receive_pipeline& p, const update_metadata& meta, bucket_transport& t,
                                  load_weights_fn load, async::drain_scope& scope, update_stats& stats) {
  co_await p.receive(meta, t, std::move(load), scope, stats);
}

// Receives, then joins the processing (drain_scope::join waits only for what is
// pending when it starts, so it must follow the receive).
asio::awaitable<void> receive_and_join(receive_pipeline& p, const update_metadata& meta, bucket_transport& t,
                                       load_weights_fn load, async::drain_scope& scope, update_stats& stats) {
  co_await p.receive(meta, t, std::move(load), scope, stats);
  co_await scope.join();
}

// Receives; on failure notes how many tensors had been loaded when the error
// reached the caller.
asio::awaitable<void> receive_noting(receive_pipeline& p, const update_metadata& meta, bucket_transport& t,
                                     load_weights_fn load, async::drain_scope& scope, update_stats& stats,
                                     const std::size_t& loaded, std::size_t& loaded_when_failed) {
  try {
    co_await p.receive(meta, t, std::move(load), scope, stats);
  } catch (...) {
    loaded_when_failed = loaded;
    throw;
  }
}

tensor_set mixed_set() {
  tensor_set set;
  set.add("embed", dtype::bfloat16, {100, 50});  // 10000 bytes: split in 3 at 4096
  set.add("norm", dtype::float32, {7});
  set.add("bias", dtype::float16, {3});
  set.add("empty", dtype::float32, {0});
  set.add("proj", dtype::float8_e4m3fn, {40, 50});
  set.add("head", dtype::int8, {4097});  // split: 4096 + 1
  set.add("empty2", dtype::int64, {0, 4});
  set.add("tail", dtype::float64, {});
  return set;
}

// ---- host_staging ----

TEST(host_staging, allocates_page_aligned_slots_up_front) {
  host_staging staging(3, 10000);
  EXPECT_EQ(staging.slot_count(), 3u);
  EXPECT_TRUE(staging.device().is_cpu());
  EXPECT_EQ(staging.allocated_bytes(), 30000u);
  std::set<std::byte*> distinct;
  for (std::size_t i = 0; i < 3; ++i) {
    auto s = staging.slot(i);
    EXPECT_EQ(s.size(), 10000u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s.data()) % 4096, 0u);
    distinct.insert(s.data());
  }
  EXPECT_EQ(distinct.size(), 3u);
  EXPECT_THROW(staging.slot(3), std::out_of_range);
}

TEST(host_staging, assembly_grows_on_demand_and_is_kept) {
  host_staging staging(1, 4096);
  auto a = staging.assembly(10000);
  EXPECT_EQ(a.size(), 10000u);
  EXPECT_EQ(staging.allocated_bytes(), 4096u + 10000u);
  auto b = staging.assembly(100);
  EXPECT_EQ(b.size(), 100u);
  EXPECT_EQ(b.data(), a.data()) << "a smaller request reuses the buffer";
  EXPECT_EQ(staging.allocated_bytes(), 4096u + 10000u);
  auto c = staging.assembly(20000);
  EXPECT_EQ(c.size(), 20000u);
  EXPECT_EQ(staging.allocated_bytes(), 4096u + 20000u) << "the old buffer is freed, not kept beside the new";
}

// ---- receive_pipeline ----

TEST(receive_pipeline, staging_must_match_the_wire_params) {
  asio::io_context io;
  auto e = REFIT_THROWN(
      receive_pipeline(io.get_executor(), io.get_executor(), wire(4096, 2), std::make_unique<host_staging>(3, 4096)));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "receive_pipeline: staging must have num_buffers slots");
  e = REFIT_THROWN(receive_pipeline(io.get_executor(), io.get_executor(), wire(4096, 2), nullptr));
  EXPECT_EQ(e.message(), "receive_pipeline: staging must have num_buffers slots");
  e = REFIT_THROWN(
      receive_pipeline(io.get_executor(), io.get_executor(), wire(4096, 65), std::make_unique<host_staging>(65, 4096)));
  EXPECT_EQ(e.message(), "wire params: num_buffers must be in [1, 64], got 65");
  e = REFIT_THROWN(
      receive_pipeline(io.get_executor(), io.get_executor(), wire(1000, 1), std::make_unique<host_staging>(1, 1000)));
  EXPECT_EQ(e.message(), "wire params: buffer_bytes must be in [4096, 16 GiB], got 1000");
  e = REFIT_THROWN(
      receive_pipeline(io.get_executor(), io.get_executor(), wire(4096, 0), std::make_unique<host_staging>(0, 4096)));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
}

// Regression test (was a minor bug in lib/backend/pipeline.cc receive_pipeline::receive_pipeline): the member
// initialisers build slots_(executor, params.num_buffers) before the body runs
// params_.validate(), so num_buffers = 0 is reported by slot_ring as "slot_ring: size
// must be at least 1" instead of the wire-params message that names the member and
// the accepted range (as num_buffers = 65 is). Fix: validate in the initialiser of
// params_ (declared before slots_), e.g. params_(validated(params)).
TEST(receive_pipeline, zero_buffers_is_reported_as_a_wire_param) {
  asio::io_context io;
  auto e = REFIT_THROWN(
      receive_pipeline(io.get_executor(), io.get_executor(), wire(4096, 0), std::make_unique<host_staging>(0, 4096)));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "wire params: num_buffers must be in [1, 64], got 0");
}

class pipeline_test : public ::testing::Test {
 protected:
  std::unique_ptr<receive_pipeline> make(const wire_params& w, asio::any_io_executor processing = {}) {
    if (!processing) processing = io.get_executor();
    return std::make_unique<receive_pipeline>(io.get_executor(), processing, w,
                                              std::make_unique<host_staging>(w.num_buffers, w.buffer_bytes));
  }
  asio::io_context io;
  async::drain_scope scope{io.get_executor()};
  update_stats stats;
};

TEST_F(pipeline_test, delivers_every_tensor_with_its_bytes_in_send_order) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set = mixed_set();
  cursor_transport transport(set, w);
  capture got;
  std::vector<std::string> order;
  bool all_aligned = true, all_cpu = true;
  auto load = [&, inner = got.fn()](std::span<const tensor_view> views) {
    for (const auto& v : views) {
      order.emplace_back(v.name);
      if (reinterpret_cast<std::uintptr_t>(v.data) % wire_params::alignment != 0) all_aligned = false;
      if (!v.device.is_cpu()) all_cpu = false;
    }
    inner(views);
  };
  auto r = spawn(io, receive_and_join(*pipeline, set.meta, transport, load, scope, stats));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_FALSE(r->error) << r->message();
  EXPECT_NO_THROW(got.check_equals(set));
  std::vector<std::string> expected;
  for (const auto& t : set.meta.tensors) expected.push_back(t.name);
  EXPECT_EQ(order, expected);
  EXPECT_TRUE(all_aligned) << "views must be aligned for any dtype";
  EXPECT_TRUE(all_cpu);
  EXPECT_EQ(stats.bytes, set.meta.total_bytes()) << "padding is not counted";
  EXPECT_EQ(stats.tensors, set.meta.tensors.size());
  EXPECT_EQ(stats.buckets, transport.plan().buckets.size());
  EXPECT_EQ(pipeline->staging().allocated_bytes(), 2u * 4096u + 10000u)
      << "two slots plus one assembly buffer the size of the largest split tensor";
}

// Host staging that notes the thread on which its assembly buffer grows.
class noting_staging final : public staging_memory {
 public:
  explicit noting_staging(const wire_params& w) : inner_(w.num_buffers, w.buffer_bytes) {}
  refit::device device() const noexcept override { return inner_.device(); }
  std::size_t slot_count() const noexcept override { return inner_.slot_count(); }
  std::span<std::byte> slot(std::size_t i) override { return inner_.slot(i); }
  std::span<std::byte> assembly(std::uint64_t bytes) override {
    if (bytes > inner_.allocated_bytes() - inner_.slot_count() * inner_.slot(0).size())
      grown_on.push_back(std::this_thread::get_id());
    return inner_.assembly(bytes);
  }
  std::uint64_t allocated_bytes() const noexcept override { return inner_.allocated_bytes(); }
  std::vector<std::thread::id> grown_on;

 private:
  host_staging inner_;
};

// Growing the assembly buffer (allocating and faulting in the largest split tensor,
// or a cudaMalloc on a GPU) is CPU work the event loop must not do: it happens on
// the processing executor, once, before the update's first byte.
TEST_F(pipeline_test, the_assembly_buffer_grows_on_the_processing_executor_not_the_event_loop) {
  const wire_params w = wire(4096, 2);
  asio::thread_pool pool(1);
  auto owned = std::make_unique<noting_staging>(w);
  noting_staging* staging = owned.get();
  receive_pipeline pipeline(io.get_executor(), pool.get_executor(), w, std::move(owned));
  tensor_set set = mixed_set();
  cursor_transport transport(set, w);
  capture got;
  auto r = spawn(io, receive_and_join(pipeline, set.meta, transport, got.fn(), scope, stats));
  ASSERT_TRUE(testing::run_until(
      io, [&] { return r->done; }, 30s));
  EXPECT_FALSE(r->error) << r->message();
  EXPECT_NO_THROW(got.check_equals(set));
  ASSERT_EQ(staging->grown_on.size(), 1u) << "grown once, to the largest split tensor";
  EXPECT_NE(staging->grown_on[0], std::this_thread::get_id()) << "grown on the event loop";
  EXPECT_EQ(pipeline.staging().allocated_bytes(), 2u * 4096u + 10000u);
  pool.join();
}

// A model that offers its own memory for every tensor and counts when bytes start
// landing there.
class direct_target final : public model_target {
 public:
  explicit direct_target(const tensor_set& set) {
    for (const auto& t : set.meta.tensors) memory_[t.name].resize(t.nbytes());
  }
  void load_weights(std::span<const tensor_view>) override {}
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    return tensor_view(spec, memory_.at(spec.name).data());
  }
  void direct_write_begins() override { ++begun; }
  int begun = 0;

 private:
  std::map<std::string, std::vector<std::byte>> memory_;
};

// "The model was reached" means bytes landed in its memory: a failure before the
// first bucket's bytes (a refused header) leaves it untouched; one after says so once.
TEST_F(pipeline_test, the_target_learns_when_bytes_start_landing_in_its_memory) {
  const wire_params w = wire(4096, 2);
  tensor_set set = mixed_set();
  for (std::uint64_t fail_at : {0u, 3u}) {
    auto pipeline = make(w);
    direct_target target(set);
    cursor_transport transport(set, w);
    transport.fail_header_at = fail_at;
    capture got;
    async::drain_scope s(io.get_executor());
    auto r = spawn(io, pipeline->receive(set.meta, transport, got.fn(), s, stats, &target));
    ASSERT_TRUE(testing::run_until(
        io, [&] { return r->done; }, 30s));
    ASSERT_TRUE(r->error);
    EXPECT_EQ(target.begun, fail_at == 0 ? 0 : 1) << "failing at bucket " << fail_at;
  }
}

// A transport whose buckets carry a check (as a checksum would): checks take
// uneven time and one may fail.
class checked_transport final : public bucket_transport {
 public:
  checked_transport(tensor_set& set, const wire_params& w) : inner_(set, w) {}
  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    co_await inner_.receive(b, dest);
  }
  std::function<void()> check(const bucket& b, std::span<const asio::mutable_buffer>) override {
    return [this, index = b.index] {
      // Simulated work, not a wait: uneven checks, so the order they finish in is not free.
      if (index % 2 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ++checked;
      if (fail_at && *fail_at == index)
        throw_error(errc::integrity_error, "bucket " + std::to_string(index) + ": checksum differs");
    };
  }
  const bucket_plan& plan() const { return inner_.plan(); }
  std::optional<std::uint64_t> fail_at;
  std::atomic<int> checked{0};

 private:
  cursor_transport inner_;
};

// Checks run off the loop, concurrently with loads, yet loads stay in bucket order;
// receive completes once every check passed, while loads may still be held.
TEST_F(pipeline_test, checks_run_beside_loads_which_stay_in_order_and_receive_waits_only_for_checks) {
  const wire_params w = wire(4096, 3);
  asio::thread_pool pool(3);
  auto pipeline = make(w, pool.get_executor());
  tensor_set set;
  for (int i = 0; i < 12; ++i) set.add("p" + std::to_string(i), dtype::float32, {300 + 50 * i});
  checked_transport transport(set, w);
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  std::mutex m;
  std::vector<std::string> order;
  capture got;
  auto load = [&, inner = got.fn(), opened](std::span<const tensor_view> views) {
    if (views.front().name == std::string_view("p0")) opened.wait();  // processing held from the first bucket
    {
      std::lock_guard lock(m);
      for (const auto& v : views) order.emplace_back(v.name);
    }
    inner(views);
  };
  auto r = spawn(io, pipeline->receive(set.meta, transport, load, scope, stats));
  // Loads are held at the gate (only the first bucket fits before the slots run out),
  // so receive cannot finish unless checks run beside them: with 3 buffers it
  // cannot anyway, so open the gate once every slot is taken and checked.
  ASSERT_TRUE(testing::run_until(
      io, [&] { return transport.checked >= 3; }, 30s))
      << "checks waited behind a load";
  gate.set_value();
  ASSERT_TRUE(testing::run_until(
      io, [&] { return r->done; }, 30s));
  EXPECT_FALSE(r->error) << r->message();
  auto j = spawn(io, scope.join());
  ASSERT_TRUE(testing::run_until(
      io, [&] { return j->done; }, 30s));
  EXPECT_NO_THROW(got.check_equals(set));
  std::vector<std::string> expected;
  for (const auto& t : set.meta.tensors) expected.push_back(t.name);
  EXPECT_EQ(order, expected) << "loads out of bucket order";
  pool.join();
}

TEST_F(pipeline_test, a_failed_check_fails_receive_with_its_error_and_nothing_after_it_is_loaded) {
  const wire_params w = wire(4096, 2);
  asio::thread_pool pool(2);
  auto pipeline = make(w, pool.get_executor());
  tensor_set set;
  for (int i = 0; i < 10; ++i) set.add("p" + std::to_string(i), dtype::float32, {500});
  checked_transport transport(set, w);
  transport.fail_at = 4;
  std::mutex m;
  std::vector<std::string> loaded;
  auto load = [&](std::span<const tensor_view> views) {
    std::lock_guard lock(m);
    for (const auto& v : views) loaded.emplace_back(v.name);
  };
  auto r = spawn(io, pipeline->receive(set.meta, transport, load, scope, stats));
  ASSERT_TRUE(testing::run_until(
      io, [&] { return r->done; }, 30s));
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::integrity_error)) << r->message();
  EXPECT_NE(r->message().find("bucket 4: checksum differs"), std::string::npos) << r->message();
  std::map<std::string, std::uint64_t> bucket_of;
  for (const bucket& b : transport.plan().buckets)
    for (const auto& piece : transport.plan().pieces_of(b)) bucket_of[set.meta.tensors[piece.tensor].name] = b.index;
  std::lock_guard lock(m);
  EXPECT_FALSE(loaded.empty());
  for (const auto& name : loaded)
    EXPECT_LT(bucket_of.at(name), 4u) << name << " (bucket " << bucket_of.at(name)
                                      << ") was loaded at or after the failed check of bucket 4";
  pool.join();
}

TEST_F(pipeline_test, empty_update_loads_nothing) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  cursor_transport transport(set, w);
  capture got;
  auto r = spawn(io, receive_all(*pipeline, set.meta, transport, got.fn(), scope, stats));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_FALSE(r->error) << r->message();
  EXPECT_EQ(got.calls(), 0u);
  EXPECT_EQ(stats.buckets, 0u);
  EXPECT_TRUE(transport.started.empty());
}

TEST_F(pipeline_test, processing_on_a_thread_pool_is_serialised_and_in_order) {
  const wire_params w = wire(4096, 3);
  asio::thread_pool pool(4);
  auto pipeline = make(w, pool.get_executor());
  tensor_set set;
  for (int i = 0; i < 40; ++i) set.add("p" + std::to_string(i), dtype::float32, {300 + 17 * i});
  cursor_transport transport(set, w);
  capture got;
  std::mutex m;
  std::vector<std::string> order;
  std::atomic<int> in_flight{0};
  std::atomic<bool> overlapped{false};
  auto load = [&, inner = got.fn()](std::span<const tensor_view> views) {
    if (in_flight.fetch_add(1) != 0) overlapped = true;
    {
      std::lock_guard lock(m);
      for (const auto& v : views) order.emplace_back(v.name);
    }
    inner(views);
    in_flight.fetch_sub(1);
  };
  auto r = spawn(io, receive_all(*pipeline, set.meta, transport, load, scope, stats));
  ASSERT_TRUE(testing::run_until(
      io, [&] { return r->done; }, 30s));
  auto j = spawn(io, scope.join());
  ASSERT_TRUE(testing::run_until(
      io, [&] { return j->done; }, 30s));
  EXPECT_FALSE(r->error) << r->message();
  EXPECT_FALSE(j->error) << j->message();
  EXPECT_FALSE(overlapped) << "load_weights of one update must never run concurrently with itself";
  EXPECT_NO_THROW(got.check_equals(set));
  std::vector<std::string> expected;
  for (const auto& t : set.meta.tensors) expected.push_back(t.name);
  EXPECT_EQ(order, expected);
  pool.join();
}

TEST_F(pipeline_test, receiver_runs_at_most_num_buffers_buckets_ahead_of_processing) {
  const std::uint32_t slots = 2;
  const wire_params w = wire(4096, slots);
  asio::io_context proc;  // processing, driven by hand
  auto pipeline = make(w, proc.get_executor());
  tensor_set set;
  for (int i = 0; i < 7; ++i) set.add("b" + std::to_string(i), dtype::int8, {3000});  // one per bucket
  cursor_transport transport(set, w);
  ASSERT_EQ(transport.plan().buckets.size(), 7u);
  std::size_t loaded = 0;
  auto load = [&](std::span<const tensor_view> views) { loaded += views.size(); };
  auto r = spawn(io, receive_all(*pipeline, set.meta, transport, load, scope, stats));
  for (int step = 0; step < 20 && !r->done; ++step) {
    poll(io);  // receive as far as free slots allow; deliver processing completions
    EXPECT_EQ(transport.started.size(), std::min<std::size_t>(7, loaded + slots))
        << "step " << step << ": buckets received vs. processed";
    proc.restart();
    proc.poll();  // process whatever is queued
  }
  poll(io);
  ASSERT_TRUE(r->done);
  EXPECT_FALSE(r->error) << r->message();
  auto j = spawn(io, scope.join());
  for (int step = 0; step < 20 && !j->done; ++step) {
    poll(io);
    proc.restart();
    proc.poll();
  }
  ASSERT_TRUE(j->done);
  EXPECT_EQ(loaded, 7u);
  EXPECT_EQ(pipeline->staging().allocated_bytes(), slots * 4096u) << "staging never grows";
}

TEST_F(pipeline_test, transport_error_waits_for_inflight_processing_and_frees_every_slot) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("t" + std::to_string(i), dtype::float32, {1000});  // one per bucket
  cursor_transport failing(set, w);
  failing.fail_at = 3;
  std::size_t loaded = 0;
  std::size_t loaded_when_failed = 0;
  auto load = [&](std::span<const tensor_view> views) { loaded += views.size(); };
  auto r = spawn(io, receive_noting(*pipeline, set.meta, failing, load, scope, stats, loaded, loaded_when_failed));
  ASSERT_TRUE(testing::run(io, 30s));
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::peer_lost));
  EXPECT_EQ(r->message(), "fake transport: trainer lost at bucket 3");
  EXPECT_EQ(loaded_when_failed, 3u) << "buckets 0-2 were processed before the error propagated";
  EXPECT_EQ(scope.pending(), 0u);

  // Every slot came back: a full update through the same pipeline completes.
  cursor_transport healthy(set, w);
  capture got;
  auto again = spawn(io, receive_and_join(*pipeline, set.meta, healthy, got.fn(), scope, stats));
  ASSERT_TRUE(testing::run(io, 30s)) << "a slot leaked by the failed update";
  EXPECT_FALSE(again->error) << again->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_F(pipeline_test, transport_error_inside_a_split_tensor_releases_the_assembly_buffer) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  set.add("small", dtype::int8, {10});
  set.add("big", dtype::int8, {10000});  // buckets 1, 2, 3
  set.add("big2", dtype::int8, {9000});  // buckets 4, 5, 6
  cursor_transport failing(set, w);
  failing.fail_at = 2;  // second chunk of "big"
  capture first;
  auto r = spawn(io, receive_all(*pipeline, set.meta, failing, first.fn(), scope, stats));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_EQ(r->kind(), static_cast<int>(errc::peer_lost));
  auto received = first.received();
  EXPECT_EQ(received.count("big"), 0u) << "a tensor cut short must not be loaded";

  cursor_transport healthy(set, w);
  capture got;
  auto again = spawn(io, receive_and_join(*pipeline, set.meta, healthy, got.fn(), scope, stats));
  ASSERT_TRUE(testing::run(io, 30s)) << "the assembly buffer leaked";
  EXPECT_FALSE(again->error) << again->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_F(pipeline_test, load_weights_error_names_bucket_and_tensor_and_is_reported_once) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("t" + std::to_string(i), dtype::float32, {1000});  // one per bucket
  cursor_transport transport(set, w);
  auto load = [&](std::span<const tensor_view> views) {
    for (const auto& v : views)
      if (v.name == "t3") throw std::runtime_error("model has no parameter t3");
  };
  auto r = spawn(io, receive_all(*pipeline, set.meta, transport, load, scope, stats));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_FALSE(r->error) << "processing errors surface at the join: " << r->message();
  EXPECT_EQ(transport.started.size(), 6u) << "the transfer itself completes";
  auto j = spawn(io, scope.join());
  ASSERT_TRUE(testing::run(io, 30s));
  ASSERT_TRUE(j->error);
  EXPECT_EQ(j->kind(), static_cast<int>(errc::processing_failed));
  EXPECT_EQ(j->message(), "load_weights failed on bucket 3 ('t3'): model has no parameter t3");
  auto again = spawn(io, scope.join());
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_FALSE(again->error) << "reported once";
  EXPECT_EQ(scope.pending(), 0u);
}

// Regression test (was a bug in lib/backend/pipeline.cc, receive_pipeline::process_bucket, `if (!state->failed)`
// before the offload): update_state::failed promises "after a processing error,
// later buckets are not loaded", but the flag is read when each bucket's
// processing coroutine starts, which is right after the bucket is received, and it
// is only set after the failing load_weights has run on the strand and its
// completion came back. Buckets received in the meantime (up to num_buffers - 1 of
// them, more with a split tensor in flight) are still handed to load_weights after
// the failure; here t4 is loaded after t3 failed. How many depends on timing when
// processing runs on a thread pool. Fix: test and set the flag inside the function
// run on the strand (processing of one update is serialised there), e.g. skip the
// call when `failed` is set and set it in a catch inside that lambda.
//
TEST_F(pipeline_test, nothing_is_loaded_after_a_load_weights_failure) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("t" + std::to_string(i), dtype::float32, {1000});  // one per bucket
  cursor_transport transport(set, w);
  std::vector<std::string> loaded;
  auto load = [&](std::span<const tensor_view> views) {
    for (const auto& v : views) {
      if (v.name == "t3") throw std::runtime_error("model has no parameter t3");
      loaded.emplace_back(v.name);
    }
  };
  auto r = spawn(io, receive_and_join(*pipeline, set.meta, transport, load, scope, stats));
  ASSERT_TRUE(testing::run(io, 30s));
  EXPECT_EQ(r->kind(), static_cast<int>(errc::processing_failed));
  EXPECT_EQ(loaded, (std::vector<std::string>{"t0", "t1", "t2"})) << "tensors were loaded after t3 failed";
}

TEST_F(pipeline_test, load_weights_error_message_forms) {
  const wire_params w = wire(4096, 2);
  auto pipeline = make(w);
  tensor_set set;
  for (const char* n : {"a", "b", "c", "d", "e", "f"}) set.add(n, dtype::int8, {8});  // one bucket
  struct not_an_exception {};
  struct form {
    std::function<void()> thrower;
    std::string expected;
  };
  for (const form& f : {
           form{[] { throw error(errc::invalid_argument, "shape of 'a' differs from the model"); },
                "load_weights failed on bucket 0 ('a', 'b', 'c', 'd', ... 6 tensors): shape of 'a' differs from the "
                "model"},
           form{[] { throw not_an_exception{}; },
                "load_weights failed on bucket 0 ('a', 'b', 'c', 'd', ... 6 tensors): a non-standard exception"},
       }) {
    cursor_transport transport(set, w);
    auto r = spawn(
        io, receive_and_join(
                *pipeline, set.meta, transport, [&f](std::span<const tensor_view>) { f.thrower(); }, scope, stats));
    ASSERT_TRUE(testing::run(io, 30s));
    EXPECT_EQ(r->kind(), static_cast<int>(errc::processing_failed));
    EXPECT_EQ(r->message(), f.expected);
  }
}

}  // namespace
}  // namespace refit
