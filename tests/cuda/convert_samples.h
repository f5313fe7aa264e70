// Inputs for checking conversions against refit::convert: every pattern of the
// narrow types, a float sample dense at every rounding boundary, and scales that
// reach subnormal, saturating and overflowing results.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <refit/dtype.h>
#include <refit/tensor.h>
#include "tests/support/convert.h"

namespace refit::cuda::testing {

inline std::vector<std::uint16_t> all_16_bit_patterns() {
  std::vector<std::uint16_t> v(65536);
  for (std::uint32_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint16_t>(i);
  return v;
}

inline std::vector<std::uint8_t> all_8_bit_patterns() {
  std::vector<std::uint8_t> v(256);
  for (std::uint32_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>(i);
  return v;
}

/// Float bit patterns: for every upper half h (all bf16 values, so every exponent,
/// sign, NaN and infinity), lower halves at and around the rounding boundaries of
/// bf16 (0x8000), fp16 (multiples of 0x1000 for the 13 dropped bits) and fp8 (the
/// upper half covers them; 0 and 0xffff are the neighbours); plus `random` uniformly
/// random patterns (fixed seed).
inline std::vector<std::uint32_t> float_sample_bits(std::size_t random = 1u << 20) {
  static constexpr std::uint16_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000, 0x3000, 0x5000,
                                           0x7fff, 0x8000, 0x8001, 0x9000, 0xb000, 0xd000, 0xf000, 0xffff};
  std::vector<std::uint32_t> v;
  v.reserve(65536 * std::size(lows) + random);
  for (std::uint32_t h = 0; h < 65536; ++h)
    for (std::uint16_t low : lows) v.push_back(h << 16 | low);
  std::mt19937 rng(20240611);
  for (std::size_t i = 0; i < random; ++i) v.push_back(static_cast<std::uint32_t>(rng()));
  return v;
}

inline std::vector<float> as_floats(const std::vector<std::uint32_t>& bits) {
  std::vector<float> v(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) v[i] = std::bit_cast<float>(bits[i]);
  return v;
}

/// Dequantisation scales: exact, inexact, tiny (subnormal and zero results), huge
/// (overflow to infinity in bf16/fp16/float).
inline std::vector<float> dequantize_scales() { return {1.0f, 0.5f, 0.37f, 3.0f, 1e-38f, 1e-44f, 1e30f, 1e36f}; }

/// Quantisation scales: exact, inexact, tiny (everything saturates), huge (most
/// values flush to zero or fp8 subnormals), the smallest subnormal.
inline std::vector<float> quantize_scales() {
  return {1.0f, 0.25f, 0.37f, 7.5f, 1e-30f, 1e30f, std::bit_cast<float>(1u)};
}

/// One conversion to check: convert_tensor (dequantising for fp8 sources) or
/// quantize_fp8.
struct conversion {
  dtype src;
  dtype dst;
  bool quantize = false;
  float scale = 1.0f;

  std::string name() const {
    char scale_text[32];
    std::snprintf(scale_text, sizeof scale_text, "%.9g", static_cast<double>(scale));
    return std::string(quantize ? "quantize_fp8 " : "convert ") + std::string(to_string(src)) + " -> " +
           std::string(to_string(dst)) + " scale " + scale_text;
  }
};

/// Every supported pair and, for fp8, every scale above.
inline std::vector<conversion> all_conversions() {
  const dtype wide[] = {dtype::float32, dtype::bfloat16, dtype::float16};
  const dtype fp8[] = {dtype::float8_e4m3fn, dtype::float8_e5m2};
  std::vector<conversion> v;
  for (dtype s : wide)
    for (dtype d : wide) v.push_back({s, d});
  for (dtype s : fp8)
    for (dtype d : wide)
      for (float scale : dequantize_scales()) v.push_back({s, d, false, scale});
  for (dtype s : wide)
    for (dtype d : fp8)
      for (float scale : quantize_scales()) v.push_back({s, d, true, scale});
  return v;
}

/// The input bytes for a source type: every pattern of the 8- and 16-bit types, the
/// float sample for float32.
inline std::vector<std::byte> input_bytes(dtype t) {
  std::vector<std::byte> bytes;
  auto copy = [&](const auto& v) {
    bytes.resize(v.size() * sizeof(v[0]));
    std::memcpy(bytes.data(), v.data(), bytes.size());
  };
  if (t == dtype::float32)
    copy(float_sample_bits());
  else if (element_size(t) == 2)
    copy(all_16_bit_patterns());
  else
    copy(all_8_bit_patterns());
  return bytes;
}

/// refit::convert's output for `c` applied to `input`.
inline std::vector<std::byte> reference_output(const conversion& c, std::vector<std::byte>& input) {
  const std::size_t n = input.size() / element_size(c.src);
  const std::int64_t shape[] = {static_cast<std::int64_t>(n)};
  std::vector<std::byte> out(n * element_size(c.dst), std::byte{0xCD});
  const tensor_view src("input", c.src, shape, input.data());
  const tensor_view dst("output", c.dst, shape, out.data());
  if (c.quantize)
    convert::quantize_fp8(src, dst, c.scale);
  else
    convert::convert_tensor(src, dst, c.scale);
  return out;
}

/// Index of the first differing element of two outputs of `t`, or -1.
inline std::ptrdiff_t first_difference(dtype t, const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  if (a.size() != b.size()) return 0;
  const std::size_t size = element_size(t);
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return -1;
  for (std::size_t i = 0; i < a.size() / size; ++i)
    if (std::memcmp(a.data() + i * size, b.data() + i * size, size) != 0) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

/// "0x7fc0" for element i of `bytes` as type t.
inline std::string element_hex(dtype t, const std::vector<std::byte>& bytes, std::size_t i) {
  std::uint32_t v = 0;
  std::memcpy(&v, bytes.data() + i * element_size(t), element_size(t));  // little endian
  char text[16];
  std::snprintf(text, sizeof text, "0x%0*x", static_cast<int>(2 * element_size(t)), v);
  return text;
}

}  // namespace refit::cuda::testing
