// Element conversions between the floating-point types refit moves: the CPU
// reference that every GPU kernel (lib/cuda) is checked against bit for bit.
//
// Semantics (the same as PyTorch's casts unless said otherwise):
//  - Narrowing rounds to nearest, ties to even. NaN stays NaN (a quiet NaN with the
//    sign kept: bf16 0x7fc0/0xffc0, fp16 0x7e00/0xfe00, e4m3fn 0x7f/0xff,
//    e5m2 0x7e/0xfe); infinities stay infinite where the type has them.
//  - float -> bf16/fp16: overflow becomes infinity (IEEE), subnormals are kept.
//  - float -> fp8 (to_fp8): *saturating*, as fp8 quantisation is used (vLLM's
//    scaled_fp8_quant clamps): values beyond the largest finite magnitude, and
//    infinities, become that magnitude with their sign (e4m3fn 448, e5m2 57344).
//    Plain PyTorch casts to e4m3fn give NaN there instead; refit quantises, it does
//    not cast.
//  - fp8 quantisation with a per-tensor scale: q = to_fp8(x / scale) computed in
//    float (x converted to float first, one float division, then rounding);
//    dequantisation: x = float(q) * scale, then rounded to the destination type.
//  - bf16 <-> fp16 goes through float (exact widening, then one rounding).
//  - Widening to float is exact. A NaN keeps its sign and payload (fp16 and e5m2
//    payloads land in the top float mantissa bits, as bf16's bits << 16 does; no
//    quieting); e4m3fn's only NaN widens to the quiet NaN 0x7fc00000 with its sign.
//  - A value that rounds to zero keeps its sign (-1e-30f -> fp16 0x8000).
//  - A same-type convert_tensor is a byte copy: every bit, NaN payloads included.
#pragma once

#include <cstdint>
#include <span>

#include <refit/dtype.h>
#include <refit/tensor.h>

namespace refit::convert {

// ---- scalar conversions (bit patterns in, bit patterns out)
float bf16_to_float(std::uint16_t bits) noexcept;
std::uint16_t float_to_bf16(float value) noexcept;
float fp16_to_float(std::uint16_t bits) noexcept;
std::uint16_t float_to_fp16(float value) noexcept;
float fp8_e4m3fn_to_float(std::uint8_t bits) noexcept;
float fp8_e5m2_to_float(std::uint8_t bits) noexcept;
/// Saturating (see above).
std::uint8_t float_to_fp8_e4m3fn(float value) noexcept;
std::uint8_t float_to_fp8_e5m2(float value) noexcept;

/// Largest finite magnitude of an fp8 type (448 for e4m3fn, 57344 for e5m2);
/// 0 for other types.
float fp8_max(dtype t) noexcept;

/// True when convert_tensor supports src -> dst: any pair among float32, bfloat16
/// and float16 (including same-type copies), and fp8 -> any of those (dequantise).
bool can_convert(dtype src, dtype dst) noexcept;
/// True when quantize_fp8 supports src -> dst: src float32/bfloat16/float16, dst
/// float8_e4m3fn/float8_e5m2.
bool can_quantize(dtype src, dtype dst) noexcept;

/// Converts host tensor `src` into host tensor `dst` (same element count; may not
/// overlap). For an fp8 source, `scale` dequantises (x = q * scale) and must be
/// finite and > 0; otherwise it must be 1. Throws refit::error(invalid_argument)
/// naming both tensors for an unsupported pair, a count mismatch, a device tensor,
/// a bad scale, overlapping tensors or a null pointer with elements to convert.
void convert_tensor(const tensor_view& src, const tensor_view& dst, float scale = 1.0f);

/// Quantises host tensor `src` into fp8 host tensor `dst` with `scale`
/// (q = to_fp8(x / scale)); scale must be finite and > 0. Throws like
/// convert_tensor (a pair outside can_quantize, float32 -> float16 say, is refused).
void quantize_fp8(const tensor_view& src, const tensor_view& dst, float scale);

/// The per-tensor scale that maps the largest magnitude of `src` onto the fp8
/// type's largest finite value: amax / fp8_max(fp8), or 1 when amax is 0. NaNs are
/// ignored; an infinity makes the scale infinite, which quantize_fp8 refuses. When
/// amax / max underflows to 0 (a float32 or bfloat16 amax below ~224 * 2^-149) the
/// scale is the smallest positive float instead, so quantize_fp8 still accepts it.
/// Throws refit::error(invalid_argument) for a device tensor or a pair outside
/// can_quantize(src.dtype, fp8).
float fp8_scale(const tensor_view& src, dtype fp8);

}  // namespace refit::convert
