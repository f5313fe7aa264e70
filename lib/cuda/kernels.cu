#include <refit/cuda/kernels.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <refit/cuda/convert_bits.h>
#include <refit/cuda/error.h>
#include <refit/error.h>

namespace refit::cuda {
namespace {

constexpr unsigned threads_per_block = 256;
constexpr unsigned warp_size = 32;
// Enough resident blocks for any current GPU; grid-stride loops cover the rest.
constexpr std::size_t max_blocks = 8192;

void check_launch(const char* kernel) {
  // A launch reports errors only through the last-error slot (this read clears it).
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) throw cuda_error(status, kernel);
}

// ---- unpack

template <class W>
__device__ __forceinline__ void copy_words(const std::byte* src, std::byte* dst, std::uint64_t n, unsigned lane) {
  // Precondition: src and dst are equally aligned modulo sizeof(W).
  constexpr std::uint64_t w = sizeof(W);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  const std::uint64_t to_boundary = (w - (s & (w - 1))) & (w - 1);
  const std::uint64_t head = to_boundary < n ? to_boundary : n;
  for (std::uint64_t i = lane; i < head; i += warp_size) dst[i] = src[i];
  const W* vs = reinterpret_cast<const W*>(src + head);
  W* vd = reinterpret_cast<W*>(dst + head);
  const std::uint64_t words = (n - head) / w;
  // Four independent loads in flight per lane before the stores.
  std::uint64_t i = lane;
  for (; i + 3 * warp_size < words; i += 4 * warp_size) {
    const W a = vs[i], b = vs[i + warp_size], c = vs[i + 2 * warp_size], d = vs[i + 3 * warp_size];
    vd[i] = a;
    vd[i + warp_size] = b;
    vd[i + 2 * warp_size] = c;
    vd[i + 3 * warp_size] = d;
  }
  for (; i < words; i += warp_size) vd[i] = vs[i];
  for (std::uint64_t j = head + words * w + lane; j < n; j += warp_size) dst[j] = src[j];
}

__global__ void unpack_kernel(const piece* descriptors, std::size_t count) {
  const std::size_t thread = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const unsigned lane = threadIdx.x % warp_size;
  const std::size_t warps = std::size_t{gridDim.x} * blockDim.x / warp_size;
  for (std::size_t k = thread / warp_size; k < count; k += warps) {
    const piece p = descriptors[k];  // the same address for the whole warp: one load
    const auto rel = reinterpret_cast<std::uintptr_t>(p.src) ^ reinterpret_cast<std::uintptr_t>(p.dst);
    if ((rel & 15) == 0)
      copy_words<uint4>(p.src, p.dst, p.bytes, lane);
    else if ((rel & 7) == 0)
      copy_words<uint2>(p.src, p.dst, p.bytes, lane);
    else if ((rel & 3) == 0)
      copy_words<std::uint32_t>(p.src, p.dst, p.bytes, lane);
    else if ((rel & 1) == 0)
      copy_words<std::uint16_t>(p.src, p.dst, p.bytes, lane);
    else
      copy_words<std::uint8_t>(p.src, p.dst, p.bytes, lane);
  }
}

// ---- conversions

using bits::codec;

enum class mode { convert, dequantize, quantize };

// The reference's element operation for S -> D (tests/support/convert.cc's loops).
template <dtype S, dtype D, mode M>
struct element_op {
  float scale;
  __device__ typename codec<D>::bits_type operator()(typename codec<S>::bits_type in) const {
    if constexpr (M == mode::dequantize)
      return bits::dequantize_one<S, D>(in, scale);
    else if constexpr (M == mode::quantize)
      return bits::quantize_one<S, D>(in, scale);
    else
      return bits::convert_one<S, D>(in);
  }
};

constexpr int vector_elements = 8;

template <class T>
struct alignas(sizeof(T) * vector_elements) vec {
  T v[vector_elements];
};

// The widest loads and stores: vectors moved as 16-byte (or 8-byte) words, which
// the compiler keeps as single ld/st.v4.u32 (v2.u32) instructions.
template <std::size_t Bytes>
struct words;
template <>
struct words<32> {
  uint4 w[2];
};
template <>
struct words<16> {
  uint4 w[1];
};
template <>
struct words<8> {
  uint2 w[1];
};

template <class T>
__device__ __forceinline__ vec<T> load_vec(const vec<T>* p) {
  using raw = words<sizeof(vec<T>)>;
  const raw r = *reinterpret_cast<const raw*>(p);
  vec<T> v;
  memcpy(&v, &r, sizeof v);
  return v;
}

template <class T>
__device__ __forceinline__ void store_vec(vec<T>* p, const vec<T>& v) {
  using raw = words<sizeof(vec<T>)>;
  raw r;
  memcpy(&r, &v, sizeof r);
  *reinterpret_cast<raw*>(p) = r;
}

template <dtype S, dtype D, mode M>
__global__ void convert_kernel(const typename codec<S>::bits_type* src, typename codec<D>::bits_type* dst,
                               std::size_t n, element_op<S, D, M> op, bool vectorized) {
  using in_t = typename codec<S>::bits_type;
  using out_t = typename codec<D>::bits_type;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t first = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if (vectorized) {
    const std::size_t vectors = n / vector_elements;
    const auto* vs = reinterpret_cast<const vec<in_t>*>(src);
    auto* vd = reinterpret_cast<vec<out_t>*>(dst);
    for (std::size_t i = first; i < vectors; i += stride) {
      const vec<in_t> in = load_vec(vs + i);
      vec<out_t> out;
#pragma unroll
      for (int k = 0; k < vector_elements; ++k) out.v[k] = op(in.v[k]);
      store_vec(vd + i, out);
    }
    done = vectors * vector_elements;
  }
  for (std::size_t i = done + first; i < n; i += stride) dst[i] = op(src[i]);
}

template <dtype S, dtype D, mode M>
void launch_convert(const void* src, void* dst, std::size_t n, float scale, cudaStream_t stream) {
  using in_t = typename codec<S>::bits_type;
  using out_t = typename codec<D>::bits_type;
  const bool vectorized = reinterpret_cast<std::uintptr_t>(src) % (sizeof(in_t) * vector_elements) == 0 &&
                          reinterpret_cast<std::uintptr_t>(dst) % (sizeof(out_t) * vector_elements) == 0;
  const std::size_t work = vectorized ? std::max<std::size_t>(n / vector_elements, 1) : n;
  const std::size_t blocks = std::min(max_blocks, (work + threads_per_block - 1) / threads_per_block);
  convert_kernel<S, D, M><<<static_cast<unsigned>(blocks), threads_per_block, 0, stream>>>(
      static_cast<const in_t*>(src), static_cast<out_t*>(dst), n, element_op<S, D, M>{scale}, vectorized);
  check_launch("convert_kernel<<<...>>>");
}

template <dtype S, mode M>
void dispatch_destination(dtype d, const void* src, void* dst, std::size_t n, float scale, cudaStream_t stream) {
  if constexpr (M == mode::quantize) {
    if (d == dtype::float8_e4m3fn) return launch_convert<S, dtype::float8_e4m3fn, M>(src, dst, n, scale, stream);
    return launch_convert<S, dtype::float8_e5m2, M>(src, dst, n, scale, stream);
  } else {
    switch (d) {
      case dtype::float32:
        return launch_convert<S, dtype::float32, M>(src, dst, n, scale, stream);
      case dtype::bfloat16:
        return launch_convert<S, dtype::bfloat16, M>(src, dst, n, scale, stream);
      default:
        return launch_convert<S, dtype::float16, M>(src, dst, n, scale, stream);
    }
  }
}

bool is_wide_float(dtype t) noexcept { return t == dtype::float32 || t == dtype::bfloat16 || t == dtype::float16; }
bool is_fp8(dtype t) noexcept { return t == dtype::float8_e4m3fn || t == dtype::float8_e5m2; }

std::string float_text(float f) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
  return buf;
}

std::string describe(const char* op, dtype s, dtype d, std::size_t count) {
  return std::string(op) + " of " + std::to_string(count) + " elements from " + std::string(to_string(s)) + " to " +
         std::string(to_string(d));
}

template <class What>
void check_common(const What& what, const void* src, dtype s, void* dst, dtype d, std::size_t count) {
  if (count == 0) return;
  if (src == nullptr || dst == nullptr) throw_error(errc::invalid_argument, what() + ": null pointer");
  const auto s0 = reinterpret_cast<std::uintptr_t>(src);
  const auto d0 = reinterpret_cast<std::uintptr_t>(dst);
  const std::uintptr_t s_bytes = count * element_size(s), d_bytes = count * element_size(d);
  if (s0 < d0 + d_bytes && d0 < s0 + s_bytes)
    throw_error(errc::invalid_argument, what() + ": source and destination overlap");
  if (s0 % element_size(s) != 0 || d0 % element_size(d) != 0)
    throw_error(errc::invalid_argument, what() + ": pointers must be aligned to their element sizes");
}

template <class What>
void check_fp8_scale(const What& what, float scale) {
  if (!(std::isfinite(scale) && scale > 0.0f))
    throw_error(errc::invalid_argument, what() + ": the fp8 scale must be finite and > 0, got " + float_text(scale));
}

}  // namespace

void launch_unpack(const piece* descriptors, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  constexpr std::size_t warps_per_block = threads_per_block / warp_size;
  const std::size_t blocks = std::min(max_blocks, (count + warps_per_block - 1) / warps_per_block);
  unpack_kernel<<<static_cast<unsigned>(blocks), threads_per_block, 0, stream>>>(descriptors, count);
  check_launch("unpack_kernel<<<...>>>");
}

bool can_convert(dtype src, dtype dst) noexcept { return is_wide_float(dst) && (is_wide_float(src) || is_fp8(src)); }

bool can_quantize(dtype src, dtype dst) noexcept { return is_wide_float(src) && is_fp8(dst); }

void convert(const void* src, dtype src_type, void* dst, dtype dst_type, std::size_t count, cudaStream_t stream,
             float scale) {
  // Messages are built only on failure: this runs once per tensor.
  const auto what = [&] { return describe("refit::cuda::convert", src_type, dst_type, count); };
  if (!can_convert(src_type, dst_type))
    throw_error(errc::invalid_argument, what() +
                                            ": unsupported dtype pair; expected float32, bfloat16 or float16 to one "
                                            "of them, or float8_e4m3fn or float8_e5m2 to one of them (float to fp8 "
                                            "is quantize_fp8)");
  if (is_fp8(src_type)) {
    check_fp8_scale(what, scale);
  } else if (scale != 1.0f) {
    throw_error(errc::invalid_argument,
                what() + ": a scale applies to fp8 sources only; expected 1, got " + float_text(scale));
  }
  check_common(what, src, src_type, dst, dst_type, count);
  if (count == 0) return;
  if (src_type == dst_type) {  // a copy keeps every bit, NaN payloads included
    REFIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * element_size(src_type), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  switch (src_type) {
    case dtype::float32:
      return dispatch_destination<dtype::float32, mode::convert>(dst_type, src, dst, count, scale, stream);
    case dtype::bfloat16:
      return dispatch_destination<dtype::bfloat16, mode::convert>(dst_type, src, dst, count, scale, stream);
    case dtype::float16:
      return dispatch_destination<dtype::float16, mode::convert>(dst_type, src, dst, count, scale, stream);
    case dtype::float8_e4m3fn:
      return dispatch_destination<dtype::float8_e4m3fn, mode::dequantize>(dst_type, src, dst, count, scale, stream);
    default:
      return dispatch_destination<dtype::float8_e5m2, mode::dequantize>(dst_type, src, dst, count, scale, stream);
  }
}

void quantize_fp8(const void* src, dtype src_type, void* dst, dtype fp8_type, std::size_t count, float scale,
                  cudaStream_t stream) {
  const auto what = [&] { return describe("refit::cuda::quantize_fp8", src_type, fp8_type, count); };
  if (!can_quantize(src_type, fp8_type))
    throw_error(errc::invalid_argument, what() +
                                            ": unsupported dtype pair; expected float32, bfloat16 or float16 to "
                                            "float8_e4m3fn or float8_e5m2");
  check_fp8_scale(what, scale);
  check_common(what, src, src_type, dst, fp8_type, count);
  if (count == 0) return;
  switch (src_type) {
    case dtype::float32:
      return dispatch_destination<dtype::float32, mode::quantize>(fp8_type, src, dst, count, scale, stream);
    case dtype::bfloat16:
      return dispatch_destination<dtype::bfloat16, mode::quantize>(fp8_type, src, dst, count, scale, stream);
    default:
      return dispatch_destination<dtype::float16, mode::quantize>(fp8_type, src, dst, count, scale, stream);
  }
}

}  // namespace refit::cuda
