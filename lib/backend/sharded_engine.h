// The bases of the sharded engines (M trainer ranks to N workers on one transfer
// plan, docs/sharded.md: tcp_sharded, ucx_sharded): everything but how a pair's
// frames travel. The worker base joins every trainer rank over the side channel,
// places its tensors for each update, runs every pair at once and loads the
// update, and closes everything after a failure; the trainer rank's base listens,
// accepts every worker, plans each update and walks its local shards, and closes
// everything after a failure. sharded.h holds the steps they are made of.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/ip/tcp.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/engine.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/shard_io.h>
#include <refit/backend/sharded.h>
#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit::backend {

/// Worker init info of a sharded engine: sharded_join_info's members ({"trainers":
/// [{"address", "port"}, ...] (rank order), "workers", "rank_offset",
/// "buffer_bytes", "num_buffers", "checksums", "timeout_ms"}). An engine's own
/// init info derives from it and reads its members after these.
struct sharded_init_info : refit::init_info, sharded_join_info {
  static sharded_init_info read(json_reader& r);
};

/// A frame's runs as asio buffers (Buffer: asio::const_buffer or
/// asio::mutable_buffer), for gather writes and scatter reads.
template <class Buffer>
std::vector<Buffer> buffers_of(const stream_frame& f) {
  std::vector<Buffer> out;
  out.reserve(f.runs.size());
  for (const auto& r : f.runs) out.emplace_back(r.data, r.bytes);
  return out;
}

/// One update as it reaches sharded_worker_base::receive_pairs: where this worker's
/// tensors land (placed.bases; staged: the stage, whose current bytes are in
/// placed.current).
struct sharded_update {
  const sharded_update_info& info;
  std::shared_ptr<const sharded_layouts> layouts;
  sharded_destination placed;
  bool staged = false;
};

class sharded_worker_base : public engine {
 public:
  /// Needs the worker's number, so only after init_transfer_engine.
  std::unique_ptr<refit::update_info> parse_update_info(const json& j) const final;
  /// This worker's number among the destinations (after init).
  int worker() const noexcept { return worker_; }
  /// Closes every connection (and the transport) now: an update in flight fails.
  void disconnect() noexcept { close(); }

 protected:
  using engine::engine;
  ~sharded_worker_base() override { close(); }

  // ---- required
  /// One update's pairs, every one at once (all_pairs); returns the bytes that
  /// came over the wire. On a failure the base closes everything.
  virtual asio::awaitable<std::uint64_t> receive_pairs(const sharded_update& u) = 0;

  // ---- optional
  /// Before the trainer ranks are joined: e.g. make the transport's worker.
  virtual asio::awaitable<void> joining(const sharded_init_info& /*info*/) { co_return; }
  /// Trainer rank `rank`'s side channel joined: e.g. size its buffers, offer the
  /// transport's address there. Runs for every rank at once.
  virtual asio::awaitable<void> joined_rank(const sharded_init_info& /*info*/, int /*rank*/,
                                            asio::ip::tcp::socket& /*socket*/) {
    co_return;
  }
  /// After the update was loaded (load_weights saw every tensor).
  virtual void loaded() {}
  /// Releases the transport (after the side channels closed).
  virtual void close_transport() noexcept {}

  // ---- callable
  /// Closes every side channel and the transport; idempotent. An engine that
  /// overrides close_transport calls it from its destructor (the base's, which
  /// closes the side channels, cannot call virtuals).
  void close() noexcept;
  std::string who() const { return std::string(backend()) + " worker " + std::to_string(worker_); }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const wire_params& wire() const noexcept { return wire_; }
  /// The side channels, by trainer rank (empty once closed).
  const std::vector<std::shared_ptr<asio::ip::tcp::socket>>& sockets() const noexcept { return sockets_; }
  /// Pair (rank, this worker)'s frames over this worker's tensors at `bases`,
  /// made on the processing executor (a row-parallel shard is one run per row).
  asio::awaitable<std::vector<stream_frame>> pair_frames(const sharded_layouts& layouts, int rank,
                                                         const std::vector<std::byte*>& bases);
  /// Reads pair `rank`'s update header from `socket` and answers it: refused (the
  /// rank told why, protocol_error thrown) when its plan digest (a layout that
  /// differs between the sides), sequence or size (`frames` frames) is not what
  /// this worker expects, or its flags: with `delta`, a header flagged
  /// update_flag_delta brings a delta header, read into it; without, any flag is
  /// refused. Returns the update's sequence number. `me` names the pair.
  asio::awaitable<std::uint64_t> accept_pair(asio::ip::tcp::socket& socket, int rank, const sharded_layouts& layouts,
                                             std::uint64_t frames, std::string me,
                                             std::optional<links::wire::delta_header>* delta = nullptr);
  /// The update's first bytes land now: tells the model once per update.
  void direct_write_begins();
  /// Runs `pairs` (pairs[r] fed by trainer rank r) at once: run_pairs.
  asio::awaitable<void> all_pairs(std::vector<asio::awaitable<void>> pairs);
  /// Every rank hears why this worker fails (before its deadline); never throws.
  asio::awaitable<void> tell_all(std::exception_ptr failure);

 private:
  asio::awaitable<void> do_init(const refit::init_info& info) final;
  asio::awaitable<void> do_receive(const refit::update_info& info, load_weights_fn load_weights) final;
  void do_shutdown() final { close(); }
  void do_refuse_update(errc kind, const std::string& reason) noexcept final;

  std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets_;  // by trainer rank
  std::vector<std::uint64_t> last_seq_;
  mutable layout_cache layouts_;
  wire_params wire_;
  std::chrono::milliseconds timeout_{0};
  // Set by init only (parse_update_info reads them, possibly off the loop).
  int worker_ = -1, workers_ = 0, trainers_ = 0;
  // Host memory for tensors the model offers no destination for (kept across
  // updates; load_weights copies from it).
  std::vector<std::byte> fallback_;
  model_target* direct_target_ = nullptr;  // to tell when the update's first bytes land
};

/// One update as it reaches sharded_sender_base::send_pairs: this rank's plan and
/// shards (`local`, their memory at `bases`, checked).
struct sharded_send {
  std::shared_ptr<const sharded_layouts> layouts;
  const update_metadata& local;
  const std::vector<std::byte*>& bases;
  std::uint64_t seq = 0;
};

class sharded_sender_base : public weight_sender {
 public:
  /// Listens on this rank's address; returns the workers' init info.
  json prepare(const json& trainer_args) final;
  /// Accepts every worker, then connected().
  asio::awaitable<void> connect_workers() final;
  /// `declared` is the GLOBAL metadata (what the workers' update_info carries);
  /// `source` yields this rank's local shards in the same order, each checked
  /// against the shape its placement gives it.
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) final;
  void shutdown() final;
  update_stats last_send_stats() const final { return stats_; }
  /// Bytes this rank sent each worker in the last update.
  const std::vector<std::uint64_t>& last_bytes_per_worker() const noexcept { return sent_; }
  /// Seconds the last update spent planning (about 0 when the plan was cached).
  double last_plan_seconds() const noexcept { return plan_s_; }
  int rank() const noexcept { return args_.rank; }

 protected:
  sharded_sender_base(const weight_transfer_config& config, const trainer_context& context);
  /// Joins the pool (the derived destructor calls shutdown() first).
  ~sharded_sender_base() override;

  // ---- required
  /// Every worker joined (`members`, by rank: worker number rank - 1): e.g. make
  /// the transport to each. On a failure the base closes everything.
  virtual asio::awaitable<void> connected(std::vector<links::member> members) = 0;
  /// One update's pairs to every worker at once. On a failure the base closes
  /// everything (the workers fail at once; init again before the next update).
  virtual asio::awaitable<void> send_pairs(const sharded_send& s) = 0;
  /// Closes the connections to the workers (the engine holds them) and the
  /// transport; idempotent.
  virtual void close_transport() noexcept = 0;

  // ---- optional
  /// Reads the engine's own trainer_args members (before they are checked for
  /// unknown ones); returns what applies them once prepare goes ahead (empty:
  /// nothing).
  virtual std::function<void()> read_args(json_reader& /*r*/) { return {}; }
  /// How many threads pool() has (made at the first prepare): planning, and the
  /// engine's own work.
  virtual unsigned pool_threads() const { return 1; }
  /// A send begins, before anything is checked: e.g. take set_next_send's choice,
  /// which holds for this send whatever becomes of it.
  virtual void send_begins() {}

  // ---- callable
  void close() noexcept;
  std::string who() const { return std::string(backend()) + " trainer rank " + std::to_string(args_.rank); }
  const sharded_trainer_args& args() const noexcept { return args_; }
  asio::thread_pool& pool() { return *pool_; }
  /// Pair (this rank, `worker`)'s frames over the local shards of `s`.
  std::vector<stream_frame> frames_to(const sharded_send& s, int worker) const;

  weight_transfer_config config_;
  trainer_context context_;

 private:
  sharded_trainer_args args_;
  std::unique_ptr<asio::thread_pool> pool_;
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  layout_cache layouts_;
  bool ready_ = false;  // connected, and no failure since
  std::uint64_t seq_ = 0;
  update_stats stats_;
  std::vector<std::uint64_t> sent_;
  double plan_s_ = 0;
};

}  // namespace refit::backend
