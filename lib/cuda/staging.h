// Device-memory staging for the receive pipeline (lib/pipeline.h) and the
// processing wrapper that lets load_weights enqueue GPU work: what GPU engines
// (nccl, cuda_ipc) plug into the core's pipeline.
#pragma once

#include <vector>

#include "lib/cuda/event.h"
#include "lib/cuda/memory.h"
#include "lib/cuda/stream.h"
#include "lib/engine.h"
#include "lib/pipeline.h"

namespace refit::cuda {

/// `count` slots of `bytes` of device memory on the current device, allocated
/// once; the assembly buffer for split tensors grows on demand and is kept.
class device_staging final : public staging_memory {
 public:
  device_staging(std::size_t count, std::uint64_t bytes);
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

/// Enqueues copies of `pieces` (host or device memory, unified addressing) back to
/// back into device memory at `dst` on `s`, and completes when they are done,
/// without blocking the awaiting executor (the CUDA-to-asio bridge).
asio::awaitable<void> pack_pieces_async(std::span<const asio::const_buffer> pieces, std::byte* dst, const stream& s);

/// Wraps `load` so that it runs with `s` as the current processing stream
/// (lib/cuda/processing.h) on `s`'s device, then waits for `s` (an event per
/// processing thread) before returning: the pipeline reuses a staging slot only
/// after the GPU work that reads it. It waits on a processing thread, never on the
/// event loop; `s` must outlive the returned function.
load_weights_fn on_stream(load_weights_fn load, const stream& s);

}  // namespace refit::cuda
