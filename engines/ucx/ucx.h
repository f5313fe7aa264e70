// The UCX backend: the trainer writes each bucket straight into a worker's
// registered staging with one-sided puts (UCX's UCP API: RDMA on InfiniBand/RoCE,
// cma/shared memory on one host), or, where UCX would only emulate puts (its tcp
// transport), sends it as one tagged message into the worker's memory.
//
// Control stays on refit's authenticated side channel (links::join: the shared
// secret's handshake, the hello, the per-update header), so nothing reaches a
// worker's memory before both sides proved the secret:
//
//   worker  -> trainer  offer     its UCX worker address; each staging slot's base,
//                                 size and packed remote key (ucp_mem_map, ucp_rkey_pack)
//   trainer -> worker   status    what UCX chose for the endpoint (transports, put or
//                                 tag), or why the trainer refuses the worker
//   worker  -> trainer  status    accepted, or refused (require_transports unmet)
//   per update: the update header and its answer (links), then per bucket
//   worker  -> trainer  grant     where bucket k may land: a slot (put mode) the
//                                 pipeline has acquired, so never one still being
//                                 processed (credit-based), or "tag" (a tagged
//                                 receive is posted into the destination: the model's
//                                 memory, the stage, a split tensor's assembly)
//   trainer -> worker   done      sent only after the puts were flushed
//                                 (ucp_ep_flush_nbx: remotely complete) or the tagged
//                                 send completed: the worker may read the bucket;
//                                 with checksums it carries the bucket's checksum,
//                                 verified before the bucket is loaded
//   worker  -> trainer  status    the update's confirmation (links)
//
// Relay topologies (chain, tree:K; links/relay.h): after the rendezvous the
// trainer tells each worker its place; a worker joins its parent's relay listener
// (links::join, authenticated as with the trainer) and makes the offer there, so
// the parent's UCX worker holds the endpoint to it. The trainer then sends only to
// its children; a worker that received bucket k (the "done" arrived) sends it on
// to each child with the same grant/put/flush/done steps (downstream.h) from its
// own memory, before bucket k goes to processing, passing the trainer's checksum
// on. It accepts an update once its children accepted and confirms once they
// confirmed.
//
// The worker's UCX progress runs on its event loop, woken by the UCX worker's event
// fd (ucp_worker_get_efd / ucp_worker_arm waited on by asio), with no thread and no
// busy loop; callbacks only record and post to the executor.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/thread_pool.hpp>

#include <refit/backend/bucket_send.h>
#include <refit/backend/delta_stream.h>
#include <refit/backend/engine.h>
#include <refit/backend/links/engine_base.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
#include <refit/backend/links/stream_engine.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>
#include <refit/json.h>
#include <refit/trainer.h>

namespace refit::ucx {

class context;
class worker;
class endpoint;
class remote_key;
class registered_staging;
class update_registry;
class registrar;
struct downstream;

/// Worker init info: links::stream_init_info (join_info plus "topology": "star",
/// "chain", "tree:K"; the trainer's prepare() writes it) and "require_transports": [str]
/// (optional): the UCX transports (as ucx_info names them: "rc_mlx5", "dc_mlx5",
/// "ud_verbs", "cma", "posix", "sysv", "tcp", or "sm" for any of
/// cma/posix/sysv/xpmem/knem, "rdma" for any InfiniBand/RoCE one) of which the
/// endpoint to this worker (from the trainer, or from the worker relaying to it)
/// must use at least one for its data; otherwise init fails with errc::unsupported
/// naming what UCX chose.
struct init_info final : links::stream_init_info {
  std::vector<std::string> require_transports;
  /// "put_into_model" (optional): true: where UCX carries puts, the model's
  /// memory (direct receive) and a staged commit's stage are registered for each
  /// update and written by the sender's puts; false: received as tagged messages
  /// (the worker's UCX pulls them into place). Absent: puts where an RDMA transport
  /// carries them, tagged over shared memory (measured faster there).
  std::optional<bool> put_into_model;
  /// "device_memory" (optional, default false): true: stage on, and receive
  /// into, the CUDA device of engine_context::device (registered with UCX as
  /// device memory: GPUDirect RDMA where the hardware has it; a model target must
  /// then offer that device's memory, if any); init fails with errc::unsupported,
  /// saying why, where that cannot be (a build without CUDA, a UCX without CUDA
  /// memory support, checksums asked for: they are verified on the host). false:
  /// on the host (load_weights copies to the device); transport_info()'s "memory"
  /// says which. Deltas are decoded on the host: a worker on a device takes every
  /// update full.
  std::optional<bool> device_memory;
  static init_info read(json_reader& r);
};

using update_info = metadata_update_info;

/// What UCX chose for one trainer-worker endpoint.
struct endpoint_report {
  std::vector<std::string> transports;      ///< every lane's transport
  std::vector<std::string> put_transports;  ///< those carrying one-sided puts (rma_bw lanes)
  std::string mode;                         ///< "put" or "tag" (puts only emulated: two-sided)
  bool peer_failure_handling = false;       ///< UCX's own (else only the side channel)
  json to_json() const;
  static endpoint_report from_json(const json& j, const std::string& what);
};

/// Whether a worker takes puts into the model's memory (and a stage) over the
/// endpoint `report` describes: only where it carries puts; then as `asked`
/// ("put_into_model"), by default where an RDMA transport carries them.
bool puts_into_model(const endpoint_report& report, std::optional<bool> asked);

/// Whether `report` satisfies `required` (empty: anything); "" when it does, else
/// why not (naming what UCX offered).
std::string check_required(const endpoint_report& report, const std::vector<std::string>& required);

/// Worker side: joining, the subtree's update header and confirmation, deltas'
/// answers and versions, rank(), children(), held() and disconnect() are
/// links::stream_engine's; this adds the UCX worker, the registered staging and the
/// offer upstream, and per bucket the grant, the done and the forward to the
/// children (downstream.h).
class engine final : public backend::typed_init<init_info, links::stream_engine> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context);
  ~engine() override;
  std::string_view backend() const noexcept override { return "ucx"; }
  /// Direct receive (into the model's memory by a tagged receive), staged
  /// commits, checksums, relays (chain, tree:K), processing deferred; device
  /// memory where the build and the UCX loaded allow it (init_info::device_memory:
  /// not declared in the capabilities, which cannot know the UCX found at run
  /// time). Sharding is ucx_sharded's; not in CUDA builds' //engines:all unless
  /// asked (.bazelrc).
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true,
            .staged_commit = true,
            .checksums = true,
            .relay = true,
            .defers_processing = true,
            .opt_in_build = true};
  }
  /// What UCX chose for this worker's data, once initialised (null before):
  /// {"transports", "put_transports", "mode", "peer_failure_handling", "rank",
  /// "put_into_model" (puts land in the model's memory and the stage), "memory"
  /// (where it receives: "cpu" or "cuda:N", init_info::device_memory)}.
  json transport_info() const override;
  /// How many ranges of the model's memory (or the stage) the last update
  /// registered for the sender's puts (0: none landed outside the staging, or they
  /// came tagged: no put lane, or "put_into_model": false).
  std::size_t last_put_regions() const noexcept { return last_put_regions_; }

 protected:
  asio::awaitable<void> joined(const links::stream_init_info& info) override;
  std::unique_ptr<staging_memory> make_staging(const wire_params& wire) override;
  bool staging_serves(const staging_memory& staging) const override { return staging.device() == device_; }
  asio::awaitable<void> connected(const links::stream_init_info& info) override;
  std::string delta_refusal() const override;
  asio::awaitable<void> receive_buckets(links::stream_update& u) override;
  void close_transport() noexcept override;

 private:
  // Where this worker receives (init_info::device_memory); throws when it was
  // asked for a device it cannot receive on.
  refit::device receive_device(const init_info& info) const;
  asio::awaitable<void> offer_upstream(const init_info& info);
  registered_staging& staging() const;
  bool puts_into_model() const;  // what put_into_model_ comes to for this endpoint

  std::shared_ptr<ucx::context> ucp_;          // lives as long as the engine: registrations belong to it
  std::shared_ptr<worker> worker_;             // null until initialised, and once closed
  refit::device device_;                       // where it receives (init_info::device_memory)
  std::vector<std::uint32_t> announced_;       // staging regions whose keys the trainer has
  std::optional<bool> put_into_model_;         // init_info's
  std::unique_ptr<ucx::registrar> registrar_;  // registers memory for puts, off the loop (made when first used)
  std::size_t last_put_regions_ = 0;
  std::vector<std::shared_ptr<downstream>> downstream_;  // the children, in children() order
  endpoint_report report_;
};

/// Trainer side; trainer_args as links::trainer_args plus "topology" ("star",
/// "chain", "tree:K"; default star for one or two workers, else chain) as the tcp
/// engine's, and "delta": bool (optional, false by default): delta updates as the
/// tcp engine's (docs/delta.md), each bucket's form announced before its grant
/// (relays pass the form and the encoded bytes on). With checksums (or deltas), every bucket's checksum (and delta) is
/// computed in one pass over the update (on a thread of the sender's) before its
/// first byte is sent.
class sender final : public links::sender_base, private backend::bucket_send_transport {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context);
  ~sender() override;
  std::string_view backend() const noexcept override { return "ucx"; }
  static engine_capabilities capabilities_of() { return engine::capabilities_of(); }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;
  /// What UCX chose for each worker the trainer sends to itself (all of them in
  /// a star, its children in a chain or tree), by rank (empty before
  /// connect_workers).
  json transport_info() const;
  /// With deltas on: {"delta": last_delta_stats()'s members}.
  json last_send_info() const override;
  void set_next_send(const send_options& options) override;
  const backend::delta_send_stats& last_delta_stats() const noexcept { return delta_stats_; }

 protected:
  bool relays() const noexcept override { return true; }
  bool verifies_checksums() const noexcept override { return true; }
  bool sends_deltas() const noexcept override { return true; }
  void prepared() override;
  asio::awaitable<void> connected() override;
  void close_transport() noexcept override;

 private:
  // The peers and the UCX worker are held: a shutdown() mid-update closes them
  // (the send then fails) but frees nothing a stream still uses.
  // `encoded` (deltas on): per bucket its delta, empty where it goes full; sent as
  // deltas to a peer that took them.
  asio::awaitable<void> stream_to(std::shared_ptr<downstream> p, std::shared_ptr<worker> w,
                                  const std::vector<std::vector<asio::const_buffer>>& payloads,
                                  const std::vector<std::uint64_t>& checksums, const bucket_plan& plan,
                                  std::uint64_t seq, const std::vector<std::vector<std::byte>>* encoded);
  // send_weights' transport parts (backend::send_buckets): every bucket's checksum
  // (and delta) in one pass before the first byte is sent, then the header (and
  // the offers' answers) to every peer, the buckets, the confirmations.
  void reset_peers() override;
  asio::awaitable<void> transmit(backend::bucket_update& u) override;
  std::vector<backend::peer_delta_outcome> delta_outcomes() const override;
  void failed(const backend::bucket_update& u, std::exception_ptr failure) override;
  // Each peer accepts the update, then (offered a base) says whether it holds it.
  asio::awaitable<void> offer_to_all(const backend::bucket_update& u);

  std::shared_ptr<ucx::context> ucp_;
  std::shared_ptr<worker> worker_;
  std::vector<std::shared_ptr<downstream>> peers_by_rank_;
  std::unique_ptr<asio::thread_pool> hash_pool_;  // the checksums (and deltas), off the event loop
  std::optional<bool> next_delta_;                // set_next_send's, for the next send only
  std::uint64_t version_ = 0;                     // the last version numbered (deltas on)
  backend::delta_snapshot base_;                  // the bytes last sent (deltas on)
  backend::delta_send_stats delta_stats_;
};

}  // namespace refit::ucx
