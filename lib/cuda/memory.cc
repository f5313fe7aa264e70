#include <refit/cuda/memory.h>

#include <utility>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>

namespace refit::cuda {
device_buffer::device_buffer(std::size_t bytes) {
  REFIT_CUDA_CHECK(cudaGetDevice(&device_));
  if (bytes == 0) return;
  REFIT_CUDA_CHECK(cudaMalloc(&data_, bytes));
  size_ = bytes;
}

device_buffer::device_buffer(std::size_t bytes, int device) : device_(device) {
  if (bytes == 0) return;
  const device_scope scope(device);
  REFIT_CUDA_CHECK(cudaMalloc(&data_, bytes));
  size_ = bytes;
}

device_buffer::~device_buffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

device_buffer::device_buffer(device_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), device_(other.device_) {}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

pinned_buffer::pinned_buffer(std::size_t bytes, unsigned flags) {
  if (bytes == 0) return;
  REFIT_CUDA_CHECK(cudaHostAlloc(&data_, bytes, flags));
  size_ = bytes;
}

pinned_buffer::~pinned_buffer() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
}

pinned_buffer::pinned_buffer(pinned_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

pinned_buffer& pinned_buffer::operator=(pinned_buffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace refit::cuda
