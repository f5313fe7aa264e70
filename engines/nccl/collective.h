// What the NCCL engine needs of a communicator, behind an interface so the whole
// engine (rendezvous, update checks, pipeline, failure handling) runs on CPU in the
// conformance suite with an in-process host collective, and on GPUs with NCCL
// (--config=cuda) unchanged.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>

#include <refit/backend/pipeline.h>

namespace refit::nccl {

/// One point-to-point transfer of a grouped exchange.
struct p2p_op {
  enum class kind : std::uint8_t { send, recv };
  kind type = kind::send;
  int peer = 0;
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

/// One rank's membership of a group: rank 0 (the trainer) broadcasts each bucket
/// to every rank; sharded transfers exchange point to point.
class collective {
 public:
  virtual ~collective() = default;
  /// Broadcasts `bytes` at `data` from rank 0 into `data` on every other rank.
  /// Every rank calls it with the same sizes in the same order. Completes when this
  /// rank's part is done (on rank 0: the bytes may be reused). A rank that does not
  /// take part within `deadline` makes it a timeout, after which the communicator
  /// is aborted and every later call fails.
  virtual asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds deadline) = 0;
  /// Runs `ops` as one group (NCCL: ncclGroupStart, ncclSend/ncclRecv, ncclGroupEnd):
  /// every send is matched by its peer's receive of the same size, in the order
  /// each pair issues them; completes when all of this rank's ops are done.
  /// Deadline and abort as for broadcast.
  virtual asio::awaitable<void> exchange(std::span<const p2p_op> ops, std::chrono::milliseconds deadline) = 0;
  /// Aborts outstanding and later operations of this rank; others fail too.
  /// Returns at once: whatever blocks (ncclCommAbort does, even for non-blocking
  /// communicators) runs on a thread of its own, never on the caller's event loop.
  virtual void abort() noexcept = 0;
  /// Completes once every abort() started so far has finished and the memory
  /// the aborted operations used may be reused or freed (NCCL: ncclCommAbort has
  /// returned and the communication stream is drained). Default: at once.
  virtual asio::awaitable<void> aborted() { co_return; }
};

/// Makes communicators and the memory they move bytes in (host for the host
/// collective, device memory for NCCL).
class collective_provider {
 public:
  virtual ~collective_provider() = default;
  /// "nccl" or "host"; shown in messages.
  virtual std::string name() const = 0;
  /// A new group id, made by rank 0 and handed to the other ranks in the
  /// rendezvous welcome (printable text, at most 4096 bytes).
  virtual std::string new_group_id() = 0;
  /// Joins group `id` as `rank` of `world_size`; every rank must join within
  /// `deadline` (timeout otherwise).
  virtual asio::awaitable<std::unique_ptr<collective>> join(std::string id, int rank, int world_size,
                                                            asio::any_io_executor executor,
                                                            std::chrono::milliseconds deadline) = 0;
  /// `count` buffers of `bytes` in the communicator's memory: receive staging on
  /// workers, packing buffers on the trainer.
  virtual std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) = 0;
  /// Orders the reads of later pack() calls after the work queued so far on the
  /// trainer's `native_stream` (trainer_context::native_stream). Default: nothing
  /// (host memory is written synchronously).
  virtual void order_after(const void* /*native_stream*/) {}
  /// Copies `pieces` (the trainer's tensors and padding, in order) back to back
  /// into `dst` (memory of make_staging); completes when `dst` may be broadcast.
  virtual asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) = 0;
  /// Whether the trainer's tensors may live on a device (NCCL) or must be host
  /// memory (host collective).
  virtual bool device_sources() const noexcept = 0;
  /// Wraps a worker's load_weights for this memory: for NCCL, load_weights runs
  /// with a processing stream current (lib/cuda/processing.h) and the wrapper waits
  /// for that stream before returning, so the staging slot is reused only after the
  /// GPU work that reads it. The host collective returns `load` as is.
  virtual load_weights_fn processing(load_weights_fn load) { return load; }
};

/// The in-process host collective: every rank lives in this process and runs on one
/// executor (tests, and single-process setups). Bytes are copied in host memory.
std::shared_ptr<collective_provider> host_collectives();

}  // namespace refit::nccl
