// Sharded UCX ("ucx_sharded"): tcp_sharded's M:N transfers (docs/sharded.md) with
// the bytes moved by UCX. M trainer ranks, each a process holding only its local
// shards, send each of N workers only the bytes that worker keeps, every pair at
// once, on the same transfer plan (lib/backend/sharded.h) and the same side channel
// (links: authenticated join, per-pair update header with the plan's digest,
// confirmation) as tcp_sharded.
//
// Per pair and frame (at most buffer_bytes of the pair's byte sequence) the worker
// grants the frame's runs in its own tensors (the model's memory, a staged
// commit's stage, or the fallback area), one of two ways (as the ucx engine's
// direct receive, "put_into_model"): puts, where the endpoint carries them and the
// worker takes them into the model (by default over RDMA): the destination
// tensors are registered for the update and the grant lists each run with its
// region; or a tagged receive whose iov is the runs. The trainer rank writes the
// frame from the runs in its shards (puts, flushed, or one tagged message; no
// packing on either side), then sends "done" with the frame's checksum (checksums
// on); the worker verifies the bytes where they landed before the next frame
// (downstream.h's send_bucket on the trainer, as the ucx engine's).
//
// Each worker connects to every rank and offers its UCX worker address there; the
// rank's endpoint to it reports the transports UCX chose, and the worker's
// "require_transports" refuses the job rather than fall back silently. Deltas are
// not offered (tcp_sharded has them).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/ip/tcp.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/engine.h>
#include <refit/backend/sharded.h>
#include <refit/backend/sharded_engine.h>
#include <refit/engine.h>
#include <refit/engines/ucx/ucx.h>
#include <refit/trainer.h>

namespace refit::ucx {

/// Worker init info: backend::sharded_init_info's members ({"trainers": [{"address",
/// "port"}, ...], "workers", "rank_offset", "buffer_bytes", "checksums",
/// "timeout_ms"}) plus "require_transports": [str] as the ucx engine's (each
/// rank's endpoint to this worker must move the data over one of them).
struct sharded_init_info final : backend::sharded_init_info {
  std::vector<std::string> require_transports;
  /// "put_into_model" (optional), as the ucx engine's: puts into this worker's
  /// tensors where the endpoint carries them (by default where RDMA does).
  std::optional<bool> put_into_model;
  static sharded_init_info read(json_reader& r);
};

/// Update info: vLLM's metadata members of the GLOBAL tensors and "layout" (as
/// tcp_sharded's), optional "commit".
using sharded_update_info = backend::sharded_update_info;

/// Worker side: joining every rank, placing the tensors, running the pairs and
/// loading the update are backend::sharded_worker_base's; this adds the UCX
/// worker, the offer to each rank and, per pair and frame, the grant and the done.
class sharded_engine final : public backend::typed_init<sharded_init_info, backend::sharded_worker_base> {
 public:
  sharded_engine(const weight_transfer_config& config, const engine_context& context);
  ~sharded_engine() override;
  std::string_view backend() const noexcept override { return "ucx_sharded"; }
  /// Sharded (M:N) plans received straight into the worker's tensors (direct
  /// receive, tagged iov receives), staged commits, checksummed frames; no deltas;
  /// host memory; left out of CUDA builds as the ucx engine is.
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .staged_commit = true, .checksums = true, .sharded = true, .opt_in_build = true};
  }
  /// What UCX chose for each rank's endpoint to this worker, once initialised
  /// (null before): {"worker", "transports" (every rank's, each once), "mode" ("put"
  /// or "tag" where every rank's is that, else "mixed"), "peer_failure_handling"
  /// (every rank's endpoint has it), "trainer_ranks": [per rank: {"transports",
  /// "put_transports", "mode" (how frames come: puts into the tensors, or tagged),
  /// "peer_failure_handling"}]}.
  json transport_info() const override;
  /// How many ranges of this worker's tensors the last update registered for puts
  /// (0: every frame came tagged).
  std::size_t last_put_regions() const noexcept { return last_put_regions_; }

 protected:
  asio::awaitable<void> joining(const backend::sharded_init_info& info) override;
  asio::awaitable<void> joined_rank(const backend::sharded_init_info& info, int rank,
                                    asio::ip::tcp::socket& socket) override;
  asio::awaitable<std::uint64_t> receive_pairs(const backend::sharded_update& u) override;
  void close_transport() noexcept override;

 private:
  using socket_ptr = std::shared_ptr<asio::ip::tcp::socket>;
  asio::awaitable<void> receive_pair(socket_ptr socket, std::shared_ptr<ucx::worker> w, int rank,
                                     std::shared_ptr<const backend::sharded_layouts> layouts,
                                     std::vector<std::byte*> bases, std::uint64_t* wire_bytes,
                                     update_registry* registry);

  std::shared_ptr<ucx::context> ucp_;  // made once, off the loop
  std::shared_ptr<ucx::worker> worker_ucx_;
  std::vector<endpoint_report> reports_;       // by trainer rank
  std::optional<bool> put_into_model_;         // init_info's
  std::unique_ptr<ucx::registrar> registrar_;  // registers memory for puts, off the loop (made when first used)
  std::size_t last_put_regions_ = 0;
};

/// Trainer side: one rank. trainer_args: backend::sharded_trainer_args ({"rank",
/// "trainers", "workers", "layout", "buffer_bytes", "checksums", "timeout_ms"}), as
/// tcp_sharded's without "delta". prepare() listens and returns the workers' init
/// info; connect_workers() accepts every worker and makes an endpoint to each from
/// its offer. send_weights(declared, source): `declared` is the GLOBAL metadata;
/// `source` yields this rank's local shards in the same order.
class sharded_sender final : public backend::sharded_sender_base {
 public:
  sharded_sender(const weight_transfer_config& config, const trainer_context& context);
  ~sharded_sender() override;
  std::string_view backend() const noexcept override { return "ucx_sharded"; }
  static engine_capabilities capabilities_of() { return sharded_engine::capabilities_of(); }
  /// What UCX chose for this rank's endpoint to each worker, by worker number.
  json transport_info() const;

 protected:
  asio::awaitable<void> connected(std::vector<links::member> members) override;
  asio::awaitable<void> send_pairs(const backend::sharded_send& s) override;
  void close_transport() noexcept override;

 private:
  std::shared_ptr<ucx::context> ucp_;
  std::shared_ptr<worker> worker_;
  std::vector<std::shared_ptr<downstream>> peers_;  // by worker number
};

}  // namespace refit::ucx
