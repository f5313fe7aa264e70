// Needs a GPU; skips itself, with the reason, where there is none.
// The conversion kernels against the CPU reference (//tests/support:convert), bit for bit:
// every bf16/fp16 pattern, every fp8 pattern, a float sample dense at every
// rounding boundary, for every supported pair and several fp8 scales; through the
// vectorised path, its tail, and the unaligned (scalar) path.
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include "tests/cuda/convert_samples.h"
#include "tests/support/convert.h"

namespace refit::cuda {
namespace {

using testing::conversion;

class ConvertKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    const device_count_result devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  }

  // Runs the kernel for `c` over elements [first, first + count) of `in`, writing
  // output elements [first, first + count) (so an odd `first` misaligns both).
  std::vector<std::byte> run(const conversion& c, const std::vector<std::byte>& in, std::size_t first,
                             std::size_t count) {
    const std::size_t s_size = element_size(c.src), d_size = element_size(c.dst);
    const std::size_t n = in.size() / s_size;
    stream s;
    device_buffer src(in.size()), dst(n * d_size);
    REFIT_CUDA_CHECK(cudaMemcpyAsync(src.data(), in.data(), in.size(), cudaMemcpyHostToDevice, s.get()));
    REFIT_CUDA_CHECK(cudaMemsetAsync(dst.data(), 0xCD, dst.size(), s.get()));
    const std::byte* src_at = src.bytes() + first * s_size;
    std::byte* dst_at = dst.bytes() + first * d_size;
    if (c.quantize)
      quantize_fp8(src_at, c.src, dst_at, c.dst, count, c.scale, s.get());
    else
      convert(src_at, c.src, dst_at, c.dst, count, s.get(), c.scale);
    std::vector<std::byte> out(dst.size());
    REFIT_CUDA_CHECK(cudaMemcpyAsync(out.data(), dst.data(), out.size(), cudaMemcpyDeviceToHost, s.get()));
    s.synchronize();
    return out;
  }
};

void expect_same(const conversion& c, const std::vector<std::byte>& in, const std::vector<std::byte>& expected,
                 const std::vector<std::byte>& got, const char* path) {
  const std::ptrdiff_t i = testing::first_difference(c.dst, expected, got);
  EXPECT_EQ(i, -1) << c.name() << " (" << path << "): element " << i << ", input " << testing::element_hex(c.src, in, i)
                   << ": reference " << testing::element_hex(c.dst, expected, i) << ", GPU "
                   << testing::element_hex(c.dst, got, i);
}

TEST_F(ConvertKernels, EveryConversionMatchesTheReferenceBitForBit) {
  for (const conversion& c : testing::all_conversions()) {
    std::vector<std::byte> in = testing::input_bytes(c.src);
    const std::size_t n = in.size() / element_size(c.src);
    ASSERT_GT(n, 16u);
    const std::vector<std::byte> expected = testing::reference_output(c, in);

    // Vectorised, all elements.
    expect_same(c, in, expected, run(c, in, 0, n), "vectorised");

    // Vectorised with a tail of 5; the bytes past the range stay untouched.
    {
      std::vector<std::byte> partial = expected;
      const std::size_t d_size = element_size(c.dst);
      std::fill(partial.begin() + (n - 11) * d_size, partial.end(), std::byte{0xCD});
      expect_same(c, in, partial, run(c, in, 0, n - 11), "vectorised + tail");
    }

    // Both pointers one element off their vector alignment: the scalar path.
    {
      std::vector<std::byte> partial = expected;
      const std::size_t d_size = element_size(c.dst);
      std::fill(partial.begin(), partial.begin() + d_size, std::byte{0xCD});
      std::fill(partial.end() - 2 * d_size, partial.end(), std::byte{0xCD});
      expect_same(c, in, partial, run(c, in, 1, n - 3), "unaligned");
    }
  }
}

TEST_F(ConvertKernels, ZeroElementsEnqueueNothing) {
  stream s;
  convert(nullptr, dtype::float32, nullptr, dtype::bfloat16, 0, s.get());
  quantize_fp8(nullptr, dtype::float16, nullptr, dtype::float8_e4m3fn, 0, 2.0f, s.get());
  s.synchronize();
}

}  // namespace
}  // namespace refit::cuda
