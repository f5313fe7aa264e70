// Sharded TCP ("tcp_sharded"): M trainer ranks, each a process with its own
// sender holding only its local shards, send each of N workers only the bytes
// that worker keeps, straight from the shards (gather writes, no packing) into the
// worker's own tensors (scatter reads, no staging), all pairs at once.
//
// Both sides compute the same transfer plan (lib/layout/transfer_plan.h) from the global
// metadata and the layout spec, which the trainer gets in its trainer_args and the
// workers in each update_info; the per-pair header carries the plan's digest, so a
// worker whose layout differs refuses before a byte moves.
//
// Every worker connects to every trainer rank (a rank with nothing for a worker
// sends it an empty stream, which keeps the pair's sequence in step). Per update,
// per pair: header (accepted or refused), frames of at most buffer_bytes each
// (wire::bucket_header + payload, XXH3 checksums when enabled), confirmation.
//
// Deltas ("delta": true in a rank's trainer_args; docs/delta.md): each pair is a
// stream of its own versions. The rank keeps a snapshot of the bytes it last sent
// each worker, offers each worker deltas against it (a delta header after the
// pair's header, as tcp's), and a worker that holds exactly that pair's base (its
// version, and a hash of its tensors' current bytes equal to the base's
// fingerprint) takes each frame as a delta of the frame's bytes; any other gets
// that pair full.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <asio/ip/tcp.hpp>
#include <asio/strand.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/engine.h>
#include <refit/backend/shard_io.h>
#include <refit/backend/sharded.h>
#include <refit/backend/sharded_engine.h>
#include <refit/engine.h>
#include <refit/engines/tcp/tcp.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include <refit/trainer.h>

namespace refit::tcp {

using backend::layout_cache;
using backend::sharded_layouts;

/// Worker init info: backend::sharded_init_info ({"trainers": [{"address",
/// "port"}, ...] (rank order), "workers", "rank_offset", "buffer_bytes",
/// "num_buffers", "checksums", "timeout_ms"}).
using sharded_init_info = backend::sharded_init_info;

/// Update info: vLLM's metadata members of the GLOBAL tensors (what the trainer
/// ranks shard), "layout" (the spec above) and optional "commit". Parsed, its
/// metadata is this worker's own tensors (what its model is told of).
using sharded_update_info = backend::sharded_update_info;

/// Worker side: joining every rank, placing the tensors, running the pairs and
/// loading the update are backend::sharded_worker_base's; this reads each pair's
/// frames from its socket and answers its delta offers.
class sharded_engine final : public backend::typed_init<sharded_init_info, backend::sharded_worker_base> {
 public:
  sharded_engine(const weight_transfer_config& config, const engine_context& context);
  std::string_view backend() const noexcept override { return "tcp_sharded"; }
  /// Sharded (M:N) plans received straight into the worker's tensors (direct
  /// receive), staged commits, checksummed frames.
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .staged_commit = true, .checksums = true, .sharded = true};
  }
  /// By trainer rank: the version of that rank's pair this worker holds (known
  /// after an update from ranks with deltas on completed; a delta is taken only
  /// against exactly this).
  std::vector<std::optional<held_version>> held() const {
    std::vector<std::optional<held_version>> out;
    for (const auto& h : held_) out.push_back(h.held());
    return out;
  }

 protected:
  asio::awaitable<void> joined_rank(const backend::sharded_init_info& info, int rank,
                                    asio::ip::tcp::socket& socket) override;
  asio::awaitable<std::uint64_t> receive_pairs(const backend::sharded_update& u) override;
  void loaded() override;
  void do_session_committed() override;
  void do_session_finished() override;

 private:
  using socket_ptr = std::shared_ptr<asio::ip::tcp::socket>;
  // One pair's part of an update: what it held, where its tensors' current bytes
  // are (to decode deltas against; nullptr: none the model offers), and what it
  // brought.
  struct pair_state {
    std::optional<held_version> held;
    std::shared_ptr<const std::vector<const std::byte*>> current;
    bool staged = false;              // current is not where the bytes land
    std::optional<held_version> now;  // the version it holds after this update
    std::uint64_t wire_bytes = 0;
  };
  asio::awaitable<void> receive_pair(socket_ptr socket, int rank, std::shared_ptr<const sharded_layouts> layouts,
                                     std::vector<std::byte*> bases, pair_state* state);
  // Why this worker cannot take deltas on its pair with `rank` ("" when it can, as
  // far as what it recorded tells; the bytes' hash is checked next).
  std::string base_refusal(const links::wire::delta_header& d, const pair_state& st, const sharded_layouts& layouts,
                           int rank) const;

  // By trainer rank (deltas): the version of that rank's pair the model holds,
  // kept across re-inits with the same ranks.
  std::vector<backend::held_record> held_;
  std::vector<pair_state> states_;  // the update being received, by trainer rank
};

/// Trainer side: one rank. trainer_args: {"rank": int, "trainers": [{"address",
/// "port"}, ...] (every rank's listen address in rank order; this rank's port may be
/// 0: any free port), "workers": int, "layout": {"source", "destination"},
/// "buffer_bytes", "checksums", "timeout_ms", "delta": bool (optional, false by
/// default: with true, the snapshot of what this rank last sent, its egress bytes,
/// is held from the first send until the sender is destroyed or prepared without
/// deltas)}. prepare() listens and returns the
/// workers' init info (rank_offset 1); connect_workers() accepts every worker.
/// send_weights(declared, source): `declared` is the GLOBAL metadata (what the
/// workers' update_info carries); `source` yields this rank's local shards in the
/// same order, each checked against the shape its placement gives it.
class sharded_sender final : public backend::sharded_sender_base {
 public:
  sharded_sender(const weight_transfer_config& config, const trainer_context& context);
  ~sharded_sender() override;
  std::string_view backend() const noexcept override { return "tcp_sharded"; }
  /// Sharded (M:N) plans received straight into the worker's tensors (direct
  /// receive), staged commits, checksummed frames.
  static engine_capabilities capabilities_of() { return sharded_engine::capabilities_of(); }
  /// With deltas on: {"delta": last_delta_stats()'s members}.
  json last_send_info() const override;
  /// delta: false sends the next update full (a delta sender only); true needs
  /// "delta": true at prepare.
  void set_next_send(const send_options& options) override;
  /// What the last send did with deltas (fingerprint: 0, as each pair has its own).
  const delta_send_stats& last_delta_stats() const noexcept { return delta_stats_; }

 protected:
  std::function<void()> read_args(json_reader& r) override;
  unsigned pool_threads() const override;
  asio::awaitable<void> connected(std::vector<links::member> members) override;
  void send_begins() override;
  asio::awaitable<void> send_pairs(const backend::sharded_send& s) override;
  void close_transport() noexcept override;

 private:
  using pool_strand = asio::strand<asio::thread_pool::executor_type>;
  struct peer {
    int worker = 0;
    pool_strand strand;
    asio::ip::tcp::socket socket;
    // Deltas on, the last update: what the worker answered, what was encoded, and
    // each frame's hash (the fingerprint's parts).
    bool took_delta = false, fell_back = false;
    std::uint64_t encoded_frames = 0, delta_bytes = 0, encoded_full = 0;
    double encode_s = 0;
    std::vector<std::uint64_t> hashes;
  };
  // The bytes this rank last sent one worker (deltas on), laid out as the pair's
  // stream.
  struct pair_base {
    std::unique_ptr<std::byte[]> bytes;
    std::uint64_t capacity = 0;
    bool valid = false;  // holds exactly `version`'s bytes of the pair `digest` names
    std::uint64_t digest = 0, size = 0, version = 0, fingerprint = 0;
  };
  // A pair's delta work for stream_to (deltas on).
  struct pair_delta {
    std::array<std::byte, 32> header;
    bool offers_base = false;
    pair_base* base = nullptr;
    std::size_t elem = 1;  // the pair's element size (1 where dtypes of several sizes mix)
  };
  asio::awaitable<void> stream_to(std::shared_ptr<peer> p, std::array<std::byte, 48> header,
                                  std::shared_ptr<const std::vector<stream_frame>> frames, std::uint64_t seq,
                                  std::optional<pair_delta> delta);

  std::vector<std::shared_ptr<peer>> peers_;  // by worker
  bool allow_base_ = true;                    // set_next_send's choice, taken for the send in progress
  bool delta_ = false;                        // trainer_args "delta"
  std::uint64_t delta_max_ = 0;               // trainer_args "delta_max_bytes" (0: no bound)
  std::optional<bool> next_delta_;            // set_next_send's, for the next send only
  std::uint64_t version_ = 0;                 // the last version numbered (deltas on)
  std::vector<pair_base> bases_;              // by worker (deltas on)
  delta_send_stats delta_stats_;
};

}  // namespace refit::tcp
