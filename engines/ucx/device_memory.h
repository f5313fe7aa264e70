// Device memory for a ucx worker that receives on a CUDA device (private to the
// ucx engine). Which file implements it is the build's choice (BUILD): CUDA builds
// allocate with the CUDA runtime (device_memory_cuda.cc); others have none
// (device_memory_none.cc), so the core and non-CUDA builds never see CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <refit/tensor.h>

namespace refit::ucx {

/// "" when this build can allocate memory on CUDA devices, else why not.
std::string device_memory_unavailable();

/// `bytes` of memory on the CUDA device `where` (not zeroed), freed when the last
/// owner goes. Throws refit::error (unsupported where the build has no CUDA;
/// resource_exhausted when the device is out of memory).
std::shared_ptr<std::byte> allocate_device(const refit::device& where, std::uint64_t bytes);

}  // namespace refit::ucx
