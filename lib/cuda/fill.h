// A minimal CUDA kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace refit::cuda {

// Enqueues, on `stream`, setting `size` bytes of device memory at `dst` to `value`,
// and returns without waiting. It does what cudaMemsetAsync does; it exists as the
// smallest real kernel, so that the nvcc build path (cuda_library) and a device's
// ability to run code are both exercised by tests, and as the pattern for later
// kernels. A zero size enqueues nothing. Throws cuda_error if the launch fails.
void fill_bytes(void* dst, std::uint8_t value, std::size_t size, cudaStream_t stream);

}  // namespace refit::cuda
