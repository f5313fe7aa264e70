// The backend author's engine base: what an engine folder implements (the
// contract, sectioned below) and what it may call. Every worker-side engine is a
// backend::engine; users see it as a weight_transfer_engine (engine.h), whose
// members this class implements once for all backends: call-order checks, the
// model target's checks and dirty tracking, staged commits and update sessions,
// off-loop parsing, the processing pool.
//
// The contract, in three parts:
//
//  REQUIRED of every engine
//    backend()                      its registered name
//    parse_init_info / parse_update_info
//                                   typed infos from JSON (typed_engine below
//                                   implements both from `static X read(json_reader&)`)
//    do_init(info)                  connect to the trainer; may be called again
//    do_receive(info, load_weights) receive one update: every tensor to
//                                   load_weights (or into receive_target()'s
//                                   destinations), buckets in order
//    do_shutdown()                  close connections, free buffers; idempotent
//    static capabilities_of()       what it can do (engine_capabilities), given to
//                                   this base's constructor and to the factory
//                                   (backend_type_registration reads it)
//
//  REQUIRED WHEN A CAPABILITY IS CLAIMED
//    direct_receive    receive into receive_target()->destination(spec) when it
//                      offers memory (call direct_write_begins() before the first
//                      byte lands there)
//    defers_processing start post-processing on deferred() and complete
//                      do_receive when the last byte has arrived
//    staged_commit     nothing more: the base stages (it receives through
//                      receive_target(), which is then the stage); an engine that
//                      cannot (device buffers) does not claim it, and the base
//                      refuses staged updates with staged_commit_refusal()
//    checksums         verify each bucket's checksum before load_weights sees it
//    relay, sharded    honour the trainer's topology / layouts in the init info
//
//  OPTIONAL
//    do_refuse_update(kind, reason) tell the trainer at once that the update it
//                                   is about to send is refused (engines with a
//                                   data path; default: nothing, the trainer fails
//                                   at its deadline)
//    do_session_committed()         an update session's staged chunks reached the model
//    do_session_finished()          release per-session resources (IPC mappings)
//    staged_commit_refusal()        why staged updates are refused (see above)
//
//  CALLABLE by engines: config(), context(), deferred(), mutable_stats(),
//  receive_target(), processing_executor(), downcast<T>().
//
// What else backends use: the receive pipeline (backend/pipeline.h), bucket plans,
// slot rings and drain scopes (backend/async/), net helpers, checksums, the
// trainer-worker links (backend/links/), the plugin boundary (backend/plugin.h).
// Bases that implement this contract but for the transport: links/engine_base.h
// (buckets that cross no byte stream), links/stream_engine.h (one stream per
// worker, relayed or not), sharded_engine.h (M:N).
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <asio/thread_pool.hpp>

#include <refit/backend/async/drain_scope.h>
#include <refit/config.h>
#include <refit/engine.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>

namespace refit {

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

namespace backend {

class engine : public weight_transfer_engine {
 public:
  ~engine() override;

  // weight_transfer_engine, implemented once for every backend.
  const engine_capabilities& capabilities() const noexcept final { return capabilities_; }
  bool defers_processing() const noexcept final { return capabilities_.defers_processing; }
  asio::awaitable<std::unique_ptr<update_info>> read_update_info(const json& j) final;
  asio::awaitable<void> init_transfer_engine(const init_info& info) final;
  asio::awaitable<void> receive_weights(const update_info& info, load_weights_fn load_weights) final;
  asio::awaitable<void> drain_pending() final;
  void shutdown() final;
  const update_stats& last_update_stats() const noexcept final { return stats_; }
  bool initialized() const noexcept final {
    return state_ == state::ready || state_ == state::receiving || state_ == state::committing;
  }
  std::size_t processing_pending() const noexcept final { return deferred_.pending(); }
  bool receiving() const noexcept final { return state_ == state::receiving; }
  bool weights_dirty() const noexcept final { return !dirty_reason_.empty(); }
  const std::string& dirty_reason() const noexcept final { return dirty_reason_; }
  void mark_weights_clean() noexcept final { dirty_reason_.clear(); }
  std::uint64_t staged_bytes() const noexcept final;
  const weight_transfer_config& config() const noexcept final { return config_; }
  const engine_context& context() const noexcept final { return context_; }

 protected:
  engine(weight_transfer_config config, engine_context context, engine_capabilities capabilities);

  // ---- required (see the top of this file)
  virtual asio::awaitable<void> do_init(const init_info& info) = 0;
  virtual asio::awaitable<void> do_receive(const update_info& info, load_weights_fn load_weights) = 0;
  virtual void do_shutdown() = 0;

  // ---- optional
  /// The update the trainer is about to send will not be received: it was refused
  /// before its first byte (its update_info, the model's begin_update, the commit
  /// mode, the stage). Tell the trainer at once, with `kind` and `reason`, so its
  /// send fails now naming them instead of at its deadline, and close that path
  /// (init_transfer_engine again before the next update). The base calls it for
  /// the refusals it makes; the control plane for update_info it cannot read.
  virtual void do_refuse_update(errc /*kind*/, const std::string& /*reason*/) noexcept {}
  /// The staged chunks of an update session were committed: the model now holds
  /// them (called before do_session_finished; not when the commit failed or the
  /// session was discarded).
  virtual void do_session_committed() {}
  /// An update session ended (finish or abort): release per-session resources here
  /// (e.g. IPC mappings).
  virtual void do_session_finished() {}
  /// Why this engine cannot commit an update staged (empty when it can): the base
  /// refuses a staged update with errc::unsupported and this reason before any
  /// byte moves. Engines whose buckets land in device memory refuse (the stage is
  /// host memory for the whole update).
  virtual std::string staged_commit_refusal() const { return {}; }

  // ---- callable
  /// Where engines start deferred work; drain_pending() joins it.
  async::drain_scope& deferred() noexcept { return deferred_; }
  update_stats& mutable_stats() noexcept { return stats_; }
  /// The model to receive into directly for the update being received: the
  /// context's model for in_place updates (its writes are tracked for the dirty
  /// state), the engine's stage area for staged ones (bytes land there, never in
  /// the model, until the commit). Engines use this, not context().model.
  model_target* receive_target() noexcept;
  /// True while a staged chunk of an update session opened by begin_session is
  /// received: it is committed (or discarded) later, by the session, not at the end
  /// of this receive. False for in_place updates and for staged ones received
  /// outside a session (committed before receive_weights completes).
  bool receiving_into_open_session() const noexcept { return staging_in_session_; }
  /// Where post-processing runs: the context's processing executor, else a pool of
  /// config().processing_threads owned by the engine (created on first use).
  asio::any_io_executor processing_executor();
  /// Throws invalid_argument "<backend>: <what> is for another engine" unless
  /// `info` is a T.
  template <class T, class Base>
  const T& downcast(const Base& info, std::string_view what) const {
    if (auto p = dynamic_cast<const T*>(&info)) return *p;
    throw_error(errc::invalid_argument,
                std::string(backend()) + ": " + std::string(what) + " was built by another engine");
  }

 private:
  // weight_update_session and the control plane call these through
  // internal/engine_access.h (weight_transfer_engine's private interface).

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
  ///  * Undo (fleet-atomic updates): commit_session(true) reads each tensor's
  ///    current bytes back from the context's model (model_target::read_back)
  ///    just before its batch is loaded and writes them into the stage in place
  ///    of the new bytes, so after the commit the stage holds the previous
  ///    version at no extra memory (a scratch of one batch, at most 64 MiB,
  ///    reserved at the vote by reserve_undo(), so a worker that cannot hold it
  ///    votes no instead of failing at its commit). A chunk whose load_weights is
  ///    the model's own (model_target::as_load_weights) and whose model can
  ///    exchange (model_target::can_exchange) is committed by exchange() instead:
  ///    one pass swapping model and stage bytes, no read back, no scratch.
  ///    rollback_session() loads the stage back through each chunk's own
  ///    load_weights; release_undo() (and the next begin_session) drops it. A
  ///    commit that keeps its undo and fails part-way loads back what it had
  ///    changed (the failing batch from its scratch) and rethrows: the model is
  ///    the previous version again, clean; only a failure of that restore leaves
  ///    the weights dirty. undo_refusal(meta) names the first tensor the model
  ///    cannot read back (empty when it can read them all).
  ///
  /// in_place chunks keep their rules inside a session: loaded as they arrive,
  /// dirty after a failure that had reached the model. The stage grows with the
  /// session (mremap: earlier chunks are not copied), is kept for later sessions
  /// (no allocation per update once it is large enough), and is freed by
  /// shutdown(); staged_bytes() is its size.
  void begin_session() final;
  /// See begin_session. Refused (invalid_state) while a chunk is being received.
  asio::awaitable<void> commit_session(bool keep_undo) final;
  std::string undo_refusal(const update_metadata& meta) final;
  /// See begin_session ("Undo"): the commit's scratch for the staged session
  /// (its largest batch), allocated and faulted in now, kept for later sessions,
  /// freed by shutdown(); resource_exhausted when it cannot be, or when it and
  /// the stage together would exceed max_stage_bytes. The vote calls it.
  asio::awaitable<void> reserve_undo() final;
  /// See begin_session ("Undo"). Refused (invalid_state) without an undo or while
  /// a session is open or being committed.
  asio::awaitable<void> rollback_session() final;
  void release_undo() noexcept final;
  bool holds_undo() const noexcept final { return !undo_.empty(); }
  /// See begin_session: drops every staged chunk of the open session (if any); the
  /// model is not touched. Refused (invalid_state) while a chunk is being received
  /// or committed.
  void discard_session() final;
  bool session_open() const noexcept final { return session_open_; }
  std::size_t staged_chunks() const noexcept final { return staged_.size(); }
  void mark_weights_dirty(std::string reason) final;
  void session_finished() final { do_session_finished(); }
  void refuse_update(errc kind, const std::string& reason) noexcept final { do_refuse_update(kind, reason); }
  asio::any_io_executor offload_executor() final { return processing_executor(); }

  enum class state { created, initializing, ready, receiving, committing, shut_down };
  class tracking_target;
  class stage_area;
  struct staged_chunk;
  class stage_target;

  asio::awaitable<void> receive_staged(const update_info& info, load_weights_fn load_weights);
  // The staged chunks' load_weights over their views, in order (commit_session).
  // With keep_undo the stage ends holding the previous bytes, and the chunks are
  // kept in undo_.
  asio::awaitable<void> commit_staged(std::vector<std::unique_ptr<staged_chunk>> chunks, bool keep_undo = false);
  // commit_staged's steps: one chunk's batches into the model (with `model`, the
  // undo's, each batch's previous bytes kept in the stage and recorded in
  // `progress`), and after a failure part-way, the previous version loaded back
  // from what `progress` recorded (the weights marked dirty when that fails).
  struct commit_progress;
  asio::awaitable<void> commit_chunk(staged_chunk& chunk, model_target* model, commit_progress& progress);
  asio::awaitable<void> restore_previous(const commit_progress& progress, std::exception_ptr failure);
  // reserve_undo's work for `chunks` (staged_, or those commit_staged holds).
  asio::awaitable<void> reserve_scratch(const std::vector<std::unique_ptr<staged_chunk>>& chunks);
  // Drops the staged chunks and empties the stage (its memory is kept).
  void clear_stage() noexcept;
  // Frees staged chunks (their metadata off the loop when large).
  void dispose(std::vector<std::unique_ptr<staged_chunk>> chunks) noexcept;
  void note_failure(const std::string& what, std::exception_ptr error);

  weight_transfer_config config_;
  engine_context context_;
  engine_capabilities capabilities_;
  async::drain_scope deferred_;
  std::unique_ptr<asio::thread_pool> own_pool_;
  update_stats stats_;
  state state_ = state::created;
  int reading_ = 0;                           // read_update_info calls running on the processing executor
  commit_mode mode_ = commit_mode::in_place;  // of the update being received (or last)
  std::atomic<bool> touched_{false};          // the model saw bytes of that update
  std::unique_ptr<tracking_target> tracker_;
  std::unique_ptr<stage_area> stage_;
  std::unique_ptr<stage_target> stage_target_;  // receives a staged chunk into stage_
  // The update session (begin_session .. commit_session / discard_session).
  bool session_open_ = false;
  bool session_failed_ = false;              // a chunk of it failed: its stage was discarded
  bool staging_in_session_ = false;          // receiving a staged chunk of a begin_session session
  std::optional<commit_mode> session_mode_;  // of its first chunk
  std::vector<std::unique_ptr<staged_chunk>> staged_;
  std::vector<std::unique_ptr<staged_chunk>> undo_;  // committed chunks whose stage holds the previous bytes
  std::unique_ptr<std::byte[]> undo_scratch_;        // reserve_undo: one batch's previous bytes at a commit
  std::uint64_t undo_scratch_bytes_ = 0;
  std::string dirty_reason_;
};

/// Implements parse_init_info for a typed init info over `Base`, an engine base
/// that implements the rest (typed_engine below, links::stream_engine,
/// sharded_worker_base). InitInfo provides `static X read(json_reader&)`; members
/// not read are rejected.
template <class InitInfo, class Base = engine>
class typed_init : public Base {
 public:
  using init_info_type = InitInfo;

  std::unique_ptr<init_info> parse_init_info(const json& j) const override {
    json_reader r(j, std::string(this->backend()) + " init_info");
    auto info = std::make_unique<InitInfo>(InitInfo::read(r));
    r.finish();
    return info;
  }

 protected:
  using Base::Base;
};

/// Implements parse_init_info / parse_update_info for typed infos. InitInfo and
/// UpdateInfo provide `static X read(json_reader&)`; members not read are rejected.
template <class InitInfo, class UpdateInfo>
class typed_engine : public typed_init<InitInfo> {
 public:
  using update_info_type = UpdateInfo;

  std::unique_ptr<update_info> parse_update_info(const json& j) const override {
    json_reader r(j, std::string(this->backend()) + " update_info");
    auto info = std::make_unique<UpdateInfo>(UpdateInfo::read(r));
    r.finish();
    return info;
  }

 protected:
  using typed_init<InitInfo>::typed_init;

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

}  // namespace backend
}  // namespace refit
