// Device-memory staging for the receive pipeline (lib/backend/pipeline.h), the batched
// copier GPU engines move pieces with, and the processing wrapper that lets
// load_weights enqueue GPU work: what GPU engines (nccl, cuda_ipc) plug into the
// core's pipeline. Everything here works on the device it was made for, whatever
// device is current on the calling thread (a worker for cuda:1 uses cuda:1).
#pragma once

#include <mutex>
#include <vector>

#include <refit/backend/pipeline.h>
#include <refit/cuda/event.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/cuda/unpack.h>
#include <refit/engine.h>

namespace refit::cuda {

/// The CUDA device index of `d` for an engine or trainer context: d.index for a
/// CUDA device; for the default (cpu) device, the device current on the calling
/// thread. Throws cuda_error.
[[nodiscard]] int device_index(const refit::device& d);

/// `count` slots of `bytes` of device memory on `device` (-1: the current one),
/// allocated once; the assembly buffer for split tensors grows on demand and is
/// kept (the pipeline grows it off the event loop, lib/backend/pipeline.h).
class device_staging final : public staging_memory {
 public:
  device_staging(std::size_t count, std::uint64_t bytes, int device = -1);
  refit::device device() const noexcept override { return refit::device::cuda(device_); }
  std::size_t slot_count() const noexcept override { return slots_.size(); }
  std::span<std::byte> slot(std::size_t index) override;
  std::span<std::byte> assembly(std::uint64_t bytes) override;
  std::uint64_t allocated_bytes() const noexcept override;

 private:
  std::uint64_t bytes_;
  int device_ = 0;
  std::vector<device_buffer> slots_;
  device_buffer assembly_;
};

/// Moves many pieces of memory on one stream of one device, in as few operations
/// as the memory allows: pieces of at least large_bytes one cudaMemcpyAsync each
/// (the copy engines), small pieces whose source the device can read (device or
/// managed memory) in one batched kernel launch (unpack.h), other small pieces
/// (pageable host memory) one cudaMemcpyAsync each. Thread-safe: engines of one
/// process share one per device.
class piece_copier {
 public:
  static constexpr std::uint64_t large_bytes = 1 << 20;

  explicit piece_copier(int device);
  int device() const noexcept { return device_; }
  const stream& get_stream() const noexcept { return stream_; }

  /// Makes the copies enqueued after this call wait for the work queued so far on
  /// `producer` (a cudaStream_t; nullptr is the legacy default stream), without
  /// blocking the host: a trainer's tensors are read only after the kernels that
  /// wrote them.
  void order_after(cudaStream_t producer);
  /// Enqueues the copies of `pieces` and returns. `sources_on_device`: every source
  /// is device memory (no per-piece pointer query). The memory must stay valid
  /// until the stream passes this point.
  void enqueue(std::span<const piece> pieces, bool sources_on_device);
  /// enqueue(), then completes when the copies are done (the CUDA-to-asio bridge:
  /// the awaiting executor is not blocked).
  asio::awaitable<void> copy(std::span<const piece> pieces, bool sources_on_device);
  /// Copies `pieces` (host or device memory) back to back into device memory at
  /// `dst`, as copy().
  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst);

 private:
  int device_;
  stream stream_;
  event producer_done_;
  std::mutex mutex_;  // unpacker_ and the enqueue order
  unpacker unpacker_;
  std::vector<piece> small_;
};

/// Wraps `load` so that it runs with `s` as the current processing stream
/// (lib/cuda/processing.h) and `s`'s device current (restored afterwards: the
/// processing thread may be the application's), then waits for `s` (an event per
/// processing thread and device) before returning, also when `load` throws (the
/// exception is rethrown after the wait): the pipeline reuses a staging slot only
/// after the GPU work that reads it. It waits on a processing thread,
/// never on the event loop; `s` must outlive the returned function.
load_weights_fn on_stream(load_weights_fn load, const stream& s);

}  // namespace refit::cuda
