#include <refit/cuda/event.h>

#include <utility>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/stream.h>

namespace refit::cuda {

event::event(unsigned flags) { REFIT_CUDA_CHECK(cudaEventCreateWithFlags(&handle_, flags)); }

event event::on(int device, unsigned flags) {
  const device_scope scope(device);
  return event(flags);
}

event::~event() {
  if (handle_ != nullptr) (void)cudaEventDestroy(handle_);
}

event::event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}

event& event::operator=(event&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) (void)cudaEventDestroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void event::record(const stream& s) { record(s.get()); }

void event::record(cudaStream_t s) { REFIT_CUDA_CHECK(cudaEventRecord(handle_, s)); }

bool event::query() const {
  const cudaError_t status = cudaEventQuery(handle_);
  if (status == cudaErrorNotReady) return false;
  REFIT_CUDA_CHECK(status);
  return true;
}

void event::synchronize() const { REFIT_CUDA_CHECK(cudaEventSynchronize(handle_)); }

float event::elapsed_ms(const event& start, const event& end) {
  float ms = 0;
  REFIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start.handle_, end.handle_));
  return ms;
}

}  // namespace refit::cuda
