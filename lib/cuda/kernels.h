// refit's CUDA kernels: batched copies of many pieces in one launch, and float
// conversions that match the CPU reference (tests/support/convert.h) bit for bit.
//
// Every function here enqueues work on `stream` and returns without waiting; the
// memory involved must stay valid until that work completes (see await.h).
// Launch failures throw cuda_error naming the kernel; argument errors throw
// refit::error(invalid_argument) before anything is enqueued.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include <refit/dtype.h>

namespace refit::cuda {

// ---- batched unpack

/// One copy of a batched unpack: `bytes` bytes from `src` to `dst`, both device
/// memory (or memory the device can address). Pieces of one batch must not overlap
/// each other's destinations, nor a destination overlap a source.
struct piece {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t bytes = 0;
};

/// Pieces larger than this are split into descriptors of at most this many bytes, so
/// one large tensor spreads over many warps while tiny ones cost one warp each.
/// A multiple of 16, so chunks keep their piece's alignment.
inline constexpr std::uint64_t unpack_chunk_bytes = 32 * 1024;

/// Enqueues the copies described by `count` descriptors already in device memory at
/// `descriptors` (as prepare_unpack_descriptors writes them; unpack.h does all of it)
/// in one kernel launch. A warp copies one descriptor at a time: with 16-byte vector
/// loads and stores when source and destination are equally aligned modulo 16
/// (bytes up to the first 16-byte boundary and after the last one are copied singly),
/// with the widest common alignment (8, 4, 2 bytes) otherwise. `descriptors` must
/// stay valid until the kernel completes. count 0 enqueues nothing.
void launch_unpack(const piece* descriptors, std::size_t count, cudaStream_t stream);

// ---- conversions (same semantics as refit::convert, tests/support/convert.h)

/// As refit::convert::can_convert: any pair among float32, bfloat16 and float16
/// (same-type copies included), and float8_e4m3fn/float8_e5m2 to one of those.
[[nodiscard]] bool can_convert(dtype src, dtype dst) noexcept;
/// As refit::convert::can_quantize: float32/bfloat16/float16 to an fp8 type.
[[nodiscard]] bool can_quantize(dtype src, dtype dst) noexcept;

/// Converts `count` elements of `src_type` at `src` into `dst_type` at `dst` (device
/// memory, not overlapping), as refit::convert::convert_tensor: round to nearest
/// even, canonical quiet NaNs, same-type copies keep every bit. For an fp8 source,
/// `scale` dequantises (x = float(q) * scale, then rounded) and must be finite and
/// > 0; otherwise it must be 1. Elements need only their natural alignment; 8-element
/// vectors are used when both pointers are aligned to 8 elements.
void convert(const void* src, dtype src_type, void* dst, dtype dst_type, std::size_t count, cudaStream_t stream,
             float scale = 1.0f);

/// Quantises `count` elements (float32/bfloat16/float16) into fp8 with a per-tensor
/// `scale` (finite, > 0), as refit::convert::quantize_fp8: q = to_fp8(x / scale),
/// saturating at the largest finite fp8 magnitude (448 for e4m3fn, 57344 for e5m2).
void quantize_fp8(const void* src, dtype src_type, void* dst, dtype fp8_type, std::size_t count, float scale,
                  cudaStream_t stream);

}  // namespace refit::cuda
