// CUDA builds: a ucx worker may stage on its CUDA device (cudaMalloc).
#include "device_memory.h"  // private to this engine

#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/error.h>

namespace refit::ucx {

std::string device_memory_unavailable() { return {}; }

std::shared_ptr<std::byte> allocate_device(const refit::device& where, std::uint64_t bytes) {
  if (!where.is_cuda()) throw_error(errc::invalid_argument, "ucx: " + to_string(where) + " is not a CUDA device");
  try {
    auto buffer = std::make_shared<cuda::device_buffer>(static_cast<std::size_t>(bytes), where.index);
    std::byte* p = buffer->bytes();
    return {buffer, p};  // aliases the buffer: freed with it
  } catch (const cuda::cuda_error& e) {
    throw_error(e.status() == cudaErrorMemoryAllocation ? errc::resource_exhausted : errc::io_error,
                "ucx: allocating " + std::to_string(bytes) + " bytes on " + to_string(where) + ": " + e.what());
  }
}

}  // namespace refit::ucx
