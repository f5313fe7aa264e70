// Owned device and pinned host memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>

namespace refit::cuda {

/// Device memory from cudaMalloc, freed with the object. Move-only. Zero bytes
/// allocate nothing (data() is null).
///
/// cudaFree waits for the device to be idle, so free buffers at init/shutdown rather
/// than per update; and never destroy one while queued work may still use it.
class device_buffer {
 public:
  device_buffer() = default;
  /// `bytes` on the current device. Throws cuda_error (cudaErrorMemoryAllocation
  /// when the device is out of memory).
  explicit device_buffer(std::size_t bytes);
  /// `bytes` on device `device`; the current device is left as it was.
  device_buffer(std::size_t bytes, int device);
  ~device_buffer();

  device_buffer(device_buffer&& other) noexcept;
  device_buffer& operator=(device_buffer&& other) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::byte* bytes() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The memory as `T` elements (size() / sizeof(T) of them, rounded down).
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
};

/// Page-locked host memory from cudaHostAlloc, freed with the object: the host side
/// of asynchronous copies (pageable memory makes cudaMemcpyAsync synchronous).
/// Move-only. Zero bytes allocate nothing.
class pinned_buffer {
 public:
  pinned_buffer() = default;
  /// Throws cuda_error. `flags` as for cudaHostAlloc (cudaHostAllocPortable, ...).
  explicit pinned_buffer(std::size_t bytes, unsigned flags = cudaHostAllocDefault);
  ~pinned_buffer();

  pinned_buffer(pinned_buffer&& other) noexcept;
  pinned_buffer& operator=(pinned_buffer&& other) noexcept;
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::byte* bytes() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() const noexcept { return {bytes(), size_}; }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace refit::cuda
