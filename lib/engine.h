// The worker side of a weight transfer: refit's rendering of vLLM's
// WeightTransferEngine. An engine is created by the factory for one backend, parses
// its typed init/update info from JSON, connects once (init_transfer_engine), then
// receives any number of updates, handing tensors to load_weights incrementally.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>

#include <refit/config.h>
#include <refit/json.h>
#include <refit/metadata.h>
#include <refit/stats.h>
#include <refit/tensor.h>

namespace refit {

namespace internal {
class engine_access;
}  // namespace internal

namespace backend {
class engine;
}  // namespace backend

/// Receives a batch of tensors (views into the engine's staging memory, valid only
/// during the call). Called incrementally, possibly from a processing thread, never
/// concurrently with itself for one update.
using load_weights_fn = std::function<void(std::span<const tensor_view>)>;

/// This worker's place in the inference server's parallel layout.
struct parallel_ranks {
  int tp_rank = 0, tp_size = 1;
  int pp_rank = 0, pp_size = 1;
  int dp_rank = 0, dp_size = 1;
};

/// The model that receives weights, when the engine is given one (the libtorch
/// adapter and the examples implement it). Engines never require it: every receive
/// takes an explicit load_weights.
class model_target {
 public:
  virtual ~model_target() = default;
  /// Loads a batch of tensors by name; same contract as load_weights_fn.
  virtual void load_weights(std::span<const tensor_view> weights) = 0;
  /// Announces the tensors of the update about to be received (one chunk of a
  /// session: each receive_weights). The engine base calls it on the context's
  /// model before any byte of the update is received or loaded, in either commit
  /// mode; throwing refuses the update: receive_weights rethrows without receiving
  /// and the weights stay untouched. A target checks the whole update against the
  /// model here (names, shapes, dtypes). Default: nothing.
  virtual void begin_update(const update_metadata& /*meta*/) {}
  /// Memory of exactly spec.nbytes() on the engine's device into which the engine
  /// may receive `spec`'s bytes directly (no staging copy, no assembly buffer for
  /// tensors larger than a buffer); load_weights then gets a view of that memory.
  /// nullopt (the default) receives into staging. Bytes land as they arrive, so a
  /// failed update leaves such tensors partly written (in-place semantics).
  virtual std::optional<tensor_view> destination(const tensor_spec& /*spec*/) { return std::nullopt; }
  /// Called once per update, just before its first bytes start landing in memory
  /// destination() offered (not at all when none do): from then on a failed update
  /// has changed the model. Default: nothing.
  virtual void direct_write_begins() {}
  /// Fingerprints (see lib/integrity/fingerprint.h) of the named weights as the model holds
  /// them now, all weights when `names` is empty; what the worker's
  /// weight_fingerprint call answers. The default throws unsupported.
  virtual std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names);
  /// Undo of a staged commit (fleet-atomic updates, docs/control-plane.md): whether
  /// read_back can copy the bytes of `spec` (its dtype and shape) as the model holds
  /// them now. Asked on the processing executor before any byte of the update moves; a
  /// worker whose model cannot read a tensor back refuses a fleet-atomic update of
  /// it. Default: false.
  virtual bool can_read_back(const tensor_spec& /*spec*/) { return false; }
  /// Copies the bytes of `spec` as the model holds them now (what it serves) into
  /// `out` (spec.nbytes() bytes). Called on the processing executor during a staged
  /// commit that keeps its undo, just before that tensor's load_weights. Default:
  /// throws unsupported.
  virtual void read_back(const tensor_spec& spec, std::span<std::byte> out);
  /// Undo at the cost of one pass (fleet-atomic commits of host models): whether
  /// exchange() can take staged batches. Asked only for chunks whose load_weights
  /// is this target's own (as_load_weights()), so no application loader is
  /// bypassed. Default: false.
  virtual bool can_exchange() const { return false; }
  /// What load_weights(staged) does, except that each view is left holding the
  /// bytes the model held before (swapped, not copied): a staged commit then keeps
  /// its undo in the stage with no read back and no scratch. Throws only before
  /// anything changed. Called on the processing executor. Default: throws
  /// unsupported.
  virtual void exchange(std::span<const tensor_view> staged);
  /// as_load_weights()'s function: engines recognise a target's own loader by it.
  struct own_loader {
    model_target* model;
    void operator()(std::span<const tensor_view> w) const { model->load_weights(w); }
  };
  /// A load_weights_fn that forwards to this target.
  load_weights_fn as_load_weights() { return own_loader{this}; }
};

/// What an engine is created with, besides its config.
struct engine_context {
  asio::any_io_executor executor;  ///< where the engine's coroutines run
  refit::device device;            ///< the device the model lives on
  parallel_ranks ranks;
  /// Optional. Told of every update before it is received (begin_update) and
  /// asked for direct destinations; receives still load through the
  /// load_weights_fn they are given (usually model->as_load_weights()).
  model_target* model = nullptr;
  /// Optional executor for CPU post-processing; engines create a pool of
  /// config.processing_threads when it is empty.
  asio::any_io_executor processing_executor;
};

/// Base of every engine's typed init info.
struct init_info {
  virtual ~init_info() = default;
};

/// Base of every engine's typed update info: the tensors of the update and,
/// optionally, its commit mode (the config's when absent).
struct update_info {
  virtual ~update_info() = default;
  update_metadata metadata;
  std::optional<commit_mode> commit;
};

/// What a backend can do, declared once by each engine (backend/engine.h) and
/// answered by weight_transfer_engine::capabilities() and, before any engine
/// exists, by engine_factory::capabilities(name). The factory's errors, the
/// conformance suite (tests/conformance) and the README's status table read it.
struct engine_capabilities {
  /// Receives straight into the memory a model_target offers (destination()): no
  /// staging copy on the worker.
  bool direct_receive = false;
  /// Commits commit_mode::staged updates: all or nothing per update session.
  bool staged_commit = false;
  /// Verifies per-bucket checksums when the trainer asks ("checksums": true).
  bool checksums = false;
  /// Receives into GPU memory.
  bool device_memory = false;
  /// Relays buckets worker to worker ("chain", "tree:K"), so the trainer's egress
  /// does not grow with the number of workers.
  bool relay = false;
  /// Sharded (M:N) transfers: each worker receives only its share of every trainer
  /// rank's shards (layouts, docs/sharded.md).
  bool sharded = false;
  /// receive_weights may complete before post-processing; drain_pending() ends it.
  bool defers_processing = false;
  /// Needs a GPU (CUDA builds).
  bool needs_gpu = false;
  /// Left out of //engines:all (and so of the Python module and the examples)
  /// in CUDA builds unless asked for (`--config=<backend>`): it links a system
  /// library the GPU machines those builds go to may lack (ucx: libucx).
  bool opt_in_build = false;

  json to_json() const;
  friend bool operator==(const engine_capabilities&, const engine_capabilities&) = default;
};

/// The worker-side engine an inference server holds, made by engine_factory for
/// one backend: parses its typed init/update info from JSON, connects once
/// (init_transfer_engine), then receives any number of updates, handing tensors to
/// load_weights incrementally. Every engine is a backend::engine (the backend
/// author's base, backend/engine.h), which implements these members once for all
/// backends: they check the call order and give clear errors on misuse (receive
/// before init, concurrent receives, use after shutdown).
///
/// Update sessions (vLLM's start / update / finish) are weight_update_session's
/// (session.h); the control plane's worker_host runs them for a remote trainer.
class weight_transfer_engine {
 public:
  virtual ~weight_transfer_engine();
  weight_transfer_engine(const weight_transfer_engine&) = delete;
  weight_transfer_engine& operator=(const weight_transfer_engine&) = delete;

  /// The registered backend name.
  virtual std::string_view backend() const noexcept = 0;
  /// What this backend can do (see engine_capabilities).
  virtual const engine_capabilities& capabilities() const noexcept = 0;

  /// When true, receive_weights completes once the last bucket has arrived and
  /// post-processing may still run; drain_pending() is its completion.
  virtual bool defers_processing() const noexcept = 0;

  /// Builds this engine's typed init info; throws invalid_argument naming the engine
  /// and the member on a missing, mistyped or unknown member.
  virtual std::unique_ptr<init_info> parse_init_info(const json& j) const = 0;
  /// Builds this engine's typed update info, likewise. It may run on the
  /// processing executor (read_update_info): it reads only what init set.
  virtual std::unique_ptr<update_info> parse_update_info(const json& j) const = 0;
  /// parse_update_info on the processing executor, the result posted back: an
  /// update_info of 100k tensors (or a sharded layout and its first plan) is tens
  /// to hundreds of milliseconds of CPU that the event loop an inference server
  /// shares with refit must not spend. init_transfer_engine is refused while one
  /// runs. Keeps a reference to `j`: co_await it where j is alive.
  virtual asio::awaitable<std::unique_ptr<update_info>> read_update_info(const json& j) = 0;

  /// Connects to the trainer. May be called again after shutdown() or after a
  /// failed update to reconnect. Like every awaitable here it keeps references to
  /// its arguments: co_await it where the info is alive (not on a temporary).
  virtual asio::awaitable<void> init_transfer_engine(const init_info& info) = 0;

  /// Receives one update and hands its tensors to `load_weights`. Without
  /// defers_processing it completes when every tensor has been loaded; with it,
  /// when every byte has arrived (call drain_pending() for the rest). First, the
  /// context's model (if any) is given info.metadata (model_target::begin_update)
  /// and may refuse the update, which then fails with the model's error before
  /// anything is received (and the trainer is told at once).
  ///
  /// The commit mode is info.commit, else config().commit. in_place: tensors are
  /// loaded as they arrive (or received straight into the model's memory); a
  /// failure after the first of them marks the weights dirty, and completes once
  /// the loads of what had arrived have ended (nothing stays deferred: the next
  /// update is taken at once). staged: every tensor
  /// is first received into the engine's stage (host memory it owns); load_weights
  /// sees none of it until the commit, so a failed transfer leaves the old weights
  /// untouched. Outside an update session a staged receive commits at its end and
  /// completes after its commit (nothing stays deferred); inside one
  /// (weight_update_session) it only stages the chunk, and finish_weight_update
  /// commits the whole session. If load_weights itself throws during a commit,
  /// the weights are marked dirty.
  virtual asio::awaitable<void> receive_weights(const update_info& info, load_weights_fn load_weights) = 0;

  /// Completes when all deferred post-processing has finished; rethrows the first
  /// error it hit, once. Idempotent; a no-op for engines that do not defer.
  virtual asio::awaitable<void> drain_pending() = 0;

  /// Closes connections and frees staging memory. Idempotent. Refused
  /// (invalid_state) while deferred processing is pending: drain_pending() first.
  /// Destroy an engine only when nothing is pending either.
  virtual void shutdown() = 0;

  /// Statistics of the last completed update (processing times are final after
  /// drain_pending()).
  virtual const update_stats& last_update_stats() const noexcept = 0;
  /// What the engine's transport chose once initialised (ucx: the transports UCX
  /// picked for the data, put or tagged), or null for engines with nothing to
  /// report. The control plane's init answer and weight_info carry it.
  virtual json transport_info() const { return nullptr; }

  virtual bool initialized() const noexcept = 0;
  /// Buckets whose deferred processing has not finished yet.
  virtual std::size_t processing_pending() const noexcept = 0;
  virtual bool receiving() const noexcept = 0;

  /// True when a failed update may have left the model partly written (in_place
  /// after its first tensor, or a failing staged commit); dirty_reason() says
  /// which update failed and how. weight_update_session clears it when an update
  /// session finishes; direct users (no session) call mark_weights_clean() after
  /// a full update.
  virtual bool weights_dirty() const noexcept = 0;
  virtual const std::string& dirty_reason() const noexcept = 0;
  virtual void mark_weights_clean() noexcept = 0;
  /// Host bytes held for staged commits: the stage's size (0 until the first
  /// staged update; kept across sessions, freed by shutdown()).
  virtual std::uint64_t staged_bytes() const noexcept = 0;
  virtual const weight_transfer_config& config() const noexcept = 0;
  virtual const engine_context& context() const noexcept = 0;

 private:
  // Only backend::engine derives from this class: every engine shares its checks.
  friend class backend::engine;
  weight_transfer_engine() = default;

  // How weight_update_session and the control plane coordinate with an engine
  // (internal/engine_access.h): update sessions, dirty marks, refusals, where to
  // offload work. backend::engine implements them; their rules are there
  // ("Staged commits").
  friend class internal::engine_access;
  virtual void begin_session() = 0;
  virtual asio::awaitable<void> commit_session(bool keep_undo) = 0;
  virtual std::string undo_refusal(const update_metadata& meta) = 0;
  virtual asio::awaitable<void> reserve_undo() = 0;
  virtual asio::awaitable<void> rollback_session() = 0;
  virtual void release_undo() noexcept = 0;
  virtual bool holds_undo() const noexcept = 0;
  virtual void discard_session() = 0;
  virtual bool session_open() const noexcept = 0;
  virtual std::size_t staged_chunks() const noexcept = 0;
  virtual void mark_weights_dirty(std::string reason) = 0;
  virtual void session_finished() = 0;
  virtual void refuse_update(errc kind, const std::string& reason) noexcept = 0;
  virtual asio::any_io_executor offload_executor() = 0;
};

}  // namespace refit
