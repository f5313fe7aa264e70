// Needs a GPU; skips itself, with the reason, where there is none.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/fill.h>

namespace refit::cuda {
namespace {

class FillBytes : public ::testing::Test {
 protected:
  void SetUp() override {
    const device_count_result devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
    REFIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }

  void TearDown() override {
    if (device_) (void)cudaFree(device_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }

  // Device buffer of `size` zero bytes.
  std::uint8_t* zeroed(std::size_t size) {
    REFIT_CUDA_CHECK(cudaMalloc(&device_, size));
    REFIT_CUDA_CHECK(cudaMemsetAsync(device_, 0, size, stream_));
    return static_cast<std::uint8_t*>(device_);
  }

  std::vector<std::uint8_t> read(std::size_t size) {
    std::vector<std::uint8_t> host(size, 0x55);
    REFIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), device_, size, cudaMemcpyDeviceToHost, stream_));
    REFIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return host;
  }

  cudaStream_t stream_ = nullptr;
  void* device_ = nullptr;
};

TEST_F(FillBytes, FillsExactlyTheRangeAcrossManyBlocks) {
  // Odd size and offset, and more bytes than one grid pass covers.
  constexpr std::size_t size = (std::size_t{4096} * 256 * 3) + 13;
  std::uint8_t* buffer = zeroed(size);
  fill_bytes(buffer + 1, 0xAB, size - 2, stream_);
  const std::vector<std::uint8_t> host = read(size);

  EXPECT_EQ(host.front(), 0x00);
  EXPECT_EQ(host.back(), 0x00);
  std::size_t wrong = 0;
  for (std::size_t i = 1; i + 1 < size; ++i) wrong += host[i] != 0xAB;
  EXPECT_EQ(wrong, 0u);
}

TEST_F(FillBytes, ZeroSizeWritesNothing) {
  std::uint8_t* buffer = zeroed(64);
  fill_bytes(buffer, 0xFF, 0, stream_);
  for (std::uint8_t b : read(64)) ASSERT_EQ(b, 0x00);
}

}  // namespace
}  // namespace refit::cuda
