#include "tests/support/convert.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include <refit/error.h>

namespace refit::convert {
namespace {

constexpr std::uint32_t f32_abs_mask = 0x7fffffffu;
constexpr std::uint32_t f32_inf = 0x7f800000u;

// x >> shift rounded to nearest, ties to even (1 <= shift <= 31). A carry out of the
// mantissa lands in the exponent field, which is what rounding up to the next
// binade (or to infinity) must do.
constexpr std::uint32_t shift_rne(std::uint32_t x, int shift) noexcept {
  const std::uint32_t q = x >> shift;
  const std::uint32_t rem = x & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rem > half) | ((rem == half) & (q & 1u)));
}

// Magnitude bits (exponent << M | mantissa) of the format with M mantissa bits and
// exponent bias B nearest to the finite, non-negative float with bits `abs`; may
// exceed the format's largest finite value (callers clamp). Only for B < 127 - M - 1,
// where every float subnormal is below half the format's smallest subnormal.
template <int M, int B>
constexpr std::uint32_t narrow_magnitude(std::uint32_t abs) noexcept {
  static_assert(B + M + 1 < 127);
  const int e = static_cast<int>(abs >> 23);  // biased float exponent
  if (e - 127 + B >= 1)                       // a normal number of the format
    return shift_rne(abs - (static_cast<std::uint32_t>(127 - B) << 23), 23 - M);
  // Subnormal in the format: units of 2^(1 - B - M); the float is m * 2^(e - 150).
  if (e == 0) return 0;
  const int shift = 151 - B - M - e;
  if (shift > 24) return 0;  // below half the smallest subnormal (m < 2^24)
  return shift_rne((abs & 0x007fffffu) | 0x00800000u, shift);
}

constexpr std::uint32_t sign_of(std::uint32_t bits) noexcept { return bits & 0x80000000u; }

// ---- element loads and stores (memcpy: views into staging memory need not be
// aligned to the element size).

template <class T>
T load(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(std::byte* p, T v) noexcept {
  std::memcpy(p, &v, sizeof v);
}

template <dtype T>
struct codec;
template <>
struct codec<dtype::float32> {
  static float get(const std::byte* p) noexcept { return load<float>(p); }
  static void put(std::byte* p, float v) noexcept { store(p, v); }
};
template <>
struct codec<dtype::bfloat16> {
  static float get(const std::byte* p) noexcept { return bf16_to_float(load<std::uint16_t>(p)); }
  static void put(std::byte* p, float v) noexcept { store(p, float_to_bf16(v)); }
};
template <>
struct codec<dtype::float16> {
  static float get(const std::byte* p) noexcept { return fp16_to_float(load<std::uint16_t>(p)); }
  static void put(std::byte* p, float v) noexcept { store(p, float_to_fp16(v)); }
};
template <>
struct codec<dtype::float8_e4m3fn> {
  static float get(const std::byte* p) noexcept { return fp8_e4m3fn_to_float(load<std::uint8_t>(p)); }
  static void put(std::byte* p, float v) noexcept { store(p, float_to_fp8_e4m3fn(v)); }
};
template <>
struct codec<dtype::float8_e5m2> {
  static float get(const std::byte* p) noexcept { return fp8_e5m2_to_float(load<std::uint8_t>(p)); }
  static void put(std::byte* p, float v) noexcept { store(p, float_to_fp8_e5m2(v)); }
};

bool is_wide_float(dtype t) noexcept { return t == dtype::float32 || t == dtype::bfloat16 || t == dtype::float16; }
bool is_fp8(dtype t) noexcept { return t == dtype::float8_e4m3fn || t == dtype::float8_e5m2; }

// Both loops are the reference, not a hot path: one load, one scalar conversion and
// one store per element, no branches on the dtypes inside.
template <dtype S, dtype D>
void dequantize_loop(const std::byte* src, std::byte* dst, std::size_t n, float scale) {
  const std::size_t s_size = element_size(S), d_size = element_size(D);
  for (std::size_t i = 0; i < n; ++i) codec<D>::put(dst + i * d_size, codec<S>::get(src + i * s_size) * scale);
}

template <dtype S, dtype D>
void convert_loop(const std::byte* src, std::byte* dst, std::size_t n) {
  const std::size_t s_size = element_size(S), d_size = element_size(D);
  for (std::size_t i = 0; i < n; ++i) codec<D>::put(dst + i * d_size, codec<S>::get(src + i * s_size));
}

template <dtype S, dtype D>
void quantize_loop(const std::byte* src, std::byte* dst, std::size_t n, float scale) {
  const std::size_t s_size = element_size(S);
  for (std::size_t i = 0; i < n; ++i) codec<D>::put(dst + i, codec<S>::get(src + i * s_size) / scale);
}

template <dtype S>
void convert_from(dtype d, const std::byte* src, std::byte* dst, std::size_t n, float scale) {
  constexpr bool fp8_src = S == dtype::float8_e4m3fn || S == dtype::float8_e5m2;
  switch (d) {
    case dtype::float32:
      return fp8_src ? dequantize_loop<S, dtype::float32>(src, dst, n, scale)
                     : convert_loop<S, dtype::float32>(src, dst, n);
    case dtype::bfloat16:
      return fp8_src ? dequantize_loop<S, dtype::bfloat16>(src, dst, n, scale)
                     : convert_loop<S, dtype::bfloat16>(src, dst, n);
    case dtype::float16:
      return fp8_src ? dequantize_loop<S, dtype::float16>(src, dst, n, scale)
                     : convert_loop<S, dtype::float16>(src, dst, n);
    default:
      return;  // excluded by can_convert
  }
}

template <dtype S>
void quantize_from(dtype d, const std::byte* src, std::byte* dst, std::size_t n, float scale) {
  if (d == dtype::float8_e4m3fn)
    quantize_loop<S, dtype::float8_e4m3fn>(src, dst, n, scale);
  else
    quantize_loop<S, dtype::float8_e5m2>(src, dst, n, scale);
}

std::string describe(const tensor_view& v) {
  return "'" + std::string(v.name) + "' (" + std::string(to_string(v.dtype)) + " " + shape_to_string(v.shape) + " on " +
         to_string(v.device) + ")";
}

std::string float_text(float f) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
  return buf;
}

// The checks shared by convert_tensor and quantize_fp8; returns the element count.
std::size_t check_pair(const char* op, const tensor_view& src, const tensor_view& dst, bool supported,
                       const char* expected_pairs) {
  const std::string what = std::string(op) + " from " + describe(src) + " to " + describe(dst);
  auto fail = [&](const std::string& why) { throw_error(errc::invalid_argument, what + ": " + why); };
  if (!src.device.is_cpu() || !dst.device.is_cpu())
    fail("both tensors must be in host memory (this is the CPU reference)");
  if (!supported) fail(std::string("unsupported dtype pair; expected ") + expected_pairs);
  std::int64_t n_src = 0, n_dst = 0;
  try {
    n_src = src.numel();
    n_dst = dst.numel();
  } catch (const error& e) {
    fail(e.message());
  }
  if (n_src != n_dst) fail("element counts differ: " + std::to_string(n_src) + " vs " + std::to_string(n_dst));
  if (n_src > 0 && (src.data == nullptr || dst.data == nullptr)) fail("null data pointer");
  const std::uint64_t s_bytes = static_cast<std::uint64_t>(n_src) * element_size(src.dtype);
  const std::uint64_t d_bytes = static_cast<std::uint64_t>(n_dst) * element_size(dst.dtype);
  const auto s0 = reinterpret_cast<std::uintptr_t>(src.data);
  const auto d0 = reinterpret_cast<std::uintptr_t>(dst.data);
  if (n_src > 0 && s0 < d0 + d_bytes && d0 < s0 + s_bytes) fail("the tensors overlap");
  return static_cast<std::size_t>(n_src);
}

void check_quantize_scale(const std::string& what, float scale) {
  if (!(std::isfinite(scale) && scale > 0.0f))
    throw_error(errc::invalid_argument, what + ": the fp8 scale must be finite and > 0, got " + float_text(scale));
}

}  // namespace

// ---- scalar conversions

float bf16_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign16 = sign_of(bits) >> 16;
  if ((bits & f32_abs_mask) > f32_inf) return static_cast<std::uint16_t>(sign16 | 0x7fc0u);
  // Same exponent range as float: every finite float, subnormals included, rounds by
  // dropping 16 mantissa bits; the largest values carry into infinity.
  return static_cast<std::uint16_t>(shift_rne(bits & f32_abs_mask, 16) | sign16);
}

float fp16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  const std::uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f)  // infinity or NaN: exact widening keeps the payload, like bf16
    return std::bit_cast<float>(sign | f32_inf | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal (or zero): mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * 0x1p-24f;
  return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(magnitude));
}

std::uint16_t float_to_fp16(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign16 = sign_of(bits) >> 16;
  const std::uint32_t abs = bits & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint16_t>(sign16 | 0x7e00u);
  std::uint32_t m = narrow_magnitude<10, 15>(abs);
  if (m > 0x7c00u) m = 0x7c00u;  // overflow (and infinity) -> infinity
  return static_cast<std::uint16_t>(sign16 | m);
}

float fp8_e4m3fn_to_float(std::uint8_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x80u) << 24;
  const std::uint32_t exp = (bits >> 3) & 0xfu;
  const std::uint32_t mant = bits & 0x7u;
  if (exp == 0xf && mant == 0x7) return std::bit_cast<float>(sign | 0x7fc00000u);  // the NaN
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 120u) << 23) | (mant << 20));
  const float magnitude = static_cast<float>(mant) * 0x1p-9f;  // subnormal: mant * 2^-9
  return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(magnitude));
}

float fp8_e5m2_to_float(std::uint8_t bits) noexcept {
  // e5m2 is the top byte of an fp16.
  return fp16_to_float(static_cast<std::uint16_t>(bits << 8));
}

std::uint8_t float_to_fp8_e4m3fn(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign8 = sign_of(bits) >> 24;
  const std::uint32_t abs = bits & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint8_t>(sign8 | 0x7fu);
  std::uint32_t m = narrow_magnitude<3, 7>(abs);
  if (m > 0x7eu) m = 0x7eu;  // saturate at 448 (0x7f is the NaN)
  return static_cast<std::uint8_t>(sign8 | m);
}

std::uint8_t float_to_fp8_e5m2(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign8 = sign_of(bits) >> 24;
  const std::uint32_t abs = bits & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint8_t>(sign8 | 0x7eu);
  std::uint32_t m = narrow_magnitude<2, 15>(abs);
  if (m > 0x7bu) m = 0x7bu;  // saturate at 57344, infinities included
  return static_cast<std::uint8_t>(sign8 | m);
}

float fp8_max(dtype t) noexcept {
  switch (t) {
    case dtype::float8_e4m3fn:
      return 448.0f;
    case dtype::float8_e5m2:
      return 57344.0f;
    default:
      return 0.0f;
  }
}

bool can_convert(dtype src, dtype dst) noexcept { return is_wide_float(dst) && (is_wide_float(src) || is_fp8(src)); }

bool can_quantize(dtype src, dtype dst) noexcept { return is_wide_float(src) && is_fp8(dst); }

// ---- tensors

void convert_tensor(const tensor_view& src, const tensor_view& dst, float scale) {
  const std::size_t n = check_pair("convert_tensor", src, dst, can_convert(src.dtype, dst.dtype),
                                   "float32, bfloat16 or float16 to one of them, or float8_e4m3fn or float8_e5m2 "
                                   "to one of them (float to fp8 is quantize_fp8)");
  const std::string what = "convert_tensor from " + describe(src) + " to " + describe(dst);
  if (is_fp8(src.dtype)) {
    check_quantize_scale(what, scale);
  } else if (scale != 1.0f) {
    throw_error(errc::invalid_argument,
                what + ": a scale applies to fp8 sources only; expected 1, got " + float_text(scale));
  }
  if (n == 0) return;
  const std::byte* s = src.data;
  std::byte* d = dst.data;
  if (src.dtype == dst.dtype) {  // a copy keeps every bit, NaN payloads included
    std::memcpy(d, s, n * element_size(src.dtype));
    return;
  }
  switch (src.dtype) {
    case dtype::float32:
      return convert_from<dtype::float32>(dst.dtype, s, d, n, scale);
    case dtype::bfloat16:
      return convert_from<dtype::bfloat16>(dst.dtype, s, d, n, scale);
    case dtype::float16:
      return convert_from<dtype::float16>(dst.dtype, s, d, n, scale);
    case dtype::float8_e4m3fn:
      return convert_from<dtype::float8_e4m3fn>(dst.dtype, s, d, n, scale);
    case dtype::float8_e5m2:
      return convert_from<dtype::float8_e5m2>(dst.dtype, s, d, n, scale);
    default:
      return;  // excluded by can_convert
  }
}

void quantize_fp8(const tensor_view& src, const tensor_view& dst, float scale) {
  const std::size_t n = check_pair("quantize_fp8", src, dst, can_quantize(src.dtype, dst.dtype),
                                   "float32, bfloat16 or float16 to float8_e4m3fn or float8_e5m2");
  check_quantize_scale("quantize_fp8 from " + describe(src) + " to " + describe(dst), scale);
  if (n == 0) return;
  switch (src.dtype) {
    case dtype::float32:
      return quantize_from<dtype::float32>(dst.dtype, src.data, dst.data, n, scale);
    case dtype::bfloat16:
      return quantize_from<dtype::bfloat16>(dst.dtype, src.data, dst.data, n, scale);
    case dtype::float16:
      return quantize_from<dtype::float16>(dst.dtype, src.data, dst.data, n, scale);
    default:
      return;  // excluded by can_quantize
  }
}

float fp8_scale(const tensor_view& src, dtype fp8) {
  const std::string what = "fp8_scale of " + describe(src) + " for " + std::string(to_string(fp8));
  if (!src.device.is_cpu()) throw_error(errc::invalid_argument, what + ": the tensor must be in host memory");
  if (!can_quantize(src.dtype, fp8))
    throw_error(errc::invalid_argument, what +
                                            ": expected a float32, bfloat16 or float16 tensor and an fp8 type "
                                            "(float8_e4m3fn or float8_e5m2)");
  std::int64_t n = 0;
  try {
    n = src.numel();
  } catch (const error& e) {
    throw_error(errc::invalid_argument, what + ": " + e.message());
  }
  if (n > 0 && src.data == nullptr) throw_error(errc::invalid_argument, what + ": null data pointer");
  float amax = 0.0f;
  auto scan = [&]<dtype S>() {
    const std::size_t size = element_size(S);
    for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
      const float a = std::fabs(codec<S>::get(src.data + i * size));
      amax = a > amax ? a : amax;  // false for NaN: NaNs are ignored
    }
  };
  switch (src.dtype) {
    case dtype::float32:
      scan.template operator()<dtype::float32>();
      break;
    case dtype::bfloat16:
      scan.template operator()<dtype::bfloat16>();
      break;
    default:
      scan.template operator()<dtype::float16>();
      break;
  }
  if (amax == 0.0f) return 1.0f;
  const float scale = amax / fp8_max(fp8);
  // For a float32/bfloat16 amax below ~224 * 2^-149 the quotient underflows to 0,
  // which quantize_fp8 would refuse; the smallest positive float still quantises
  // every element finitely (|x| / scale <= 224).
  return scale > 0.0f ? scale : std::numeric_limits<float>::denorm_min();
}

}  // namespace refit::convert
