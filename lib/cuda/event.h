// An owned CUDA event.
#pragma once

#include <cuda_runtime_api.h>

namespace refit::cuda {

class stream;

/// A CUDA event, destroyed with the object. Move-only. By default it records no
/// timestamps (cudaEventDisableTiming), the cheap kind for ordering streams and
/// polling completion; event::timing() makes one for elapsed_ms.
class event {
 public:
  /// cudaEventCreateWithFlags(flags). Throws cuda_error.
  explicit event(unsigned flags = cudaEventDisableTiming);
  /// An event that records timestamps.
  [[nodiscard]] static event timing() { return event(cudaEventDefault); }
  /// An event of `device`, whatever device is current (left as it was). Events are
  /// recorded only on streams of their own device.
  [[nodiscard]] static event on(int device, unsigned flags = cudaEventDisableTiming);
  ~event();

  event(event&& other) noexcept;
  event& operator=(event&& other) noexcept;
  event(const event&) = delete;
  event& operator=(const event&) = delete;

  [[nodiscard]] cudaEvent_t get() const noexcept { return handle_; }

  /// Captures the work queued on `s` so far; query/synchronize/wait then refer to
  /// it. Recording again replaces the captured work.
  void record(const stream& s);
  void record(cudaStream_t s);
  /// True when the captured work has completed (also when never recorded), false
  /// while it runs; throws cuda_error for an asynchronous error.
  [[nodiscard]] bool query() const;
  /// Blocks the calling thread until the captured work completes.
  void synchronize() const;
  /// Milliseconds between two completed timing events.
  [[nodiscard]] static float elapsed_ms(const event& start, const event& end);

 private:
  cudaEvent_t handle_ = nullptr;
};

}  // namespace refit::cuda
