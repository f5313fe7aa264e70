#include <refit/cuda/tensor_memory.h>

#include <algorithm>
#include <string>
#include <utility>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/error.h>

namespace refit::cuda {

device_tensor_memory::device_tensor_memory(int index) : index_(index), stream_(stream::on(index)) {}

device_tensor_memory::~device_tensor_memory() {
  // Buffers the target did not release (it releases all of its own) go with the
  // object; nothing is queued on the stream (every call synchronises).
  std::lock_guard lock(mutex_);
  buffers_.clear();
}

std::byte* device_tensor_memory::allocate_zeroed(std::uint64_t bytes) {
  // At least one byte: every tensor has an address.
  const std::size_t n = static_cast<std::size_t>(std::max<std::uint64_t>(bytes, 1));
  device_buffer buffer(n, index_);
  {
    const device_scope scope(index_);
    REFIT_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0, n, stream_.get()));
    stream_.synchronize();
  }
  std::byte* p = buffer.bytes();
  std::lock_guard lock(mutex_);
  buffers_.emplace(p, std::move(buffer));
  return p;
}

void device_tensor_memory::release(std::byte* p) noexcept {
  device_buffer gone;  // freed (cudaFree) when it goes out of scope, outside the lock
  std::lock_guard lock(mutex_);
  auto it = buffers_.find(p);
  if (it == buffers_.end()) return;
  gone = std::move(it->second);
  buffers_.erase(it);
}

void device_tensor_memory::copy_in(std::byte* dst, const tensor_view& src) {
  if (!src.device.is_cpu() && !(src.device == device()))
    throw_error(errc::unsupported, "cuda device tensor memory: tensor '" + std::string(src.name) + "' is on " +
                                       to_string(src.device) + ", this memory is on " + to_string(device()) +
                                       " and copies from the host or from " + to_string(device()));
  const std::size_t n = static_cast<std::size_t>(src.nbytes());
  if (n == 0) return;
  const device_scope scope(index_);
  REFIT_CUDA_CHECK(cudaMemcpyAsync(dst, src.data, n, cudaMemcpyDefault, stream_.get()));
  stream_.synchronize();
}

void device_tensor_memory::copy_out(std::span<std::byte> host, const std::byte* src) {
  if (host.empty()) return;
  const device_scope scope(index_);
  REFIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), src, host.size(), cudaMemcpyDefault, stream_.get()));
  stream_.synchronize();
}

}  // namespace refit::cuda
