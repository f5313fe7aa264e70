#include <refit/cuda/fill.h>

#include <algorithm>

#include <refit/cuda/error.h>

namespace refit::cuda {
namespace {

constexpr unsigned threads_per_block = 256;
// Enough blocks to fill any current GPU; the grid-stride loop covers the rest, so
// the launch never depends on size fitting a grid dimension.
constexpr std::size_t max_blocks = 4096;

__global__ void fill_bytes_kernel(std::uint8_t* dst, std::uint8_t value, std::size_t size) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < size; i += stride) {
    dst[i] = value;
  }
}

}  // namespace

void fill_bytes(void* dst, std::uint8_t value, std::size_t size, cudaStream_t stream) {
  if (size == 0) return;
  const std::size_t blocks = std::min(max_blocks, (size + threads_per_block - 1) / threads_per_block);
  fill_bytes_kernel<<<static_cast<unsigned>(blocks), threads_per_block, 0, stream>>>(static_cast<std::uint8_t*>(dst),
                                                                                     value, size);
  // A launch reports its errors only through the last-error slot (which this read
  // also clears); name the kernel rather than cudaGetLastError in the message.
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) {
    throw cuda_error(status, "fill_bytes_kernel<<<...>>>");
  }
}

}  // namespace refit::cuda
