// The worker side of a weight transfer: refit's rendering of vLLM's
// WeightTransferEngine. An engine is created by the factory for one backend, parses
// its typed init/update info from JSON, connects once (init_transfer_engine), then
// receives any number of updates, handing tensors to load_weights incrementally.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/thread_pool.hpp>

#include <refit/async/drain_scope.h>
#include <refit/config.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>
#include <refit/stats.h>
#include <refit/tensor.h>

namespace refit {

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
  /// Fingerprints (see lib/fingerprint.h) of the named weights as the model holds
  /// them now, all weights when `names` is empty; what the worker's
  /// weight_fingerprint call answers. The default throws unsupported.
  virtual std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names);
  /// A load_weights_fn that forwards to this target.
  load_weights_fn as_load_weights() {
    return [this](std::span<const tensor_view> w) { load_weights(w); };
  }
};

/// What an engine is created with, besides its config.
struct engine_context {
  asio::any_io_executor executor;   ///< where the engine's coroutines run
  refit::device device;             ///< the device the model lives on
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

/// Update info that is only the tensor metadata (vLLM's "names", "dtype_names",
/// "shapes") and the optional "commit" ("in_place" | "staged"): what engines use
/// that need nothing else per update.
struct metadata_update_info : update_info {
  static metadata_update_info read(json_reader& r) {
    metadata_update_info info;
    info.metadata = read_update_metadata(r);
    info.commit = read_commit_mode(r);
    return info;
  }
};

/// The worker-side engine. Public members check the call order and give clear
/// errors on misuse (receive before init, concurrent receives, use after shutdown);
/// engines implement the protected do_* hooks.
class weight_transfer_engine {
 public:
  weight_transfer_engine(weight_transfer_config config, engine_context context);
  virtual ~weight_transfer_engine();
  weight_transfer_engine(const weight_transfer_engine&) = delete;
  weight_transfer_engine& operator=(const weight_transfer_engine&) = delete;

  /// The registered backend name.
  virtual std::string_view backend() const noexcept = 0;

  /// When true, receive_weights completes once the last bucket has arrived and
  /// post-processing may still run; drain_pending() is its completion.
  virtual bool defers_processing() const noexcept { return false; }

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
  asio::awaitable<std::unique_ptr<update_info>> read_update_info(const json& j);

  /// Connects to the trainer. May be called again after shutdown() or after a
  /// failed update to reconnect. Like every awaitable here it keeps references to
  /// its arguments: co_await it where the info is alive (not on a temporary).
  asio::awaitable<void> init_transfer_engine(const init_info& info);

  /// Receives one update and hands its tensors to `load_weights`. Without
  /// defers_processing it completes when every tensor has been loaded; with it,
  /// when every byte has arrived (call drain_pending() for the rest). First, the
  /// context's model (if any) is given info.metadata (model_target::begin_update)
  /// and may refuse the update, which then fails with the model's error before
  /// anything is received.
  ///
  /// The commit mode is info.commit, else config().commit. in_place: tensors are
  /// loaded as they arrive (or received straight into the model's memory); a
  /// failure after the first of them marks the weights dirty. staged: every tensor
  /// is first received into the engine's stage (host memory it owns); load_weights
  /// sees none of it until the commit, so a failed transfer leaves the old weights
  /// untouched. Outside an update session (begin_session) a staged receive is a
  /// session of one chunk: it commits at its end and completes after its commit
  /// (nothing stays deferred). Inside one, it only stages the chunk (see "Staged
  /// commits" below). If load_weights itself throws during a commit, the weights
  /// are marked dirty.
  asio::awaitable<void> receive_weights(const update_info& info, load_weights_fn load_weights);

  /// Staged commits are atomic per update session. weight_update_session (and so
  /// control::worker_host and the Python Engine) calls these; with commit
  /// staged, through it:
  ///
  ///  * begin_session() (start_weight_update) opens a session.
  ///  * Each staged receive_weights(info, load_weights) (update_weights: one
  ///    chunk) is checked against the model (model_target::begin_update) before
  ///    any byte moves, then takes its place at the end of the stage and is
  ///    received into it. load_weights is not called during the chunk; the engine
  ///    keeps it, with the chunk's metadata, for the commit. A chunk is refused
  ///    before its first byte (and the trainer told at once, refuse_update, naming
  ///    the bytes) when the stage cannot grow to hold it (resource_exhausted: the
  ///    allocation failed, or weight_transfer_config::max_stage_bytes would be
  ///    exceeded), when it names a tensor an earlier chunk of the session staged
  ///    (invalid_argument: the stage holds each tensor once, so it stays bounded
  ///    by the model), or when its commit mode differs from the session's earlier
  ///    chunks' (invalid_argument).
  ///  * commit_session() (finish_weight_update) calls each chunk's own
  ///    load_weights with views of that chunk's staged tensors (batches of at most
  ///    64 MiB), chunk by chunk in order, on the processing executor; the session
  ///    then records its version. Only then does the model see the update. A
  ///    load_weights that throws during the commit marks the weights dirty with
  ///    the reason (the model may hold part of the update) and commit_session
  ///    rethrows.
  ///  * A failed or refused chunk discards the whole stage at once, and so does
  ///    discard_session() (an abort, the owner's silence or its connection
  ///    closing: lib/control/worker_host.h): the model's bytes and version are
  ///    exactly as before and the weights stay clean; commit_session() after a
  ///    failed chunk throws invalid_state and commits nothing.
  ///
  /// in_place chunks keep their rules inside a session: loaded as they arrive,
  /// dirty after a failure that had reached the model. The stage grows with the
  /// session (mremap: earlier chunks are not copied), is kept for later sessions
  /// (no allocation per update once it is large enough), and is freed by
  /// shutdown(); staged_bytes() is its size.
  void begin_session();
  /// See begin_session. Refused (invalid_state) while a chunk is being received.
  asio::awaitable<void> commit_session();
  /// See begin_session: drops every staged chunk of the open session (if any); the
  /// model is not touched. Refused (invalid_state) while a chunk is being received
  /// or committed.
  void discard_session();
  /// A session is open (begin_session, not yet committed or discarded).
  bool session_open() const noexcept { return session_open_; }
  /// Chunks staged in the open session, waiting for commit_session.
  std::size_t staged_chunks() const noexcept { return staged_.size(); }

  /// Completes when all deferred post-processing has finished; rethrows the first
  /// error it hit, once. Idempotent; a no-op for engines that do not defer.
  asio::awaitable<void> drain_pending();

  /// Closes connections and frees staging memory. Idempotent. Refused
  /// (invalid_state) while deferred processing is pending: drain_pending() first.
  /// Destroy an engine only when nothing is pending either.
  void shutdown();

  /// Statistics of the last completed update (processing times are final after
  /// drain_pending()).
  const update_stats& last_update_stats() const noexcept { return stats_; }

  bool initialized() const noexcept {
    return state_ == state::ready || state_ == state::receiving || state_ == state::committing;
  }
  /// Buckets whose deferred processing has not finished yet.
  std::size_t processing_pending() const noexcept { return deferred_.pending(); }
  bool receiving() const noexcept { return state_ == state::receiving; }

  /// True when a failed update may have left the model partly written (in_place
  /// after its first tensor, or a failing staged commit); dirty_reason() says
  /// which update failed and how. weight_update_session clears it when an update
  /// session finishes; direct users call mark_weights_clean() after a full update.
  bool weights_dirty() const noexcept { return !dirty_reason_.empty(); }
  const std::string& dirty_reason() const noexcept { return dirty_reason_; }
  void mark_weights_dirty(std::string reason);
  void mark_weights_clean() noexcept { dirty_reason_.clear(); }
  /// Called by weight_update_session when a session ends (finished or aborted).
  void session_finished() { do_session_finished(); }
  /// Host bytes held for staged commits: the stage's size (0 until the first
  /// staged update; kept across sessions, freed by shutdown()).
  std::uint64_t staged_bytes() const noexcept;
  const weight_transfer_config& config() const noexcept { return config_; }
  const engine_context& context() const noexcept { return context_; }
  /// Where post-processing runs: the context's processing executor, else a pool of
  /// config().processing_threads owned by the engine (created on first use).
  asio::any_io_executor processing_executor();
  /// The update the trainer is about to send will not be received: it was refused
  /// before its first byte (its update_info, the model's begin_update, the commit
  /// mode). Engines with a data path tell the trainer at once, with `kind` and
  /// `reason`, so its send fails now naming them instead of at its deadline, and
  /// close that path (init_transfer_engine again before the next update). The
  /// base calls it for the refusals it makes; the control plane for update_info
  /// it cannot read. Default: nothing (no data path).
  void refuse_update(errc kind, const std::string& reason) noexcept { do_refuse_update(kind, reason); }

  /// Why this engine cannot commit an update staged (empty when it can): the base
  /// refuses a staged update with errc::unsupported and this reason before any
  /// byte moves. Engines whose buckets land in device memory refuse (the stage is
  /// host memory for the whole update).
  virtual std::string staged_commit_refusal() const { return {}; }

 protected:
  virtual asio::awaitable<void> do_init(const init_info& info) = 0;
  virtual asio::awaitable<void> do_receive(const update_info& info, load_weights_fn load_weights) = 0;
  virtual void do_shutdown() = 0;
  /// See refuse_update.
  virtual void do_refuse_update(errc /*kind*/, const std::string& /*reason*/) noexcept {}
  /// An update session ended (finish or abort): engines release per-session
  /// resources here (e.g. IPC mappings). Default: nothing.
  virtual void do_session_finished() {}

  /// Where engines start deferred work; drain_pending() joins it.
  async::drain_scope& deferred() noexcept { return deferred_; }
  update_stats& mutable_stats() noexcept { return stats_; }
  /// The model to receive into directly for the update being received: the
  /// context's model for in_place updates (its writes are tracked for the dirty
  /// state), the engine's stage area for staged ones (bytes land there, never in
  /// the model, until the commit). Engines use this, not context().model.
  model_target* receive_target() noexcept;
  /// Throws invalid_argument "<backend>: <what> is for another engine" unless
  /// `info` is a T.
  template <class T, class Base>
  const T& downcast(const Base& info, std::string_view what) const {
    if (auto p = dynamic_cast<const T*>(&info)) return *p;
    throw_error(errc::invalid_argument, std::string(backend()) + ": " + std::string(what) +
                                            " was built by another engine");
  }

 private:
  enum class state { created, initializing, ready, receiving, committing, shut_down };
  class tracking_target;
  class stage_area;
  struct staged_chunk;
  class stage_target;

  asio::awaitable<void> receive_staged(const update_info& info, load_weights_fn load_weights);
  // The staged chunks' load_weights over their views, in order (commit_session).
  asio::awaitable<void> commit_staged(std::vector<std::unique_ptr<staged_chunk>> chunks);
  // Drops the staged chunks and empties the stage (its memory is kept).
  void clear_stage() noexcept;
  // Frees staged chunks (their metadata off the loop when large).
  void dispose(std::vector<std::unique_ptr<staged_chunk>> chunks) noexcept;
  void note_failure(const std::string& what, std::exception_ptr error);

  weight_transfer_config config_;
  engine_context context_;
  async::drain_scope deferred_;
  std::unique_ptr<asio::thread_pool> own_pool_;
  update_stats stats_;
  state state_ = state::created;
  int reading_ = 0;  // read_update_info calls running on the processing executor
  commit_mode mode_ = commit_mode::in_place;  // of the update being received (or last)
  std::atomic<bool> touched_{false};          // the model saw bytes of that update
  std::unique_ptr<tracking_target> tracker_;
  std::unique_ptr<stage_area> stage_;
  std::unique_ptr<stage_target> stage_target_;  // receives a staged chunk into stage_
  // The update session (begin_session .. commit_session / discard_session).
  bool session_open_ = false;
  bool session_failed_ = false;                // a chunk of it failed: its stage was discarded
  std::optional<commit_mode> session_mode_;    // of its first chunk
  std::vector<std::unique_ptr<staged_chunk>> staged_;
  std::string dirty_reason_;
};

/// Implements parse_init_info / parse_update_info for typed infos. InitInfo and
/// UpdateInfo provide `static X read(json_reader&)`; members not read are rejected.
template <class InitInfo, class UpdateInfo>
class typed_engine : public weight_transfer_engine {
 public:
  using init_info_type = InitInfo;
  using update_info_type = UpdateInfo;
  using weight_transfer_engine::weight_transfer_engine;

  std::unique_ptr<init_info> parse_init_info(const json& j) const override {
    json_reader r(j, std::string(backend()) + " init_info");
    auto info = std::make_unique<InitInfo>(InitInfo::read(r));
    r.finish();
    return info;
  }
  std::unique_ptr<update_info> parse_update_info(const json& j) const override {
    json_reader r(j, std::string(backend()) + " update_info");
    auto info = std::make_unique<UpdateInfo>(UpdateInfo::read(r));
    r.finish();
    return info;
  }

 protected:
  virtual asio::awaitable<void> init(const InitInfo& info) = 0;
  virtual asio::awaitable<void> receive(const UpdateInfo& info, load_weights_fn load_weights) = 0;

 private:
  asio::awaitable<void> do_init(const init_info& info) final {
    co_await init(this->template downcast<InitInfo>(info, "init_info"));
  }
  asio::awaitable<void> do_receive(const update_info& info, load_weights_fn fn) final {
    co_await receive(this->template downcast<UpdateInfo>(info, "update_info"), std::move(fn));
  }
};

}  // namespace refit
