// An owned CUDA stream.
#pragma once

#include <cuda_runtime_api.h>

namespace refit::cuda {

class event;

/// A non-blocking CUDA stream (it does not synchronise with the legacy default
/// stream), created on the device current at construction, destroyed with the
/// object. Move-only. Work still queued when it is destroyed completes normally
/// (cudaStreamDestroy does not wait for it).
class stream {
 public:
  /// Priority 0, the default. Throws cuda_error.
  stream();
  /// A stream of `priority`: lower numbers run first; the valid range is
  /// priority_range(), and values outside it are clamped by CUDA.
  explicit stream(int priority);
  /// A priority-0 stream of `device`, whatever device is current (left as it was).
  [[nodiscard]] static stream on(int device);
  ~stream();

  stream(stream&& other) noexcept;
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  /// {least, greatest}: the numerically largest (lowest) and smallest (highest)
  /// priorities of the current device, e.g. {0, -5}.
  struct priorities {
    int least = 0;
    int greatest = 0;
  };
  [[nodiscard]] static priorities priority_range();

  /// The handle, for CUDA calls and kernel launches; null after a move.
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_; }
  /// The device the stream belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] int priority() const noexcept { return priority_; }

  /// Makes later work on this stream wait until `e` (as last recorded) completes,
  /// without blocking the host (cudaStreamWaitEvent).
  void wait(const event& e) const;
  /// True when all work queued so far has completed, false while some is running;
  /// throws cuda_error for an asynchronous error reported by the stream.
  [[nodiscard]] bool query() const;
  /// Blocks the calling thread until all queued work completes. For coroutines, see
  /// lib/cuda/await.h instead.
  void synchronize() const;

 private:
  cudaStream_t handle_ = nullptr;
  int device_ = 0;
  int priority_ = 0;
};

}  // namespace refit::cuda
