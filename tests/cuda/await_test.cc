// Runs with or without a GPU. Without one, enqueueing the completion callback fails
// (no driver): the wait must still complete, through the executor, with a cuda_error
// naming the call; with one, the same waits on the legacy default stream succeed.
// The GPU-only behaviour is in await_gpu_test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <thread>

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <refit/cuda/await.h>
#include <refit/cuda/device.h>
#include <refit/cuda/error.h>

namespace refit::cuda {
namespace {

using ::testing::HasSubstr;

struct outcome {
  bool resumed = false;
  bool threw = false;
  cudaError_t status = cudaSuccess;
  std::string what;
  std::string call;
  std::thread::id resumed_on;
};

asio::awaitable<void> wait_default_stream(notify_by how, outcome* out) {
  try {
    co_await when_done(nullptr, how);
  } catch (const cuda_error& e) {
    out->threw = true;
    out->status = e.status();
    out->what = e.what();
    out->call = e.call();
  }
  out->resumed = true;
  out->resumed_on = std::this_thread::get_id();
}

void check(notify_by how, const char* expected_call) {
  const device_count_result devices = device_count_or_reason();
  asio::io_context ctx;
  outcome out;
  asio::co_spawn(ctx, wait_default_stream(how, &out), asio::detached);
  ctx.run();
  ASSERT_TRUE(out.resumed);
  EXPECT_EQ(out.resumed_on, std::this_thread::get_id());
  if (devices) {
    EXPECT_FALSE(out.threw) << out.what;
    return;
  }
  // e.g. "cudaStreamAddCallback(stream, callback, wait, 0) failed at
  // tests/cuda/await_test.cc:37 (cudaErrorInsufficientDriver): CUDA driver version is
  // insufficient for CUDA runtime version"
  ASSERT_TRUE(out.threw) << "no device (" << devices.reason << ") yet the wait succeeded";
  EXPECT_NE(out.status, cudaSuccess);
  EXPECT_THAT(out.call, HasSubstr(expected_call));
  EXPECT_THAT(out.what, HasSubstr(std::string(expected_call)));
  EXPECT_THAT(out.what, HasSubstr("tests/cuda/await_test.cc:"));  // the co_await's line
  EXPECT_THAT(out.what, HasSubstr(cudaGetErrorName(out.status)));
}

TEST(Await, StreamCallbackWaitCompletesOnTheExecutor) { check(notify_by::stream_callback, "cudaStreamAddCallback("); }

TEST(Await, HostFuncWaitCompletesOnTheExecutor) { check(notify_by::host_func, "cudaLaunchHostFunc("); }

TEST(Await, CompletionIsPostedNeverInvokedInline) {
  const device_count_result devices = device_count_or_reason();
  asio::io_context ctx;
  int calls = 0;
  std::exception_ptr error;
  async_wait_stream(nullptr, asio::bind_executor(ctx, [&](std::exception_ptr e) {
                      ++calls;
                      error = e;
                    }));
  EXPECT_EQ(calls, 0);  // even when enqueueing failed synchronously
  ctx.run();
  EXPECT_EQ(calls, 1);
  if (devices) {
    EXPECT_EQ(error, nullptr);
  } else {
    ASSERT_NE(error, nullptr);
    EXPECT_THROW(std::rethrow_exception(error), cuda_error);
  }
}

TEST(Await, EachContextCompletesItsOwnWaits) {
  asio::io_context a, b;
  outcome in_a, in_b;
  asio::co_spawn(a, wait_default_stream(notify_by::stream_callback, &in_a), asio::detached);
  asio::co_spawn(b, wait_default_stream(notify_by::stream_callback, &in_b), asio::detached);
  a.run();
  EXPECT_TRUE(in_a.resumed);
  EXPECT_FALSE(in_b.resumed);  // b's wait is delivered to b only
  b.run();
  EXPECT_TRUE(in_b.resumed);
}

}  // namespace
}  // namespace refit::cuda
