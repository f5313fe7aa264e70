#include <refit/cuda/device.h>

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <refit/cuda/error.h>

namespace refit::cuda {

device_count_result device_count_or_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // Clear a non-sticky failure so a later check does not report it again. (A
    // failed runtime initialization, e.g. no driver, stays and cannot be cleared.)
    (void)cudaGetLastError();
    return {0, std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(status) + " (" +
                   cudaGetErrorName(status) + ")"};
  }
  if (count == 0) {
    // The usual cause when the driver works: an empty or wrong CUDA_VISIBLE_DEVICES.
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return {0, std::string("cudaGetDeviceCount reported no devices (CUDA_VISIBLE_DEVICES=") +
                   (visible ? "\"" + std::string(visible) + "\"" : std::string("unset")) + ")"};
  }
  return {count, {}};
}

int current_device() {
  int d = 0;
  REFIT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

const std::array<std::byte, 16>& device_uuid(int device) {
  static std::mutex mutex;
  static std::vector<std::array<std::byte, 16>> uuids;  // by index; filled once
  std::lock_guard lock(mutex);
  if (uuids.empty()) {
    int count = 0;
    REFIT_CUDA_CHECK(cudaGetDeviceCount(&count));
    std::vector<std::array<std::byte, 16>> all(static_cast<std::size_t>(count));
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop{};
      REFIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
      static_assert(sizeof(prop.uuid.bytes) == 16);
      std::memcpy(all[static_cast<std::size_t>(d)].data(), prop.uuid.bytes, 16);
    }
    uuids = std::move(all);
  }
  if (device < 0 || static_cast<std::size_t>(device) >= uuids.size())
    throw cuda_error(cudaErrorInvalidDevice, "device_uuid(" + std::to_string(device) + ")",
                     std::source_location::current());
  return uuids[static_cast<std::size_t>(device)];
}

device_scope::device_scope(int device) {
  REFIT_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) REFIT_CUDA_CHECK(cudaSetDevice(device));
}

device_scope::~device_scope() { (void)cudaSetDevice(previous_); }

}  // namespace refit::cuda
