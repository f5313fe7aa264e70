// Scalar float conversions as bit manipulation, compiled for both host and device.
//
// The GPU conversion kernels (kernels.cu) must match the CPU reference
// (tests/support/convert.h, refit::convert) bit for bit, NaN patterns included. CUDA's own
// intrinsics (__float2bfloat16, cuda_fp8.h) differ from it in places that matter
// here: fp8 e4m3fn casts give NaN rather than saturating, and device float arithmetic
// returns the canonical NaN 0x7fffffff instead of propagating the operand's payload
// as the host's SSE arithmetic does. So these functions restate the reference's
// algorithms in integer operations; the only float arithmetic left (the fp8 scale's
// division and multiplication) is IEEE round-to-nearest on both sides, and NaN
// results are given the host's bits explicitly (see mul_like_host).
//
// Because the same header is compiled by gcc, a host test checks it against
// refit::convert for every 8- and 16-bit pattern without a GPU; the device test then
// checks the kernels against the reference directly.
#pragma once

#include <bit>
#include <cstdint>

#include <refit/dtype.h>

#if defined(__CUDACC__)
#define REFIT_HD __host__ __device__ __forceinline__
#else
#define REFIT_HD inline
#endif

namespace refit::cuda::bits {

// ---- float <-> bits, usable in device code (std::bit_cast is not).

REFIT_HD std::uint32_t f32_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

REFIT_HD float f32_from_bits(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

inline constexpr std::uint32_t f32_abs_mask = 0x7fffffffu;
inline constexpr std::uint32_t f32_inf = 0x7f800000u;
inline constexpr std::uint32_t f32_quiet_bit = 0x00400000u;

REFIT_HD bool f32_bits_is_nan(std::uint32_t u) noexcept { return (u & f32_abs_mask) > f32_inf; }

// x >> shift rounded to nearest, ties to even (1 <= shift <= 31); a carry out of the
// mantissa lands in the exponent field, as rounding up to the next binade must.
REFIT_HD std::uint32_t shift_rne(std::uint32_t x, int shift) noexcept {
  const std::uint32_t q = x >> shift;
  const std::uint32_t rem = x & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + static_cast<std::uint32_t>((rem > half) | ((rem == half) & ((q & 1u) != 0)));
}

// Magnitude bits (exponent << M | mantissa) of the format with M mantissa bits and
// bias B nearest to the finite non-negative float with bits `abs`; may exceed the
// format's largest finite value (callers clamp).
template <int M, int B>
REFIT_HD std::uint32_t narrow_magnitude(std::uint32_t abs) noexcept {
  static_assert(B + M + 1 < 127);
  const int e = static_cast<int>(abs >> 23);
  if (e - 127 + B >= 1) return shift_rne(abs - (static_cast<std::uint32_t>(127 - B) << 23), 23 - M);
  if (e == 0) return 0;  // float subnormals are far below half the smallest target step
  const int shift = 151 - B - M - e;
  if (shift > 24) return 0;
  return shift_rne((abs & 0x007fffffu) | 0x00800000u, shift);
}

// ---- widening (exact)

REFIT_HD float bf16_to_float(std::uint16_t h) noexcept {
  return f32_from_bits(static_cast<std::uint32_t>(h) << 16);  // NaN payloads kept
}

REFIT_HD float fp16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | f32_inf | (mant << 13));  // payload kept
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);
    // Subnormal: mant * 2^-24, a normal float. Normalise in integers: the leading one
    // of mant at bit p (0..9) gives exponent p - 24.
#if defined(__CUDA_ARCH__)
  const int p = 31 - __clz(mant);
#else
  const int p = 31 - std::countl_zero(mant);
#endif
  const std::uint32_t frac = (mant << (23 - p)) & 0x007fffffu;
  return f32_from_bits(sign | (static_cast<std::uint32_t>(p - 24 + 127) << 23) | frac);
}

REFIT_HD float fp8_e4m3fn_to_float(std::uint8_t q) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(q & 0x80u) << 24;
  const std::uint32_t exp = (q >> 3) & 0xfu;
  const std::uint32_t mant = q & 0x7u;
  if (exp == 0xf && mant == 0x7) return f32_from_bits(sign | 0x7fc00000u);  // the NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 120u) << 23) | (mant << 20));
  if (mant == 0) return f32_from_bits(sign);
  // Subnormal: mant * 2^-9 with mant in 1..7.
  const int p = mant >= 4 ? 2 : (mant >= 2 ? 1 : 0);
  const std::uint32_t frac = (mant << (23 - p)) & 0x007fffffu;
  return f32_from_bits(sign | (static_cast<std::uint32_t>(p - 9 + 127) << 23) | frac);
}

REFIT_HD float fp8_e5m2_to_float(std::uint8_t q) noexcept {
  return fp16_to_float(static_cast<std::uint16_t>(q << 8));  // e5m2 is fp16's top byte
}

// ---- narrowing (round to nearest even)

REFIT_HD std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign16 = (u & 0x80000000u) >> 16;
  if (f32_bits_is_nan(u)) return static_cast<std::uint16_t>(sign16 | 0x7fc0u);
  return static_cast<std::uint16_t>(shift_rne(u & f32_abs_mask, 16) | sign16);
}

REFIT_HD std::uint16_t float_to_fp16(float f) noexcept {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign16 = (u & 0x80000000u) >> 16;
  const std::uint32_t abs = u & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint16_t>(sign16 | 0x7e00u);
  std::uint32_t m = narrow_magnitude<10, 15>(abs);
  if (m > 0x7c00u) m = 0x7c00u;  // overflow and infinity -> infinity
  return static_cast<std::uint16_t>(sign16 | m);
}

// Saturating: beyond +-448, infinities included, gives +-448; NaN gives 0x7f/0xff.
REFIT_HD std::uint8_t float_to_fp8_e4m3fn(float f) noexcept {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign8 = (u & 0x80000000u) >> 24;
  const std::uint32_t abs = u & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint8_t>(sign8 | 0x7fu);
  std::uint32_t m = narrow_magnitude<3, 7>(abs);
  if (m > 0x7eu) m = 0x7eu;
  return static_cast<std::uint8_t>(sign8 | m);
}

// Saturating: beyond +-57344, infinities included, gives +-57344; NaN gives 0x7e/0xfe.
REFIT_HD std::uint8_t float_to_fp8_e5m2(float f) noexcept {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign8 = (u & 0x80000000u) >> 24;
  const std::uint32_t abs = u & f32_abs_mask;
  if (abs > f32_inf) return static_cast<std::uint8_t>(sign8 | 0x7eu);
  std::uint32_t m = narrow_magnitude<2, 15>(abs);
  if (m > 0x7bu) m = 0x7bu;
  return static_cast<std::uint8_t>(sign8 | m);
}

// ---- the scale's arithmetic, with the host's NaN bits

// x * scale rounded to nearest. A NaN operand comes out as that NaN, quietened: what
// x86 SSE (and AArch64 without default-NaN mode) produce on the host, where the GPU
// would give 0x7fffffff. The reference multiplies only NaN x by finite scales, so the
// one-NaN rule is all that is needed; for two NaNs the first operand's wins.
REFIT_HD float mul_like_host(float x, float scale) noexcept {
  const std::uint32_t xu = f32_bits(x);
  if (f32_bits_is_nan(xu)) return f32_from_bits(xu | f32_quiet_bit);
  const std::uint32_t su = f32_bits(scale);
  if (f32_bits_is_nan(su)) return f32_from_bits(su | f32_quiet_bit);
#if defined(__CUDA_ARCH__)
  return __fmul_rn(x, scale);  // never contracted into an FMA
#else
  return x * scale;
#endif
}

// x / scale rounded to nearest, NaN operands as in mul_like_host. (Quantisation
// narrows every NaN to the fp8 NaN anyway; this keeps the float identical too.)
REFIT_HD float div_like_host(float x, float scale) noexcept {
  const std::uint32_t xu = f32_bits(x);
  if (f32_bits_is_nan(xu)) return f32_from_bits(xu | f32_quiet_bit);
  const std::uint32_t su = f32_bits(scale);
  if (f32_bits_is_nan(su)) return f32_from_bits(su | f32_quiet_bit);
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, scale);  // IEEE division whatever -prec-div says
#else
  return x / scale;
#endif
}

// ---- per-dtype element operations: what one element of a kernel does, and what
// tests/support/convert.cc's loops do per element.

template <dtype T>
struct codec;
template <>
struct codec<dtype::float32> {
  using bits_type = std::uint32_t;
  static REFIT_HD float get(bits_type b) noexcept { return f32_from_bits(b); }
  static REFIT_HD bits_type put(float f) noexcept { return f32_bits(f); }
};
template <>
struct codec<dtype::bfloat16> {
  using bits_type = std::uint16_t;
  static REFIT_HD float get(bits_type b) noexcept { return bf16_to_float(b); }
  static REFIT_HD bits_type put(float f) noexcept { return float_to_bf16(f); }
};
template <>
struct codec<dtype::float16> {
  using bits_type = std::uint16_t;
  static REFIT_HD float get(bits_type b) noexcept { return fp16_to_float(b); }
  static REFIT_HD bits_type put(float f) noexcept { return float_to_fp16(f); }
};
template <>
struct codec<dtype::float8_e4m3fn> {
  using bits_type = std::uint8_t;
  static REFIT_HD float get(bits_type b) noexcept { return fp8_e4m3fn_to_float(b); }
  static REFIT_HD bits_type put(float f) noexcept { return float_to_fp8_e4m3fn(f); }
};
template <>
struct codec<dtype::float8_e5m2> {
  using bits_type = std::uint8_t;
  static REFIT_HD float get(bits_type b) noexcept { return fp8_e5m2_to_float(b); }
  static REFIT_HD bits_type put(float f) noexcept { return float_to_fp8_e5m2(f); }
};

/// float32/bfloat16/float16 -> one of them: widen exactly, round once. (Same-type
/// conversions are byte copies in both implementations and do not come here.)
template <dtype S, dtype D>
REFIT_HD typename codec<D>::bits_type convert_one(typename codec<S>::bits_type in) noexcept {
  return codec<D>::put(codec<S>::get(in));
}

/// fp8 -> float32/bfloat16/float16: x = float(q) * scale, then rounded.
template <dtype S, dtype D>
REFIT_HD typename codec<D>::bits_type dequantize_one(typename codec<S>::bits_type in, float scale) noexcept {
  return codec<D>::put(mul_like_host(codec<S>::get(in), scale));
}

/// float32/bfloat16/float16 -> fp8: q = to_fp8(x / scale), saturating.
template <dtype S, dtype D>
REFIT_HD typename codec<D>::bits_type quantize_one(typename codec<S>::bits_type in, float scale) noexcept {
  return codec<D>::put(div_like_host(codec<S>::get(in), scale));
}

}  // namespace refit::cuda::bits
