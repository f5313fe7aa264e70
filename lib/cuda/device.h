// Probing for CUDA devices.
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace refit::cuda {

// The outcome of device_count_or_reason(). A machine without a usable GPU is an
// expected state (CI, CPU-only hosts), not an exception: callers skip or fall back
// and show `reason` to the user as is.
struct device_count_result {
  int count = 0;       // usable devices; 0 exactly when `reason` is set
  std::string reason;  // why there is no usable device; empty when count > 0

  explicit operator bool() const noexcept { return count > 0; }
};

// Asks the CUDA runtime how many devices this process can use. Never throws for
// CUDA failures; e.g. on a host without a driver the reason is
// "cudaGetDeviceCount failed: CUDA driver version is insufficient for CUDA runtime
// version (cudaErrorInsufficientDriver)".
[[nodiscard]] device_count_result device_count_or_reason();

// The current device of the calling thread. Throws cuda_error.
[[nodiscard]] int current_device();

// The UUID of `device` (cudaDeviceProp::uuid, the same in every process, as
// nvidia-smi lists it). Asked of CUDA once per device and process, then cached:
// cudaGetDeviceProperties takes milliseconds. Throws cuda_error.
[[nodiscard]] const std::array<std::byte, 16>& device_uuid(int device);

// Makes `device` current for the scope and restores the previous one, so that work
// on another device does not change the caller's state. Throws cuda_error.
class device_scope {
 public:
  explicit device_scope(int device);
  ~device_scope();
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int previous_ = 0;
};

// The one `Made` (a `Base`) of `device` in this process, made with `Made(device)`
// on first use, with `device` current while it is made (and the caller's device
// restored after): GPU engines' providers, whose streams, events and buffers belong
// to one device. Thread-safe.
template <class Base, class Made>
std::shared_ptr<Base> one_per_device(int device) {
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<Base>> made;
  std::lock_guard lock(mutex);
  auto& p = made[device];
  if (!p) {
    const device_scope scope(device);
    p = std::make_shared<Made>(device);
  }
  return p;
}

}  // namespace refit::cuda
