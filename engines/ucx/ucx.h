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
//                                 send completed: the worker may read the bucket
//   worker  -> trainer  status    the update's confirmation (links)
//
// The worker's UCX progress runs on its event loop, woken by the UCX worker's event
// fd (ucp_worker_get_efd / ucp_worker_arm waited on by asio), with no thread and no
// busy loop; callbacks only record and post to the executor.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <refit/backend/engine.h>
#include <refit/backend/links/engine_base.h>
#include <refit/backend/links/links.h>
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

/// Worker init info: links::join_info (checksums refused: a put crosses no byte
/// stream a checksum would guard) plus "require_transports": [str] (optional): the
/// UCX transports (as ucx_info names them: "rc_mlx5", "dc_mlx5", "ud_verbs",
/// "cma", "posix", "sysv", "tcp", or "sm" for any of cma/posix/sysv/xpmem/knem,
/// "rdma" for any InfiniBand/RoCE one) of which the endpoint must use at least one
/// for its data; otherwise init fails with errc::unsupported naming what UCX chose.
struct init_info final : refit::init_info, links::join_info {
  std::vector<std::string> require_transports;
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

/// Whether `report` satisfies `required` (empty: anything); "" when it does, else
/// why not (naming what UCX offered).
std::string check_required(const endpoint_report& report, const std::vector<std::string>& required);

/// Worker side.
class engine final : public backend::typed_engine<init_info, update_info> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context);
  ~engine() override;
  std::string_view backend() const noexcept override { return "ucx"; }
  /// Direct receive (into the model's memory by a tagged receive), staged
  /// commits, processing deferred. No checksums, relays or sharding yet; host
  /// memory only; not in CUDA builds' //engines:all unless asked (.bazelrc).
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .staged_commit = true, .defers_processing = true, .opt_in_build = true};
  }
  int rank() const noexcept { return rank_; }
  /// What UCX chose for this worker's data, once initialised (null before):
  /// {"transports", "put_transports", "mode", "peer_failure_handling", "rank"}.
  json transport_info() const override;

 protected:
  asio::awaitable<void> init(const init_info& info) override;
  asio::awaitable<void> receive(const update_info& info, load_weights_fn load_weights) override;
  void do_shutdown() override;
  void do_refuse_update(errc kind, const std::string& reason) noexcept override;

 private:
  std::string who() const { return "ucx worker rank " + std::to_string(rank_); }
  void close() noexcept;

  std::shared_ptr<ucx::context> ucp_;  // lives as long as the engine: registrations belong to it
  std::shared_ptr<worker> worker_;
  registered_staging* staging_ = nullptr;  // owned by pipeline_
  std::vector<std::uint32_t> announced_;   // regions whose keys the trainer has
  // Shared with an update in flight: a shutdown() while it waits on the trainer
  // closes the socket and the UCX worker but frees neither under it.
  std::shared_ptr<asio::ip::tcp::socket> socket_;
  std::unique_ptr<receive_pipeline> pipeline_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = -1;
  std::uint64_t last_seq_ = 0;
  endpoint_report report_;
  bool initialized_ = false;
};

/// Trainer side; trainer_args as links::trainer_args (checksums refused).
class sender final : public links::sender_base {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context);
  ~sender() override;
  std::string_view backend() const noexcept override { return "ucx"; }
  static engine_capabilities capabilities_of() { return engine::capabilities_of(); }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;
  /// What UCX chose for each worker, by rank (empty before connect_workers).
  json transport_info() const;

 protected:
  asio::awaitable<void> connected() override;
  void close_transport() noexcept override;

 private:
  struct region {
    std::uint64_t base = 0, bytes = 0;
    std::unique_ptr<remote_key> rkey;
  };
  struct peer {
    int rank = 0;
    std::shared_ptr<asio::ip::tcp::socket> socket;
    std::unique_ptr<endpoint> ep;
    std::map<std::uint32_t, region> regions;
    endpoint_report report;
  };
  asio::awaitable<void> connect_one(std::shared_ptr<peer> p, std::shared_ptr<worker> w);
  // The peer and the UCX worker are held: a shutdown() mid-update closes them
  // (the send then fails) but frees nothing a stream still uses.
  asio::awaitable<void> stream_to(std::shared_ptr<peer> p, std::shared_ptr<worker> w,
                                  const std::vector<std::vector<asio::const_buffer>>& payloads, const bucket_plan& plan,
                                  std::uint64_t seq);

  std::shared_ptr<ucx::context> ucp_;
  std::shared_ptr<worker> worker_;
  std::vector<std::shared_ptr<peer>> peers_by_rank_;
};

}  // namespace refit::ucx
