// The worker base of the engines whose updates arrive as one stream per worker,
// from the trainer or, in a chain or tree, from the worker relaying to it (tcp,
// ucx): everything but how the buckets travel. It joins the trainer over the side
// channel (listening for its children in a relay topology, relay.h), allocates the
// staging once, joins its upstream worker and accepts its children, then per
// update takes the header for its subtree (relay_io.h), answers a delta offer
// (docs/delta.md) and records the version the weights then hold, confirms for the
// subtree, and after a failure tells its upstream why and closes everything.
// engine_base.h is the same for engines whose buckets cross no byte stream.
//
// An engine implements make_staging and receive_buckets, and may use the other
// hooks; close() is its one teardown (shutdown(), disconnect(), a failure, a
// refusal and a re-init all come to it).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/ip/tcp.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/delta_stream.h>
#include <refit/backend/engine.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>

namespace refit::links {

/// Worker init info of a stream engine: join_info's members plus "topology"
/// ("star" | "chain" | "tree:K"; optional, star by default: the trainer's
/// prepare() writes it). An engine's own init info derives from it and reads its
/// members after these.
struct stream_init_info : refit::init_info, join_info {
  links::topology topology;
  static stream_init_info read(json_reader& r);
};

/// One update as it reaches receive_buckets: its header accepted for the subtree
/// and a delta offer answered.
struct stream_update {
  const metadata_update_info& info;
  asio::ip::tcp::socket& upstream;          ///< what the buckets come from
  const std::vector<socket_ptr>& children;  ///< the children's side channels
  const std::vector<int>& child_ranks;
  const std::string& source;  ///< names this worker and what it reads from, for errors
  std::uint64_t seq = 0;
  bucket_plan plan;
  /// A delta update this worker can take (its buckets may arrive encoded when
  /// delta->accepted; each bucket's hash goes to delta->hashes); null otherwise.
  backend::delta_receive* delta = nullptr;
  /// Per child: its subtree took the deltas (it reads each bucket's form).
  std::vector<bool> child_took;
  load_weights_fn load_weights;
};

class stream_engine : public backend::engine {
 public:
  std::unique_ptr<update_info> parse_update_info(const json& j) const override;
  /// This worker's rank once initialised.
  int rank() const noexcept { return rank_; }
  /// The rank it receives from (0: the trainer) and those it forwards to.
  int upstream_rank() const noexcept { return position_.upstream; }
  const std::vector<int>& children() const noexcept { return position_.children; }
  /// The trainer's version of the weights this worker holds and its fingerprint
  /// (delta_fingerprint of the bytes that arrived), known after an update from a
  /// trainer with deltas on completed (docs/delta.md); a delta update is taken only
  /// against exactly this (and clean weights).
  std::optional<backend::held_version> held() const noexcept { return held_.held(); }
  /// Closes every connection now (to the trainer, upstream, children) and the
  /// transport: an update in flight fails, as do its upstream and children, and
  /// init_transfer_engine must run again. For a server that must cut refit off at
  /// once (and tests that stand a dead process in for it); unlike shutdown() it is
  /// allowed while buckets are still being processed.
  void disconnect() noexcept { close(); }

 protected:
  using backend::engine::engine;
  ~stream_engine() override { close(); }

  // ---- required
  /// Receive staging for `wire`, allocated once per init (on the processing
  /// executor).
  virtual std::unique_ptr<staging_memory> make_staging(const wire_params& wire) = 0;
  /// One update's buckets: the transport over `u`, through pipeline()->receive.
  virtual asio::awaitable<void> receive_buckets(stream_update& u) = 0;

  // ---- optional
  /// A side channel to the trainer, the upstream worker or a child just opened
  /// (e.g. size its buffers where it carries the bytes).
  virtual void opened(asio::ip::tcp::socket& /*socket*/) {}
  /// After the trainer's side channel joined, before the staging: e.g. load the
  /// transport (`info` is the engine's own init info).
  virtual asio::awaitable<void> joined(const stream_init_info& /*info*/) { co_return; }
  /// Whether the staging of an earlier init serves this one too (its wire params
  /// are the same; e.g. on the same device).
  virtual bool staging_serves(const staging_memory& /*staging*/) const { return true; }
  /// After the upstream worker joined and the children were accepted: e.g. make the
  /// transport's endpoints.
  virtual asio::awaitable<void> connected(const stream_init_info& /*info*/) { co_return; }
  /// Why this worker takes no deltas whatever it holds ("" when it may: the bytes
  /// decide).
  virtual std::string delta_refusal() const { return {}; }
  /// Releases the transport (before the side channels close).
  virtual void close_transport() noexcept {}

  // ---- callable
  /// Closes the transport, every connection and the relay listener; idempotent.
  /// An engine that overrides close_transport calls it from its destructor (the
  /// base's, which closes the connections, cannot call virtuals).
  void close() noexcept;
  std::string who() const { return std::string(backend()) + " worker rank " + std::to_string(rank_); }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// Null before the first init.
  receive_pipeline* pipeline() const noexcept { return pipeline_.get(); }
  /// Frees the staging (and the pipeline).
  void free_staging() noexcept { pipeline_.reset(); }
  /// Where the buckets come from: the upstream worker, else the trainer (null once
  /// closed).
  std::shared_ptr<asio::ip::tcp::socket> upstream() const { return upstream_ ? upstream_ : socket_; }
  /// The children's side channels, in children() order.
  const std::vector<socket_ptr>& child_sockets() const noexcept { return children_; }

 private:
  asio::awaitable<void> do_init(const refit::init_info& info) final;
  asio::awaitable<void> do_receive(const refit::update_info& info, load_weights_fn load_weights) final;
  void do_shutdown() final { close(); }
  void do_refuse_update(errc kind, const std::string& reason) noexcept final;
  void do_session_committed() final { held_.committed(); }
  void do_session_finished() final { held_.finished(weights_dirty()); }

  asio::awaitable<void> join_relay(const stream_init_info& info);
  asio::awaitable<void> receive_update(const metadata_update_info& info, load_weights_fn load_weights);
  // Answers a delta offer `d` (when it has a base) for this worker and, with
  // children, its subtree; fills `delta` and returns, per child, whether it took
  // the deltas.
  asio::awaitable<std::vector<bool>> answer_delta_offer(stream_update& u, const wire::delta_header& d,
                                                        const std::optional<backend::held_version>& held,
                                                        backend::delta_receive& delta);

  // Shared with an update in flight, so that closing them (disconnect, a failure)
  // never frees a socket a coroutine still reads.
  std::shared_ptr<asio::ip::tcp::socket> socket_;    // to the trainer (the data path in a star)
  std::shared_ptr<asio::ip::tcp::socket> upstream_;  // to the upstream worker (relay topologies)
  std::vector<socket_ptr> children_;                 // in position_.children order
  std::unique_ptr<asio::ip::tcp::acceptor> relay_;   // where children connect
  relay_position position_;
  std::unique_ptr<receive_pipeline> pipeline_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = -1;
  std::uint64_t last_seq_ = 0;
  backend::held_record held_;  // the version the model holds (deltas)
};

}  // namespace refit::links
