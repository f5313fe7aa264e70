#include <refit/cuda/stream.h>

#include <utility>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/event.h>

namespace refit::cuda {

stream::stream() : stream(0) {}

stream stream::on(int device) {
  const device_scope scope(device);
  return stream();
}

stream::stream(int priority) {
  REFIT_CUDA_CHECK(cudaGetDevice(&device_));
  REFIT_CUDA_CHECK(cudaStreamCreateWithPriority(&handle_, cudaStreamNonBlocking, priority));
  // CUDA clamps out-of-range priorities; report the one in effect.
  REFIT_CUDA_CHECK(cudaStreamGetPriority(handle_, &priority_));
}

stream::~stream() {
  // Errors here are either a corrupted context (reported by every later call) or a
  // bug; a destructor cannot report them.
  if (handle_ != nullptr) (void)cudaStreamDestroy(handle_);
}

stream::stream(stream&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)), device_(other.device_), priority_(other.priority_) {}

stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) (void)cudaStreamDestroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = other.device_;
    priority_ = other.priority_;
  }
  return *this;
}

stream::priorities stream::priority_range() {
  priorities p;
  REFIT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&p.least, &p.greatest));
  return p;
}

void stream::wait(const event& e) const { REFIT_CUDA_CHECK(cudaStreamWaitEvent(handle_, e.get(), 0)); }

bool stream::query() const {
  const cudaError_t status = cudaStreamQuery(handle_);
  if (status == cudaErrorNotReady) return false;
  REFIT_CUDA_CHECK(status);
  return true;
}

void stream::synchronize() const { REFIT_CUDA_CHECK(cudaStreamSynchronize(handle_)); }

}  // namespace refit::cuda
