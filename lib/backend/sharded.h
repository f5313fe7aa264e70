// What sharded engines share (M trainer ranks to N workers on one transfer plan,
// docs/sharded.md), whatever moves their bytes (tcp_sharded's sockets, ucx_sharded's
// tagged messages): the layouts read against the global metadata and planned
// (cached), the workers' init info and a rank's trainer args, each pair's digest and
// the check of its header, where each of a worker's tensors lands, and a rank's
// local shards walked and checked.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/wire.h>
#include <refit/engine.h>
#include <refit/json.h>
#include <refit/json_reader.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include <refit/metadata.h>
#include <refit/stats.h>
#include <refit/trainer.h>

namespace refit::backend {

/// A layout spec read against global metadata: both sides' layouts and the plan.
struct sharded_layouts {
  update_metadata global;
  source_layout source;
  std::vector<dest_layout> workers;
  std::shared_ptr<const transfer_plan> plan;
};

/// Reads {"source": <read_source_layout>, "destination": <read_dest_layouts>} for
/// `global`; the result is cached by (metadata digest, spec) so an unchanged model
/// is planned once.
class layout_cache {
 public:
  std::shared_ptr<const sharded_layouts> get(const update_metadata& global, const json& spec,
                                             const std::string& context);

 private:
  std::mutex mutex_;
  std::uint64_t key_ = 0;
  std::shared_ptr<const sharded_layouts> last_;
};

/// A sharded worker's update info, parsed: `metadata` is this worker's own tensors
/// (what its model is told of), `layouts` the plan they come by.
struct sharded_update_info final : refit::update_info {
  std::shared_ptr<const sharded_layouts> layouts;
};

/// Reads a sharded worker's update_info ({vLLM's metadata members of the GLOBAL
/// tensors, "layout": {"source", "destination"}, "commit" (optional)}) for worker
/// number `worker` (-1: not initialised yet, invalid_state) of `workers`, fed by
/// `trainers` ranks; the layout planned through `cache`. `engine` names it in errors.
std::unique_ptr<sharded_update_info> read_sharded_update_info(const json& j, std::string_view engine, int worker,
                                                              int workers, int trainers, layout_cache& cache);

/// A rank's plan for `declared` and `spec`, made on `pool` (planning is not for an
/// event loop; cached), checked against the job's `ranks` and `workers`.
asio::awaitable<std::shared_ptr<const sharded_layouts>> plan_for_rank(asio::any_io_executor pool, layout_cache& cache,
                                                                      const update_metadata& declared, const json& spec,
                                                                      int ranks, int workers, std::string who);

/// A trainer rank's listen address.
struct rank_endpoint {
  std::string address;
  std::uint16_t port = 0;
};

/// The members of a sharded worker's init info: {"trainers": [{"address": str,
/// "port": int}, ...] (rank order), "workers": int, "rank_offset": int (this worker
/// is number rank_offset - 1 + its tp_rank; 1 by default), the wire params
/// ("buffer_bytes", "num_buffers", "checksums"), "timeout_ms"}. An engine's
/// init_info derives from it and reads its own members after these.
struct sharded_join_info {
  std::vector<rank_endpoint> trainers;
  int workers = 1;
  int rank_offset = 1;
  wire_params wire;
  std::optional<std::chrono::milliseconds> timeout;
  static sharded_join_info read(json_reader& r);
  /// This worker's number among the destinations; invalid_argument naming
  /// `engine` when rank_offset and tp_rank make none below `workers`.
  int worker_number(int tp_rank, std::string_view engine) const;
};

/// A rank's trainer_args: {"rank": int, "trainers": [{"address", "port"}, ...]
/// (every rank's listen address in rank order; this rank's port may be 0: any free
/// port), "workers": int, "layout": {"source", "destination"}, the wire params,
/// "timeout_ms"}. read() leaves `r` open for the engine's own members.
struct sharded_trainer_args {
  int rank = 0;
  std::vector<rank_endpoint> trainers;
  int workers = 1;
  json layout;
  wire_params wire;
  std::chrono::milliseconds timeout{0};
  static sharded_trainer_args read(json_reader& r, std::chrono::milliseconds default_timeout);
  /// The workers' init info (sharded_join_info's members) once this rank listens
  /// on `port`.
  json worker_init_info(std::uint16_t port) const;
};

/// The digest a pair's header carries: the plan's, tied to the pair, so a stream
/// that reaches the wrong worker (or comes from the wrong rank) is refused too.
std::uint64_t pair_digest(std::uint64_t plan_digest, int rank, int worker);

/// Why a worker refuses pair (rank, worker)'s update header `u` ("" when it
/// accepts): a sequence not after `last_seq`, a digest other than `digest` (the
/// plans differ), or a stream of other sizes than `pair` cut in `frames` frames.
/// The flags are the engine's to check.
std::string pair_header_refusal(const links::wire::update& u, std::uint64_t last_seq, std::uint64_t digest,
                                std::uint64_t plan_digest, const pair_plan& pair, std::uint64_t frames);

/// Where a worker's tensors land for one update.
struct sharded_destination {
  /// Per tensor of the worker's layout: where its bytes land (the model's own
  /// memory where `target` offers host memory, else the engine's fallback area,
  /// which load_weights then copies from).
  std::vector<std::byte*> bases;
  /// Per tensor: its current bytes, what a delta decodes against (in place, the
  /// model's memory the bytes land in; staged, the model's; null where none).
  std::shared_ptr<std::vector<const std::byte*>> current;
  /// Some tensor lands in `target`'s memory (tell it direct_write_begins()).
  bool direct = false;
};

/// Places `dest`'s tensors: in `target` (receive_target(): the model, or a staged
/// commit's stage) where it offers host memory, else in `fallback` (grown on
/// `processing`); `model` is the engine's model (the current bytes when staged).
/// Padding (bytes no piece covers) is never sent: memory other than the model's own
/// (the stage, the fallback area) is zeroed there, on `processing`, so the model
/// gets zeros, as vLLM's padded rows are. The model's lookups yield the loop every
/// 512 tensors.
asio::awaitable<sharded_destination> place_destination(const dest_layout& dest, model_target* target,
                                                       model_target* model, bool staged,
                                                       std::vector<std::byte>& fallback,
                                                       asio::any_io_executor processing);

/// A worker's pairs of one update, `pairs[r]` fed by trainer rank r over
/// `sockets[r]`, run at once. The first to fail cancels the other ranks' side
/// channels (so none waits out its deadline for bytes that will not come), every
/// rank is told why (links::tell_failure, for its `last_seq` as it is then), and
/// that failure is rethrown; the caller then closes its connections.
asio::awaitable<void> run_pairs(std::vector<asio::awaitable<void>> pairs,
                                std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets,
                                const std::vector<std::uint64_t>& last_seq);

/// Best effort: tells every trainer rank why this worker fails (links::tell_failure
/// over `sockets[r]` for update `last_seq[r]`); never throws.
asio::awaitable<void> tell_ranks(const std::vector<std::shared_ptr<asio::ip::tcp::socket>>& sockets,
                                 std::exception_ptr failure, const std::vector<std::uint64_t>& last_seq);

/// The end of a sharded worker's update once every pair arrived: `stats` gets the
/// worker's planned ingress, its tensors and receive_s (since `start`); then the
/// update, whole (views of `bases`: the model's memory received in place, the stage
/// or the fallback area), is loaded on `processing` (process_s), and wall_s.
asio::awaitable<void> load_sharded(const dest_layout& dest, std::uint64_t ingress, const std::vector<std::byte*>& bases,
                                   load_weights_fn& load_weights, asio::any_io_executor processing, update_stats& stats,
                                   std::chrono::steady_clock::time_point start);

/// Rank `rank`'s shards from `source`, each checked against the shape its
/// placement gives it (the first divergent one is named) and required in host
/// memory; their data pointers in `local`'s order. `who` names the rank in errors.
std::vector<std::byte*> local_shards(tensor_source& source, const update_metadata& local, const std::string& who);

}  // namespace refit::backend
