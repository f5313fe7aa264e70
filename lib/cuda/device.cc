#include "lib/cuda/device.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "lib/cuda/error.h"

namespace refit::cuda {

device_count_result device_count_or_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // Clear a non-sticky failure so a later check does not report it again. (A
    // failed runtime initialization, e.g. no driver, stays and cannot be cleared.)
    (void)cudaGetLastError();
    return {0, std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(status) +
                   " (" + cudaGetErrorName(status) + ")"};
  }
  if (count == 0) {
    // The usual cause when the driver works: an empty or wrong CUDA_VISIBLE_DEVICES.
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return {0, std::string("cudaGetDeviceCount reported no devices (CUDA_VISIBLE_DEVICES=") +
                   (visible ? "\"" + std::string(visible) + "\"" : std::string("unset")) +
                   ")"};
  }
  return {count, {}};
}

device_scope::device_scope(int device) {
  REFIT_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) REFIT_CUDA_CHECK(cudaSetDevice(device));
}

device_scope::~device_scope() { (void)cudaSetDevice(previous_); }

}  // namespace refit::cuda
