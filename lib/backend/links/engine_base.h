// Bases for group engines whose buckets travel outside the side channel (a
// collective, IPC buffers): everything but the bucket transport. The worker base
// joins through the side channel, allocates staging once, checks each update's
// header, runs the receive pipeline and confirms, and closes everything after a
// failure; the trainer base listens, welcomes the workers and closes everything
// after a failure. Engines (nccl, cuda_ipc; ucx's trainer) add the transport
// through the hooks. The worker base of engines whose buckets do cross a stream
// (tcp, ucx) is stream_engine.h, which shares the steps declared first below.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/ip/tcp.hpp>

#include <refit/backend/engine.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit::links {

/// Worker init info for engines whose bytes never cross a byte stream: checksums
/// are refused (nothing on the way to checksum).
struct stream_free_init_info final : refit::init_info, join_info {
  static stream_free_init_info read(json_reader& r);
};

/// What both worker bases (worker_engine here, stream_engine) do alike.
/// invalid_state naming `who` unless the worker is `connected` (an earlier failure
/// closed its connection to the trainer).
void check_connected(bool connected, const std::string& who);
/// Keeps `pipeline` when it was made for `wire` and `serves` (its staging fits this
/// init too); else frees it first (peak memory is one set of staging) and makes a
/// new one over the staging `make` allocates on `processing` (allocating and
/// faulting it in, or a cudaMalloc, is no work for the event loop).
asio::awaitable<void> ensure_staging(std::unique_ptr<receive_pipeline>& pipeline, wire_params wire, bool serves,
                                     asio::any_io_executor executor, asio::any_io_executor processing,
                                     std::function<std::unique_ptr<staging_memory>(const wire_params&)> make);
/// Starts links::refuse_update of update `seq` on `socket` (nothing when null)
/// in the background on `executor`, lingering at most 2 s; never throws (if it
/// cannot start, the trainer fails at its deadline).
void refuse_upstream(asio::any_io_executor executor, std::shared_ptr<asio::ip::tcp::socket> socket, std::uint64_t seq,
                     errc kind, const std::string& reason, std::chrono::milliseconds timeout,
                     const std::string& who) noexcept;

class worker_engine : public backend::typed_engine<stream_free_init_info, metadata_update_info> {
 public:
  using typed_engine::typed_engine;
  int rank() const noexcept { return rank_; }
  /// Refused when the staging is device memory (nccl, cuda_ipc on GPUs).
  std::string staged_commit_refusal() const override;

 protected:
  /// After the side channel joined: e.g. join a communicator named in `welcome`.
  virtual asio::awaitable<void> joined(const stream_free_init_info& /*info*/, const std::string& /*welcome*/) {
    co_return;
  }
  /// Receive staging for `wire`, allocated once per init.
  virtual std::unique_ptr<staging_memory> make_staging(const wire_params& wire) = 0;
  /// The transport of one update.
  virtual std::unique_ptr<bucket_transport> make_transport() = 0;
  /// load_weights as the memory needs it (e.g. on a processing stream).
  virtual load_weights_fn wrap(load_weights_fn load) { return load; }
  /// Releases the transport's resources (abort a communicator, close mappings).
  virtual void close_transport() noexcept {}
  /// Completes when what close_transport() started has finished (an abort that
  /// runs on a thread of its own), so staging may be reused or freed. Awaited after
  /// a failed update and before a re-init joins again.
  virtual asio::awaitable<void> transport_closed() { co_return; }
  /// Call from the derived destructor (the base cannot call virtuals there).
  void close() noexcept;

  std::string who() const { return std::string(backend()) + " worker rank " + std::to_string(rank_); }
  asio::ip::tcp::socket& side_channel() { return *socket_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const wire_params& wire() const { return pipeline_->params(); }

 private:
  asio::awaitable<void> init(const stream_free_init_info& info) final;
  asio::awaitable<void> receive(const metadata_update_info& info, load_weights_fn load_weights) final;
  void do_shutdown() final { close(); }
  void do_refuse_update(errc kind, const std::string& reason) noexcept final;

  std::unique_ptr<asio::ip::tcp::socket> socket_;
  std::unique_ptr<receive_pipeline> pipeline_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = -1;
  std::uint64_t last_seq_ = 0;
};

class sender_base : public weight_sender {
 public:
  sender_base(const weight_transfer_config& config, const trainer_context& context);
  json prepare(const json& trainer_args) final;
  asio::awaitable<void> connect_workers() final;
  void shutdown() final;
  update_stats last_send_stats() const override { return stats_; }
  /// Keeps send_options::producer_stream for the next send (deltas are refused as
  /// weight_sender's).
  void set_next_send(const send_options& options) override;

 protected:
  /// The stream the tensors of the send starting now were written on: the one
  /// set_next_send gave for it, else trainer_context::native_stream. Call once at
  /// the start of each send_weights (the next send falls back to the context's).
  const void* take_producer_stream() noexcept;
  /// After the trainer args were read (and checksums refused), before listening:
  /// check what the engine's own args allow, allocate buffers.
  virtual void prepared() {}
  /// Whether the engine relays (trainer_args' "topology": "star", "chain",
  /// "tree:K" is read, default relay.h's default_for; peers_ are then the
  /// trainer's direct children only) and verifies checksums ("checksums": true is
  /// accepted). Both false by default: the args refuse them.
  virtual bool relays() const noexcept { return false; }
  virtual bool verifies_checksums() const noexcept { return false; }
  /// Whether the engine sends delta updates (trainer_args' "delta": bool is read
  /// into delta_; docs/delta.md). False by default: the args refuse "delta".
  virtual bool sends_deltas() const noexcept { return false; }
  /// What each worker's welcome carries (e.g. a communicator id).
  virtual std::string welcome() { return {}; }
  /// After every worker joined: e.g. join the communicator.
  virtual asio::awaitable<void> connected() { co_return; }
  /// Releases the transport (e.g. aborts the communicator); then the side
  /// channels are closed. Call close() from the derived destructor.
  virtual void close_transport() noexcept {}
  /// As worker_engine::transport_closed.
  virtual asio::awaitable<void> transport_closed() { co_return; }
  void close() noexcept;
  /// close(), then waits for transport_closed(): the failure path of a send.
  asio::awaitable<void> close_after_failure();

  std::string rank_name(int rank) const {
    return std::string(backend()) + " trainer: worker rank " + std::to_string(rank);
  }
  /// Announces the update header to every worker at once.
  asio::awaitable<void> announce_all(const std::vector<member>& peers, std::array<std::byte, 48> header);
  /// Waits for every worker's confirmation of update `seq`.
  asio::awaitable<void> confirm_all(const std::vector<member>& peers, std::uint64_t seq);
  /// Common checks at the start of send_weights: returns the update's plan and
  /// sequence number.
  std::pair<bucket_plan, std::uint64_t> begin_update(const update_metadata& declared);
  void end_update(const update_metadata& declared, const bucket_plan& plan,
                  std::chrono::steady_clock::time_point start);

  weight_transfer_config config_;
  trainer_context context_;
  trainer_args args_;
  topology topology_;            ///< star unless relays()
  bool delta_ = false;           ///< trainer_args' "delta" (sends_deltas())
  std::uint64_t delta_max_ = 0;  ///< trainer_args' "delta_max_bytes" (0: no bound)
  std::vector<member> peers_;    ///< the workers the trainer sends to (in a relay: its children)
  std::vector<member> relayed_;  ///< the others' side channels (relay topologies), kept open
  update_stats stats_;

 private:
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  std::uint64_t seq_ = 0;
  std::optional<const void*> next_producer_;  // set_next_send's, for the next send only
};

}  // namespace refit::links
