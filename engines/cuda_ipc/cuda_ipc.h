// The CUDA IPC backend for colocated RL (trainer and inference on the same GPUs):
// the trainer exports num_buffers reusable packed buffers on its GPU and, per
// bucket, tells each worker which buffer holds it (its IPC handle, the GPU's UUID,
// the bucket's size) over the side channel (lib/backend/links). The worker opens each
// handle once (cached, keyed by handle and GPU UUID, so a worker that sees the GPU
// under another device index still finds it), copies the bucket into its staging
// slot and says "consumed"; only then may the trainer overwrite that buffer. The
// worker's processing (load_weights, on its own stream for CUDA) overlaps the next
// bucket's hand-over through the receive pipeline. Mappings stay open across
// sessions while the trainer offers the same buffers (handle_cache), and are closed
// on re-init, after a failure and at shutdown.
//
// The memory side is an ipc_provider: CUDA IPC in --config=cuda builds (registered
// as "cuda_ipc"), or in-process host memory, with which the whole engine runs on CPU
// in the conformance suite.
#pragma once

#include <array>
#include <map>
#include <memory>

#include <refit/backend/engine.h>
#include <refit/backend/links/engine_base.h>

namespace refit::cuda_ipc {

/// An exported buffer's handle: CUDA's 64-byte cudaIpcMemHandle_t, or the host
/// provider's id.
using handle_bytes = std::array<std::byte, 64>;
/// The GPU's UUID (cudaDeviceProp::uuid), the same in every process.
using gpu_uuid = std::array<std::byte, 16>;

/// One copy of a batch: `bytes` from `src` (mapped) to `dst` (staging or a model's
/// memory).
struct copy_piece {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t bytes = 0;
};

/// Memory that can be shared between processes on one GPU.
class ipc_provider {
 public:
  virtual ~ipc_provider() = default;
  virtual std::string name() const = 0;
  /// `count` exportable buffers of `bytes` (the trainer's packed buffers) on the
  /// current device.
  virtual std::unique_ptr<staging_memory> make_exportable(std::size_t count, std::uint64_t bytes) = 0;
  /// The handle of buffer `index` of `memory` (made by make_exportable) and its GPU.
  virtual std::pair<handle_bytes, gpu_uuid> export_buffer(staging_memory& memory, std::size_t index) = 0;
  /// Maps another process's buffer; invalid_argument naming what is wrong when the
  /// handle is not valid here (no such GPU, stale or foreign handle).
  virtual std::byte* open(const handle_bytes& handle, const gpu_uuid& gpu) = 0;
  /// Unmaps what open() returned.
  virtual void close(std::byte* mapped) noexcept = 0;
  /// Every copy of `pieces` (mapped memory into staging or a model's memory), in as
  /// few operations as the memory allows (many small tensors: one batched kernel on
  /// CUDA); completes when all are done.
  virtual asio::awaitable<void> copy_batch(std::span<const copy_piece> pieces) = 0;
  /// The UUID of `device` as this process sees it (all zeros for host memory).
  virtual gpu_uuid uuid_of(const refit::device& device) = 0;
  /// Orders the reads of later pack() calls after the work queued so far on the
  /// trainer's `native_stream` (trainer_context::native_stream). Default: nothing
  /// (host memory is written synchronously).
  virtual void order_after(const void* /*native_stream*/) {}
  /// Packs the trainer's pieces into `dst` (exportable memory); completes when done.
  virtual asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) = 0;
  /// The worker's receive staging.
  virtual std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) = 0;
  virtual bool device_sources() const noexcept = 0;
  /// Wraps load_weights for this memory (see nccl::collective_provider::processing).
  virtual load_weights_fn processing(load_weights_fn load) { return load; }
};

/// In-process host memory "shared" by handle: every process is this one (tests).
std::shared_ptr<ipc_provider> host_ipc();

/// A worker's cache of opened handles: each is opened once and stays mapped across
/// update sessions while the trainer keeps offering it (the same allocation always
/// has the same handle; a new allocation, even at the same address, a new one), so
/// an update pays for no opens once the trainer's memory is mapped. end_session()
/// closes the mappings the ending session did not use (the trainer freed or
/// replaced that memory), so at most one session's worth of stale mappings is held;
/// clear() closes all (re-init, failure, shutdown).
class handle_cache {
 public:
  explicit handle_cache(std::shared_ptr<ipc_provider> provider) : provider_(std::move(provider)) {}
  ~handle_cache() { clear(); }
  handle_cache(const handle_cache&) = delete;
  handle_cache& operator=(const handle_cache&) = delete;
  /// The mapping of `handle`, opened now if it is not mapped yet (opening takes
  /// milliseconds: engines call this off the event loop when find() misses).
  std::byte* get(const handle_bytes& handle, const gpu_uuid& gpu);
  /// The mapping of `handle` if it is mapped (counted as used), else nullptr.
  std::byte* find(const handle_bytes& handle, const gpu_uuid& gpu) noexcept;
  /// Closes the mappings not asked for (get) since the last end_session().
  void end_session() noexcept;
  void clear() noexcept;
  std::size_t size() const noexcept { return mapped_.size(); }
  /// How many times a handle was opened (not served from the cache), ever.
  std::uint64_t opens() const noexcept { return opens_; }

 private:
  struct mapping {
    std::byte* address = nullptr;
    std::uint64_t used = 0;  // the session that last asked for it
  };
  std::shared_ptr<ipc_provider> provider_;
  std::map<std::pair<handle_bytes, gpu_uuid>, mapping> mapped_;
  std::uint64_t opens_ = 0;
  std::uint64_t session_ = 1;
};

/// Worker init info: links::join_info (checksums refused: the bytes never leave
/// the GPU's memory).
using init_info = links::stream_free_init_info;
using update_info = metadata_update_info;

/// Worker side: each bucket is copied out of the trainer's exported buffer.
class engine final : public links::worker_engine {
 public:
  engine(const weight_transfer_config& config, const engine_context& context, std::shared_ptr<ipc_provider> provider);
  ~engine() override { close(); }
  std::string_view backend() const noexcept override { return "cuda_ipc"; }
  /// The trainer's device buffers mapped by IPC and copied from (no direct
  /// receive, no staged commit); processing deferred; needs a GPU.
  static engine_capabilities capabilities_of() {
    return {.device_memory = true, .defers_processing = true, .needs_gpu = true};
  }
  /// Mappings currently open (for tests and weight_info).
  const handle_cache& handles() const noexcept { return *handles_; }

 protected:
  std::unique_ptr<staging_memory> make_staging(const wire_params& wire) override {
    return provider_->make_staging(wire.num_buffers, wire.buffer_bytes);
  }
  std::unique_ptr<bucket_transport> make_transport() override;
  load_weights_fn wrap(load_weights_fn load) override { return provider_->processing(std::move(load)); }
  void close_transport() noexcept override { handles_->clear(); }
  void do_session_finished() override { handles_->end_session(); }

 private:
  std::shared_ptr<ipc_provider> provider_;
  std::unique_ptr<handle_cache> handles_;
};

/// Trainer side; trainer_args as links::trainer_args (checksums refused).
class sender final : public links::sender_base {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context, std::shared_ptr<ipc_provider> provider);
  ~sender() override { shutdown(); }
  std::string_view backend() const noexcept override { return "cuda_ipc"; }
  /// The trainer's device buffers mapped by IPC and copied from (no direct
  /// receive, no staged commit); processing deferred; needs a GPU.
  static engine_capabilities capabilities_of() {
    return {.device_memory = true, .defers_processing = true, .needs_gpu = true};
  }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;

 protected:
  void prepared() override;

 private:
  std::shared_ptr<ipc_provider> provider_;
  std::unique_ptr<staging_memory> buffers_;  // exported, rotating; live as long as the sender
};

}  // namespace refit::cuda_ipc
