// The NCCL backend: the trainer (rank 0) broadcasts each bucket to every worker on
// a communicator, while a side channel per worker (lib/backend/links: authenticated
// rendezvous that ships the communicator id, per-update header check, confirmation)
// makes a metadata mismatch an error on both sides before any collective starts:
// mismatched collectives hang, refit refuses them.
//
// Workers receive each bucket into a staging slot while earlier buckets are
// processed (lib/backend/pipeline.h). The communicator comes from a collective_provider:
// NCCL on GPUs (--config=cuda), or the in-process host collective, with which the
// whole engine runs on CPU in the conformance suite.
#pragma once

#include <memory>

#include <refit/backend/engine.h>
#include <refit/backend/links/engine_base.h>
#include <refit/engines/nccl/collective.h>

namespace refit::nccl {

/// Worker init info, as vLLM's NCCL engine's plus the trainer's wire parameters
/// (links::join_info; checksums refused: a collective has no byte stream).
using init_info = links::stream_free_init_info;
using update_info = metadata_update_info;

/// Worker side: each bucket is one broadcast into a staging slot.
class engine final : public links::worker_engine {
 public:
  engine(const weight_transfer_config& config, const engine_context& context,
         std::shared_ptr<collective_provider> provider);
  ~engine() override { close(); }
  std::string_view backend() const noexcept override { return "nccl"; }
  /// A broadcast into device staging (one buffer per bucket, then copied: no
  /// direct receive, no staged commit); processing deferred; needs a GPU.
  static engine_capabilities capabilities_of() {
    return {.device_memory = true, .defers_processing = true, .needs_gpu = true};
  }

 protected:
  asio::awaitable<void> joined(const init_info& info, const std::string& welcome) override;
  std::unique_ptr<staging_memory> make_staging(const wire_params& wire) override;
  std::unique_ptr<bucket_transport> make_transport() override;
  load_weights_fn wrap(load_weights_fn load) override { return provider_->processing(std::move(load)); }
  void close_transport() noexcept override;
  asio::awaitable<void> transport_closed() override;

 private:
  std::shared_ptr<collective_provider> provider_;
  std::shared_ptr<collective> comm_;      // shared with a receive in flight
  std::shared_ptr<collective> aborting_;  // closed, its abort maybe still running
};

/// Trainer side. trainer_args as links::trainer_args ("checksums" refused). With
/// num_buffers >= 2, bucket k+1 is packed into the next buffer while bucket k is
/// broadcast; the trainer's tensors are read only after the work queued on
/// trainer_context::native_stream when the send starts.
class sender final : public links::sender_base {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context,
         std::shared_ptr<collective_provider> provider);
  ~sender() override { shutdown(); }
  std::string_view backend() const noexcept override { return "nccl"; }
  /// A broadcast into device staging (one buffer per bucket, then copied: no
  /// direct receive, no staged commit); processing deferred; needs a GPU.
  static engine_capabilities capabilities_of() {
    return {.device_memory = true, .defers_processing = true, .needs_gpu = true};
  }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;

 protected:
  void prepared() override;
  std::string welcome() override { return group_id_; }
  asio::awaitable<void> connected() override;
  void close_transport() noexcept override;
  asio::awaitable<void> transport_closed() override;

 private:
  std::shared_ptr<collective_provider> provider_;
  std::string group_id_;
  std::shared_ptr<collective> comm_;      // shared with a send in flight (shutdown aborts it)
  std::shared_ptr<collective> aborting_;  // closed, its abort maybe still running
  std::unique_ptr<staging_memory> pack_;  // num_buffers rotating packing buffers
};

}  // namespace refit::nccl
