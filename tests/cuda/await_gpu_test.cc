// Needs a GPU; skips itself, with the reason, where there is none.
// The stream -> coroutine bridge on real GPU work: completion order, the thread a
// coroutine resumes on, event gating, shutdown with waits pending, device errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <refit/cuda/await.h>
#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/event.h>
#include <refit/cuda/fill.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include "tests/cuda/test_kernels.h"

namespace refit::cuda {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t spin_ns = 20'000'000;  // 20 ms: completion comes well after run()

struct outcome {
  bool resumed = false;
  std::thread::id resumed_on;
  bool stream_idle_on_resume = false;
  std::string error;
  cudaError_t status = cudaSuccess;
};

// Coroutines are free functions taking what they use by pointer (no capturing
// lambda coroutines).
asio::awaitable<void> await_stream(cudaStream_t s, notify_by how, outcome* out) {
  try {
    co_await when_done(s, how);
    out->stream_idle_on_resume = cudaStreamQuery(s) == cudaSuccess;
  } catch (const cuda_error& e) {
    out->error = e.what();
    out->status = e.status();
  }
  out->resumed = true;
  out->resumed_on = std::this_thread::get_id();
}

void CUDART_CB note_thread(void* user) {
  *static_cast<std::atomic<std::thread::id>*>(user) = std::this_thread::get_id();
}

class AwaitGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const device_count_result devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  }
};

void expect_resumed_on_io_thread(notify_by how) {
  asio::io_context ctx;
  stream s;
  std::atomic<std::thread::id> callback_thread{};
  testing::spin(spin_ns, s.get());
  // A host function of our own, right before the bridge's: CUDA runs both on its
  // callback thread, which we compare with the io thread.
  REFIT_CUDA_CHECK(cudaLaunchHostFunc(s.get(), &note_thread, &callback_thread));
  outcome out;
  asio::co_spawn(ctx, await_stream(s.get(), how, &out), asio::detached);

  std::thread::id io_thread;
  std::thread io([&] {
    io_thread = std::this_thread::get_id();
    ctx.run();  // returns only once the wait completed: its work guard keeps it
  });
  io.join();

  ASSERT_TRUE(out.resumed) << "run() returned before the GPU work completed";
  EXPECT_EQ(out.error, "");
  EXPECT_TRUE(out.stream_idle_on_resume);
  EXPECT_EQ(out.resumed_on, io_thread);
  EXPECT_NE(callback_thread.load(), std::thread::id{});
  EXPECT_NE(callback_thread.load(), io_thread);
}

TEST_F(AwaitGpu, StreamCallbackResumesOnTheIoThreadAfterTheKernel) {
  expect_resumed_on_io_thread(notify_by::stream_callback);
}

TEST_F(AwaitGpu, HostFuncResumesOnTheIoThreadAfterTheKernel) { expect_resumed_on_io_thread(notify_by::host_func); }

asio::awaitable<void> await_recorded_then_read(cudaStream_t comm, cudaStream_t process, const event* received,
                                               const device_buffer* data, pinned_buffer* host, int* stage) {
  co_await when_recorded(*received, comm);
  *stage = 1;
  // The processing stream is gated on the same event; its copy sees the data.
  REFIT_CUDA_CHECK(cudaStreamWaitEvent(process, received->get(), 0));
  REFIT_CUDA_CHECK(cudaMemcpyAsync(host->data(), data->data(), data->size(), cudaMemcpyDeviceToHost, process));
  co_await when_done(process);
  *stage = 2;
}

TEST_F(AwaitGpu, WhenRecordedCompletesAfterTheRecordedWorkAndGatesAnotherStream) {
  asio::io_context ctx;
  stream comm, process;
  event received;
  device_buffer data(1 << 20);
  pinned_buffer host(data.size());
  testing::spin(spin_ns, comm.get());
  fill_bytes(data.data(), 0x5A, data.size(), comm.get());
  int stage = 0;
  asio::co_spawn(ctx, await_recorded_then_read(comm.get(), process.get(), &received, &data, &host, &stage),
                 asio::detached);
  ctx.run();
  ASSERT_EQ(stage, 2);
  std::size_t wrong = 0;
  for (std::byte b : host.span()) wrong += b != std::byte{0x5A};
  EXPECT_EQ(wrong, 0u);
}

asio::awaitable<void> await_event(cudaEvent_t e, cudaStream_t waiter, cudaStream_t producer, bool* producer_done) {
  co_await async_wait_event(e, waiter);
  *producer_done = cudaStreamQuery(producer) == cudaSuccess;
}

TEST_F(AwaitGpu, AsyncWaitEventWaitsForAnEventRecordedOnAnotherStream) {
  asio::io_context ctx;
  stream producer, waiter;
  event e;
  testing::spin(spin_ns, producer.get());
  e.record(producer);
  bool producer_done = false;
  asio::co_spawn(ctx, await_event(e.get(), waiter.get(), producer.get(), &producer_done), asio::detached);
  ctx.run();
  EXPECT_TRUE(producer_done);
}

asio::awaitable<void> await_many(cudaStream_t s, int* completed, std::thread::id io, int* off_thread) {
  co_await when_done(s);
  ++*completed;  // single io thread: no race
  if (std::this_thread::get_id() != io) ++*off_thread;
}

TEST_F(AwaitGpu, ManyConcurrentWaitsOnSeveralStreamsAllComplete) {
  asio::io_context ctx;
  std::vector<stream> streams(4);
  int completed = 0, off_thread = 0;
  for (int round = 0; round < 50; ++round) {
    for (stream& s : streams) {
      testing::spin(100'000, s.get());
      asio::co_spawn(ctx, await_many(s.get(), &completed, std::this_thread::get_id(), &off_thread), asio::detached);
    }
  }
  ctx.run();  // on this thread
  EXPECT_EQ(completed, 200);
  EXPECT_EQ(off_thread, 0);
}

TEST_F(AwaitGpu, CallbackTokenRunsOnTheBoundExecutor) {
  asio::io_context ctx;
  stream s;
  testing::spin(spin_ns, s.get());
  bool called = false;
  std::exception_ptr error;
  std::thread::id called_on;
  async_wait_stream(s.get(), asio::bind_executor(ctx, [&](std::exception_ptr e) {
                      called = true;
                      error = e;
                      called_on = std::this_thread::get_id();
                    }));
  EXPECT_FALSE(called);  // never inline
  ctx.run();
  EXPECT_TRUE(called);
  EXPECT_EQ(error, nullptr);
  EXPECT_EQ(called_on, std::this_thread::get_id());
}

struct frame_probe {
  bool* resumed;
  std::thread::id* destroyed_on;
  ~frame_probe() { *destroyed_on = std::this_thread::get_id(); }
};

asio::awaitable<void> await_and_probe(cudaStream_t s, bool* resumed, std::thread::id* destroyed_on) {
  frame_probe probe{resumed, destroyed_on};
  co_await when_done(s);
  *resumed = true;
}

TEST_F(AwaitGpu, DestroyingTheContextWithAWaitPendingDestroysTheCoroutineThere) {
  stream s;
  bool resumed = false;
  std::thread::id destroyed_on;
  {
    auto ctx = std::make_unique<asio::io_context>();
    testing::spin(spin_ns, s.get());
    asio::co_spawn(*ctx, await_and_probe(s.get(), &resumed, &destroyed_on), asio::detached);
    ctx->poll();                   // starts the coroutine, which suspends on the wait
    ASSERT_FALSE(ctx->stopped());  // the pending wait is outstanding work
    ctx->stop();
  }  // ~io_context: the pending wait's handler (the coroutine) is destroyed here
  EXPECT_FALSE(resumed);
  EXPECT_EQ(destroyed_on, std::this_thread::get_id());
  // The callback still arrives, finds the wait abandoned, and does nothing.
  s.synchronize();
  EXPECT_FALSE(resumed);
}

// A device fault corrupts the whole CUDA context, so this runs in a child process
// (gtest's "threadsafe" death tests re-execute the binary for it); the child exits
// with 0 only if the wait completed with the fault as a cuda_error on the io thread.
//
// The wait must be registered before the fault happens: were the fault first,
// enqueueing the callback would itself fail (a sticky error) and the message would
// name cudaStreamAddCallback instead of the faulting work. So the faulting kernel
// is held behind a kernel that waits for a host flag, set only once the wait is
// registered (the coroutine has run up to its suspension).
void fault_child() {
  asio::io_context ctx;
  stream s;
  int* flag = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped) != cudaSuccess) std::_Exit(3);
  *flag = 0;
  int* device_flag = nullptr;
  if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), flag, 0) != cudaSuccess) std::_Exit(4);
  testing::wait_flag(device_flag, 10'000'000'000ull, s.get());
  testing::fault(s.get());
  outcome out;
  asio::co_spawn(ctx, await_stream(s.get(), notify_by::stream_callback, &out), asio::detached);
  ctx.poll();                      // runs the coroutine to its co_await: the callback is enqueued behind the fault
  if (out.resumed) std::_Exit(5);  // completed before the fault could even happen
  __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
  // Bounded: were CUDA not to call the callback after the fault, the child reports
  // that instead of hanging until the test's timeout.
  ctx.run_for(std::chrono::seconds(20));
  std::fprintf(stderr, "resumed=%d status=%s error=%s\n", out.resumed, cudaGetErrorName(out.status), out.error.c_str());
  const bool ok = out.resumed && out.status != cudaSuccess && out.resumed_on == std::this_thread::get_id() &&
                  out.error.find("the work queued on the stream before the wait failed at") != std::string::npos &&
                  out.error.find("await_gpu_test.cc") != std::string::npos;
  std::_Exit(ok ? 0 : 1);  // no static destructors in a faulted context
}

TEST_F(AwaitGpu, ADeviceFaultCompletesTheWaitWithCudaError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fault_child(), ::testing::ExitedWithCode(0), "status=cuda");
}

}  // namespace
}  // namespace refit::cuda
