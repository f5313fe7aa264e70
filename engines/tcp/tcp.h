// The TCP backend: one trainer streams every update to N workers over plain TCP
// (broadcast semantics: each worker receives the full stream), either to each
// worker itself (star) or through a chain or tree of workers that forward every
// bucket as it arrives (lib/backend/links/relay.h), so the trainer's egress stays one copy
// (or K) however many workers there are. Works on any machine; the embedded
// default of refit.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <asio/experimental/concurrent_channel.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/strand.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/bucket_send.h>
#include <refit/backend/delta_stream.h>
#include <refit/backend/engine.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
#include <refit/backend/links/stream_engine.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit::tcp {

// The deltas' shared vocabulary (lib/backend/delta_stream.h), as this engine's API
// has named it.
using backend::delta_fingerprint;
using backend::delta_send_info;
using backend::delta_send_stats;
using backend::held_version;

/// Worker init info, like vLLM's NCCL engine's plus the trainer's wire parameters:
/// {"master_address": str, "master_port": int, "rank_offset": int,
///  "world_size": int, "buffer_bytes": int, "num_buffers": int, "timeout_ms": int,
///  "topology": "star" | "chain" | "tree:K" (optional, star by default)}
/// (links::stream_init_info). The worker's rank is rank_offset + its local rank
/// (from the engine context's parallel ranks); the trainer is rank 0.
using init_info = links::stream_init_info;

/// {"names", "dtype_names", "shapes"} (vLLM's metadata members).
using update_info = metadata_update_info;

/// Worker side: connects to the trainer, receives straight into staging slots and,
/// in a relay topology, forwards each bucket to its children as it arrives; the
/// rest (joining, the subtree's header and confirmation, deltas' answers and
/// versions, rank(), children(), held(), disconnect()) is links::stream_engine's.
class engine final : public backend::typed_init<init_info, links::stream_engine> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context);
  std::string_view backend() const noexcept override { return "tcp"; }
  /// Direct receive, staged commits, checksums, relays (chain, tree:K); processing
  /// deferred.
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .staged_commit = true, .checksums = true, .relay = true, .defers_processing = true};
  }

 protected:
  std::unique_ptr<staging_memory> make_staging(const wire_params& wire) override;
  void opened(asio::ip::tcp::socket& socket) override;
  asio::awaitable<void> receive_buckets(links::stream_update& u) override;
};

/// Trainer side. trainer_args: {"master_address": str, "master_port": int (0: any
/// free port), "world_size": int, "buffer_bytes": int, "num_buffers": int,
/// "timeout_ms": int, "delta": bool (optional, false by default)}. prepare()
/// listens; connect_workers() accepts world_size - 1 workers.
///
/// With "delta": true the sender keeps a host snapshot of the bytes it last sent,
/// the base (memory: the update's payload bytes, about the model's size, held from
/// the first send until the sender is destroyed or prepared without deltas),
/// numbers each update's version and sends each bucket delta-encoded against the
/// base on every stream whose workers all hold exactly that base (in a star, each
/// worker's own; with relays, a stream reaches a subtree, and its relays forward
/// the encoded bytes); a stream that reaches a worker that does not (another
/// version, dirty weights, no model memory to decode into) carries that update
/// full, counted in last_delta_stats().full_fallbacks. docs/delta.md has the
/// protocol.
class sender final : public weight_sender, private backend::bucket_send_transport {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context);
  ~sender() override;
  std::string_view backend() const noexcept override { return "tcp"; }

  /// Listens; returns the workers' init info with the bound port (master_port 0
  /// picks a free one). trainer_args may add "topology" ("star", "chain",
  /// "tree:K"; default star for one or two workers, else chain).
  json prepare(const json& trainer_args) override;
  asio::awaitable<void> connect_workers() override;
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;
  void shutdown() override;
  update_stats last_send_stats() const override { return stats_; }
  /// With deltas on: {"delta": last_delta_stats()'s members}.
  json last_send_info() const override;
  /// delta: false sends the next update full (a delta sender only); true needs
  /// "delta": true at prepare.
  void set_next_send(const send_options& options) override;

  /// What the last send did with deltas ("delta": true).
  using delta_stats = delta_send_stats;
  const delta_stats& last_delta_stats() const noexcept { return delta_stats_; }

 private:
  using pool_strand = asio::strand<asio::thread_pool::executor_type>;
  struct peer {
    int rank = 0;
    pool_strand strand;  // the worker's socket lives here, in the I/O pool
    asio::ip::tcp::socket socket;
    bool confirmed = false;   // it (and its subtree) confirmed the update in progress
    bool took_delta = false;  // it holds the base: its buckets went as deltas
    bool fell_back = false;   // it was offered deltas and did not hold the base
  };
  // One update's bytes, laid out once and streamed to every worker. With deltas
  // offered, each bucket's delta records (update->encoded; empty: sent full) are
  // written before the bucket's turn is signalled and freed once every stream has
  // written that bucket (encoded_left: streams to go).
  struct stream {
    backend::bucket_update* update = nullptr;
    std::unique_ptr<std::atomic<std::size_t>[]> encoded_left;
  };
  // send_weights' transport parts (backend::send_buckets): a stream to each direct
  // peer on its strand, the checksums (and deltas) on a thread of their own, bucket
  // k+1's while bucket k is on the wire.
  void reset_peers() override;
  asio::awaitable<void> transmit(backend::bucket_update& u) override;
  std::vector<backend::peer_delta_outcome> delta_outcomes() const override;
  void failed(const backend::bucket_update& u, std::exception_ptr failure) override;
  using checksum_channel = asio::experimental::concurrent_channel<void(std::error_code, std::uint64_t)>;
  asio::awaitable<void> stream_to(std::shared_ptr<peer> keep, const stream& s,
                                  std::shared_ptr<checksum_channel> checksums);
  asio::awaitable<void> stream_body(peer& p, const stream& s, std::shared_ptr<checksum_channel> turns,
                                    const std::string& who);
  std::string unconfirmed_ranks() const;  // "ranks 1, 2, 3" of the update in progress ("" if none)
  void fail_all();
  json worker_init_info() const;

  weight_transfer_config config_;
  trainer_context context_;
  std::unique_ptr<asio::thread_pool> io_pool_;    // threads that copy bytes into sockets
  std::unique_ptr<asio::thread_pool> hash_pool_;  // the checksums, ahead of the streams
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  links::trainer_args args_;
  int world_size_ = 0;
  wire_params wire_;
  std::chrono::milliseconds timeout_{0};
  std::vector<std::shared_ptr<peer>> peers_;    // the trainer's children: shared with in-flight streams and closes
  std::vector<std::shared_ptr<peer>> relayed_;  // the other workers' side channels, kept open
  links::topology topology_;
  std::uint64_t seq_ = 0;
  update_stats stats_;
  bool delta_ = false;              // trainer_args "delta"
  std::uint64_t delta_max_ = 0;     // trainer_args "delta_max_bytes" (0: no bound)
  std::optional<bool> next_delta_;  // set_next_send's, for the next send only
  std::uint64_t version_ = 0;       // the last version numbered (deltas on)
  backend::delta_snapshot base_;    // the bytes last sent (deltas on)
  delta_stats delta_stats_;
};

}  // namespace refit::tcp
