// The NCCL backend: the trainer (rank 0) broadcasts each bucket to every worker on
// a communicator, while a side channel per worker (lib/group: authenticated
// rendezvous that ships the communicator id, per-update header check, confirmation)
// makes a metadata mismatch an error on both sides before any collective starts:
// mismatched collectives hang, refit refuses them.
//
// Workers receive each bucket into a staging slot while earlier buckets are
// processed (lib/pipeline). The communicator comes from a collective_provider:
// NCCL on GPUs (--config=cuda), or the in-process host collective, with which the
// whole engine runs on CPU in the conformance suite.
#pragma once

#include <memory>
#include <vector>

#include <asio/ip/tcp.hpp>

#include "engines/nccl/collective.h"
#include "lib/engine.h"
#include "lib/group/group.h"
#include "lib/pipeline.h"
#include "lib/trainer.h"

namespace refit::nccl {

/// Worker init info, as vLLM's NCCL engine's plus the trainer's wire parameters
/// (see group::join_info). Checksums are not offered: a collective has no byte
/// stream to checksum on the way.
struct init_info final : refit::init_info, group::join_info {
  static init_info read(json_reader& r);
};

using update_info = metadata_update_info;

/// Worker side.
class engine final : public typed_engine<init_info, update_info> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context,
         std::shared_ptr<collective_provider> provider);
  ~engine() override;
  std::string_view backend() const noexcept override { return "nccl"; }
  bool defers_processing() const noexcept override { return true; }
  int rank() const noexcept { return rank_; }

 protected:
  asio::awaitable<void> init(const init_info& info) override;
  asio::awaitable<void> receive(const update_info& info, load_weights_fn load_weights) override;
  void do_shutdown() override;

 private:
  std::shared_ptr<collective_provider> provider_;
  std::unique_ptr<asio::ip::tcp::socket> socket_;  // side channel to the trainer
  std::shared_ptr<collective> comm_;               // shared with a receive in flight
  std::unique_ptr<receive_pipeline> pipeline_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = -1;
  std::uint64_t last_seq_ = 0;
};

/// Trainer side. trainer_args as group::trainer_args ("checksums" refused).
class sender final : public weight_sender {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context,
         std::shared_ptr<collective_provider> provider);
  ~sender() override;
  std::string_view backend() const noexcept override { return "nccl"; }
  json prepare(const json& trainer_args) override;
  asio::awaitable<void> connect_workers() override;
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;
  void shutdown() override;
  update_stats last_send_stats() const override { return stats_; }

 private:
  void fail_all();

  weight_transfer_config config_;
  trainer_context context_;
  std::shared_ptr<collective_provider> provider_;
  group::trainer_args args_;
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  std::string group_id_;
  std::vector<group::member> peers_;
  std::shared_ptr<collective> comm_;  // shared with a send in flight (shutdown aborts it)
  std::unique_ptr<staging_memory> pack_;  // num_buffers rotating packing buffers
  std::uint64_t seq_ = 0;
  update_stats stats_;
};

}  // namespace refit::nccl
