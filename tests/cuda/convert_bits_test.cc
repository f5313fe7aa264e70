// Runs without a GPU: the kernels' scalar bit code (lib/cuda/convert_bits.h),
// compiled for the host, against the CPU reference refit::convert, bit for bit: every
// 8- and 16-bit pattern, a float sample dense at every rounding boundary, and every
// supported conversion with several scales. The device build of the same code is
// checked on a GPU by convert_kernels_test.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

#include <refit/cuda/convert_bits.h>
#include "tests/cuda/convert_samples.h"
#include "tests/support/convert.h"

namespace refit::cuda {
namespace {

using testing::conversion;

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }

TEST(ConvertBits, Widening16BitPatternsMatchTheReference) {
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    ASSERT_EQ(bits_of(bits::bf16_to_float(h)), bits_of(convert::bf16_to_float(h))) << h;
    ASSERT_EQ(bits_of(bits::fp16_to_float(h)), bits_of(convert::fp16_to_float(h))) << h;
  }
}

TEST(ConvertBits, WideningFp8PatternsMatchTheReference) {
  for (std::uint32_t i = 0; i < 256; ++i) {
    const auto q = static_cast<std::uint8_t>(i);
    ASSERT_EQ(bits_of(bits::fp8_e4m3fn_to_float(q)), bits_of(convert::fp8_e4m3fn_to_float(q))) << i;
    ASSERT_EQ(bits_of(bits::fp8_e5m2_to_float(q)), bits_of(convert::fp8_e5m2_to_float(q))) << i;
  }
}

TEST(ConvertBits, NarrowingTheFloatSampleMatchesTheReference) {
  std::size_t checked = 0;
  for (std::uint32_t u : testing::float_sample_bits()) {
    const float f = std::bit_cast<float>(u);
    ASSERT_EQ(bits::float_to_bf16(f), convert::float_to_bf16(f)) << std::hex << u;
    ASSERT_EQ(bits::float_to_fp16(f), convert::float_to_fp16(f)) << std::hex << u;
    ASSERT_EQ(bits::float_to_fp8_e4m3fn(f), convert::float_to_fp8_e4m3fn(f)) << std::hex << u;
    ASSERT_EQ(bits::float_to_fp8_e5m2(f), convert::float_to_fp8_e5m2(f)) << std::hex << u;
    ++checked;
  }
  EXPECT_GT(checked, 2'000'000u);
}

TEST(ConvertBits, CanonicalNaNsAndSaturationAsTheHeaderSays) {
  const float nan = std::bit_cast<float>(0x7fa00001u), neg_nan = std::bit_cast<float>(0xffa00001u);
  EXPECT_EQ(bits::float_to_bf16(nan), 0x7fc0);
  EXPECT_EQ(bits::float_to_bf16(neg_nan), 0xffc0);
  EXPECT_EQ(bits::float_to_fp16(nan), 0x7e00);
  EXPECT_EQ(bits::float_to_fp16(neg_nan), 0xfe00);
  EXPECT_EQ(bits::float_to_fp8_e4m3fn(nan), 0x7f);
  EXPECT_EQ(bits::float_to_fp8_e4m3fn(neg_nan), 0xff);
  EXPECT_EQ(bits::float_to_fp8_e5m2(nan), 0x7e);
  EXPECT_EQ(bits::float_to_fp8_e5m2(neg_nan), 0xfe);
  const float inf = std::bit_cast<float>(0x7f800000u);
  EXPECT_EQ(bits::float_to_fp8_e4m3fn(inf), 0x7e);     // 448
  EXPECT_EQ(bits::float_to_fp8_e4m3fn(-inf), 0xfe);    // -448
  EXPECT_EQ(bits::float_to_fp8_e5m2(inf), 0x7b);       // 57344
  EXPECT_EQ(bits::float_to_fp8_e4m3fn(464.0f), 0x7e);  // a tie rounds to even: 448
  EXPECT_EQ(bits::float_to_fp16(65520.0f), 0x7c00);    // fp16 overflow: infinity
}

// What the kernel does per element, on the host.
template <dtype S, dtype D>
void emulate(const conversion& c, const std::byte* in, std::byte* out, std::size_t n) {
  using in_t = typename bits::codec<S>::bits_type;
  using out_t = typename bits::codec<D>::bits_type;
  for (std::size_t i = 0; i < n; ++i) {
    in_t x;
    std::memcpy(&x, in + i * sizeof x, sizeof x);
    out_t y;
    if (S == D)
      y = static_cast<out_t>(x);  // a copy
    else if (c.quantize)
      y = bits::quantize_one<S, D>(x, c.scale);
    else if (c.src == dtype::float8_e4m3fn || c.src == dtype::float8_e5m2)
      y = bits::dequantize_one<S, D>(x, c.scale);
    else
      y = bits::convert_one<S, D>(x);
    std::memcpy(out + i * sizeof y, &y, sizeof y);
  }
}

template <dtype S>
void emulate_from(const conversion& c, const std::byte* in, std::byte* out, std::size_t n) {
  switch (c.dst) {
    case dtype::float32:
      return emulate<S, dtype::float32>(c, in, out, n);
    case dtype::bfloat16:
      return emulate<S, dtype::bfloat16>(c, in, out, n);
    case dtype::float16:
      return emulate<S, dtype::float16>(c, in, out, n);
    case dtype::float8_e4m3fn:
      return emulate<S, dtype::float8_e4m3fn>(c, in, out, n);
    default:
      return emulate<S, dtype::float8_e5m2>(c, in, out, n);
  }
}

std::vector<std::byte> emulated_output(const conversion& c, const std::vector<std::byte>& in) {
  const std::size_t n = in.size() / element_size(c.src);
  std::vector<std::byte> out(n * element_size(c.dst));
  switch (c.src) {
    case dtype::float32:
      emulate_from<dtype::float32>(c, in.data(), out.data(), n);
      break;
    case dtype::bfloat16:
      emulate_from<dtype::bfloat16>(c, in.data(), out.data(), n);
      break;
    case dtype::float16:
      emulate_from<dtype::float16>(c, in.data(), out.data(), n);
      break;
    case dtype::float8_e4m3fn:
      emulate_from<dtype::float8_e4m3fn>(c, in.data(), out.data(), n);
      break;
    default:
      emulate_from<dtype::float8_e5m2>(c, in.data(), out.data(), n);
      break;
  }
  return out;
}

TEST(ConvertBits, EveryConversionAndScaleMatchesTheReference) {
  std::size_t cases = 0;
  for (const conversion& c : testing::all_conversions()) {
    SCOPED_TRACE(c.name());
    std::vector<std::byte> in = testing::input_bytes(c.src);
    const std::vector<std::byte> expected = testing::reference_output(c, in);
    const std::vector<std::byte> got = emulated_output(c, in);
    const std::ptrdiff_t i = testing::first_difference(c.dst, expected, got);
    ASSERT_EQ(i, -1) << "input " << testing::element_hex(c.src, in, i) << ": reference "
                     << testing::element_hex(c.dst, expected, i) << ", bit code "
                     << testing::element_hex(c.dst, got, i);
    ++cases;
  }
  EXPECT_EQ(cases, 9u + 2 * 3 * testing::dequantize_scales().size() + 3 * 2 * testing::quantize_scales().size());
}

// The device reproduces the host's NaN propagation explicitly (mul_like_host);
// check the assumption about the host itself: a NaN times a finite scale is that
// NaN, quietened.
TEST(ConvertBits, HostArithmeticPropagatesTheQuietenedNaN) {
  volatile float scale = 0.37f;
  for (std::uint32_t u : {0x7fa00000u, 0xffa00000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u}) {
    volatile float x = std::bit_cast<float>(u);
    EXPECT_EQ(bits_of(x * scale), u | 0x00400000u) << std::hex << u;
    EXPECT_EQ(bits_of(x / scale), u | 0x00400000u) << std::hex << u;
    EXPECT_EQ(bits_of(bits::mul_like_host(x, scale)), u | 0x00400000u);
    EXPECT_EQ(bits_of(bits::div_like_host(x, scale)), u | 0x00400000u);
  }
}

}  // namespace
}  // namespace refit::cuda
