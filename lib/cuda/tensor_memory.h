// Device memory for a tensor_map_target (lib/model/tensor_memory.h): the target's
// tensors on one CUDA device.
//
//   auto memory = std::make_shared<refit::cuda::device_tensor_memory>(0);  // cuda:0
//   refit::tensor_map_target_options o;
//   o.memory = memory;
//   refit::tensor_map_target model(o);   // views on cuda:0; tcp/loopback stage on
//                                        // the host and load_weights copies in
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>

#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/model/tensor_memory.h>

namespace refit::cuda {

/// Tensors in device memory of device `index`: cudaMalloc (device_buffer) zeroed
/// with cudaMemset, copies with cudaMemcpyAsync (cudaMemcpyDefault: host or device
/// sources alike) on a non-blocking stream of its own, synchronised before each
/// call returns; the device is made current around every call (device_scope) and
/// restored. Thread-safe (copies from several threads serialise on the stream).
/// Throws cuda_error for CUDA failures; copy_in refuses (unsupported) a view that is
/// neither on the host nor on this device. Host memory copied from or to is
/// usually pageable (the engines' staging): such copies are synchronous anyway.
class device_tensor_memory final : public tensor_memory {
 public:
  /// Memory on device `index`. Throws cuda_error (e.g. no such device).
  explicit device_tensor_memory(int index);
  ~device_tensor_memory() override;
  device_tensor_memory(const device_tensor_memory&) = delete;
  device_tensor_memory& operator=(const device_tensor_memory&) = delete;

  refit::device device() const noexcept override { return refit::device::cuda(index_); }
  int index() const noexcept { return index_; }

  std::byte* allocate_zeroed(std::uint64_t bytes) override;
  void release(std::byte* p) noexcept override;
  void copy_in(std::byte* dst, const tensor_view& src) override;
  void copy_out(std::span<std::byte> host, const std::byte* src) override;

 private:
  const int index_;
  std::mutex mutex_;                                       // guards buffers_
  std::unordered_map<std::byte*, device_buffer> buffers_;  // what allocate_zeroed handed out
  stream stream_;                                          // on index_
};

}  // namespace refit::cuda
