// Needs a GPU; skips itself, with the reason, where there is none.
// stream, event, device_buffer and pinned_buffer: ownership, moves, and the CUDA
// behaviour each wrapper promises.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

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

constexpr std::uint64_t spin_ns = 20'000'000;  // 20 ms of GPU time

class Raii : public ::testing::Test {
 protected:
  void SetUp() override {
    const device_count_result devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  }
};

TEST_F(Raii, StreamIsNonBlockingOnTheCurrentDeviceAndMovable) {
  stream s;
  ASSERT_NE(s.get(), nullptr);
  int current = -1;
  REFIT_CUDA_CHECK(cudaGetDevice(&current));
  EXPECT_EQ(s.device(), current);
  unsigned flags = 0;
  REFIT_CUDA_CHECK(cudaStreamGetFlags(s.get(), &flags));
  EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);
  EXPECT_TRUE(s.query());  // nothing queued

  const cudaStream_t handle = s.get();
  stream moved(std::move(s));
  EXPECT_EQ(moved.get(), handle);
  EXPECT_EQ(s.get(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state
  stream assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.get(), handle);
  EXPECT_EQ(moved.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  assigned.synchronize();
}

TEST_F(Raii, StreamPriorityIsTheOneInEffect) {
  const stream::priorities range = stream::priority_range();
  EXPECT_LE(range.greatest, range.least);  // numerically lower is more urgent
  stream urgent(range.greatest);
  EXPECT_EQ(urgent.priority(), range.greatest);
  int actual = 0;
  REFIT_CUDA_CHECK(cudaStreamGetPriority(urgent.get(), &actual));
  EXPECT_EQ(actual, range.greatest);
  // Out of range is clamped by CUDA; the object reports the clamped value.
  stream clamped(range.greatest - 100);
  EXPECT_EQ(clamped.priority(), range.greatest);
}

TEST_F(Raii, QueryIsFalseWhileWorkRunsAndTrueAfterSynchronize) {
  stream s;
  event e;
  testing::spin(spin_ns, s.get());
  e.record(s);
  EXPECT_FALSE(s.query());
  EXPECT_FALSE(e.query());
  e.synchronize();
  EXPECT_TRUE(e.query());
  EXPECT_TRUE(s.query());
}

TEST_F(Raii, EventsDisableTimingByDefault) {
  stream s;
  event a, b;
  a.record(s);
  b.record(s);
  s.synchronize();
  try {
    (void)event::elapsed_ms(a, b);
    FAIL() << "elapsed_ms on events without timing did not throw";
  } catch (const cuda_error& error) {
    EXPECT_THAT(error.call(), HasSubstr("cudaEventElapsedTime"));
  }

  event start = event::timing(), end = event::timing();
  start.record(s);
  testing::spin(1'000'000, s.get());
  end.record(s);
  end.synchronize();
  EXPECT_GE(event::elapsed_ms(start, end), 0.5f);
}

TEST_F(Raii, EventMoveTransfersTheHandle) {
  event a;
  const cudaEvent_t handle = a.get();
  event b(std::move(a));
  EXPECT_EQ(b.get(), handle);
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  event c;
  c = std::move(b);
  EXPECT_EQ(c.get(), handle);
}

TEST_F(Raii, StreamWaitOrdersAnotherStreamAfterTheEvent) {
  stream producer, consumer;
  device_buffer buffer(1 << 20);
  pinned_buffer host(1 << 20);
  std::memset(host.data(), 0, host.size());
  event filled;
  // The fill runs only after 20 ms; the consumer's copy must still see it.
  testing::spin(spin_ns, producer.get());
  fill_bytes(buffer.data(), 0xAB, buffer.size(), producer.get());
  filled.record(producer);
  consumer.wait(filled);
  REFIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), buffer.data(), buffer.size(), cudaMemcpyDeviceToHost, consumer.get()));
  consumer.synchronize();
  std::size_t wrong = 0;
  for (std::byte b : host.span()) wrong += b != std::byte{0xAB};
  EXPECT_EQ(wrong, 0u);
}

TEST_F(Raii, DeviceBufferOwnsItsMemory) {
  device_buffer b(4096 + 3);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), 4096u + 3);
  int current = -1;
  REFIT_CUDA_CHECK(cudaGetDevice(&current));
  EXPECT_EQ(b.device(), current);
  cudaPointerAttributes attributes{};
  REFIT_CUDA_CHECK(cudaPointerGetAttributes(&attributes, b.data()));
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, current);

  void* p = b.data();
  device_buffer moved(std::move(b));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.size(), 0u);       // NOLINT(bugprone-use-after-move)
  device_buffer other(16);
  other = std::move(moved);  // frees other's 16 bytes
  EXPECT_EQ(other.data(), p);

  const device_buffer on_device(64, current);
  EXPECT_EQ(on_device.device(), current);
  EXPECT_EQ(device_buffer(0).data(), nullptr);
}

TEST_F(Raii, DeviceBufferAllocationFailureNamesCudaMalloc) {
  try {
    device_buffer huge(std::size_t{1} << 60);
    FAIL() << "a 2^60-byte allocation succeeded";
  } catch (const cuda_error& error) {
    EXPECT_EQ(error.status(), cudaErrorMemoryAllocation);
    EXPECT_THAT(error.what(), HasSubstr("cudaMalloc("));
  }
  // The failure is not sticky: the next allocation works.
  EXPECT_NE(device_buffer(64).data(), nullptr);
}

TEST_F(Raii, PinnedBufferIsPageLockedAndRoundTrips) {
  pinned_buffer host(1000);
  ASSERT_NE(host.data(), nullptr);
  EXPECT_EQ(host.size(), 1000u);
  EXPECT_EQ(host.span().size(), 1000u);
  cudaPointerAttributes attributes{};
  REFIT_CUDA_CHECK(cudaPointerGetAttributes(&attributes, host.data()));
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);

  for (std::size_t i = 0; i < host.size(); ++i) host.bytes()[i] = std::byte(i * 7);
  stream s;
  device_buffer device(host.size());
  pinned_buffer back(host.size());
  REFIT_CUDA_CHECK(cudaMemcpyAsync(device.data(), host.data(), host.size(), cudaMemcpyHostToDevice, s.get()));
  REFIT_CUDA_CHECK(cudaMemcpyAsync(back.data(), device.data(), host.size(), cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.size()), 0);

  void* p = host.data();
  pinned_buffer moved(std::move(host));
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(host.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(pinned_buffer(0).data(), nullptr);
}

}  // namespace
}  // namespace refit::cuda
