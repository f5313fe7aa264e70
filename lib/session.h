// The weight-update session of vLLM's RL API on top of an engine:
// start_weight_update -> update_weights (one or more chunks) ->
// finish_weight_update(weight_version). One session is active at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <asio/awaitable.hpp>

#include <refit/engine.h>

namespace refit {

/// Orders the verbs of one weight update around an engine and records the weight
/// version. Misuse (start twice, update or finish without start, concurrent
/// update_weights) is refit::error(invalid_state). Use from the engine's executor.
///
/// Commit modes (the whole contract is at weight_transfer_engine::begin_session):
///  * staged: a session is all or nothing. update_weights receives each chunk
///    into the engine's stage (the model checks it first, begin_update, and sees
///    none of its bytes); finish_weight_update commits every chunk, each through
///    its own load_weights, in order, and only then records the version. A failed
///    chunk or an abort discards the stage: the model's bytes, the version and the
///    weights' state are exactly as before the session.
///  * in_place: chunks are loaded as they arrive; a session that fails or is
///    aborted after any of them reached the model leaves the weights dirty.
/// One session commits one way: a chunk whose mode differs from its earlier
/// chunks' is refused before any byte moves.
///
/// A failed chunk fails the session: later chunks are refused, and
/// finish_weight_update closes it without recording a version and throws
/// (invalid_state, naming the chunk and its error); abort it instead. (An
/// update_info that cannot be read is not a failed chunk: nothing was received.)
/// The session itself has no deadline here; control::worker_host gives it one
/// (its owner's silence, lib/control/worker_host.h).
class weight_update_session {
 public:
  explicit weight_update_session(weight_transfer_engine& engine) : engine_(engine) {}

  /// Opens a session; throws invalid_state when one is already active.
  void start_weight_update();

  /// Receives one chunk of the update into `load_weights` (in_place), or into the
  /// stage for load_weights to see at finish_weight_update (staged). Refused
  /// (invalid_state) after a chunk of this session failed.
  asio::awaitable<void> update_weights(const update_info& info, load_weights_fn load_weights);
  /// Same, parsing `update_info_json` with the engine's parser first.
  asio::awaitable<void> update_weights(const json& update_info_json, load_weights_fn load_weights);

  /// Drains deferred processing, commits the staged chunks (each through its own
  /// load_weights, in order), records `weight_version` and closes the session. If
  /// draining or the commit fails, or a chunk of the session had failed, the
  /// session still closes (the error is rethrown) and the version is not
  /// recorded. A session that finishes without any failure clears the engine's
  /// dirty mark (the trainer sent a full update).
  asio::awaitable<void> finish_weight_update(std::optional<std::int64_t> weight_version = std::nullopt);

  /// The first phase of a fleet-atomic update (two-phase commit, see
  /// control::update_options::fleet_atomic): drains deferred processing and
  /// checks that the session holds its whole update staged, nothing of it
  /// applied, no chunk failed. Then the session is prepared: it takes no more
  /// chunks, and finish_weight_update commits it or abort_weight_update drops it.
  /// Throws invalid_state (the session stays open, to be aborted) otherwise.
  asio::awaitable<void> prepare_weight_update();

  /// Makes the active session undoable (a fleet-atomic update): each chunk is
  /// refused before any byte moves (unsupported, naming the tensor) unless the
  /// model can read back every tensor of it, and finish_weight_update keeps the
  /// previous version in the stage (weight_transfer_engine's "Undo"), for
  /// rollback_weight_update until the next session starts or release_undo().
  void require_undo();
  /// Returns the model to the version before the last finish of an undoable
  /// session, and records that version again. Refused (invalid_state) while a
  /// session is active or without an undo. A rollback that fails part-way leaves
  /// the weights dirty and the session claims no version.
  asio::awaitable<void> rollback_weight_update();
  /// Drops the kept previous version (its stage memory is given back).
  void release_undo() noexcept;
  /// An undo is held: the version rollback_weight_update returns to (nullopt
  /// inside when that version was unlabelled).
  bool holds_undo() const noexcept;
  std::optional<std::int64_t> undo_version() const noexcept { return undo_version_; }

  /// Closes an active session without recording a version (after a failure, or
  /// when its owner is gone). Staged chunks are discarded: the weights are as
  /// before. If in_place chunks of it were already applied, the weights are a mix
  /// of two versions: the engine is marked dirty, with `why` (when given) in the
  /// reason. Refused (invalid_state) while a chunk is being received: its bytes
  /// may be reaching the model, and only its end says how far they got.
  asio::awaitable<void> abort_weight_update(std::string why = {});

  bool active() const noexcept { return active_; }
  /// True while a chunk (update_weights) is being received.
  bool receiving() const noexcept { return updating_ || reading_; }
  /// True while finish_weight_update drains and commits (the session is no longer
  /// active, and the model is changing: a staged commit, in_place processing).
  bool finishing() const noexcept { return finishing_; }
  /// True once prepare_weight_update succeeded, until the session closes.
  bool prepared() const noexcept { return prepared_; }
  /// The version recorded by the last successful finish, if any.
  std::optional<std::int64_t> weight_version() const noexcept { return version_; }
  /// Chunks received in the active (or last) session.
  std::uint64_t chunks() const noexcept { return chunks_; }
  /// Why a chunk of the active (or last) session failed ("chunk 2: <kind>:
  /// <message>"); empty when none did.
  const std::string& failure() const noexcept { return failure_; }

 private:
  weight_transfer_engine& engine_;
  bool active_ = false;
  bool updating_ = false;
  bool reading_ = false;    // update_weights(json): its update_info is being read off the loop
  bool finishing_ = false;  // finish_weight_update is draining or committing
  bool preparing_ = false;  // prepare_weight_update is draining
  bool prepared_ = false;   // prepare_weight_update succeeded: no more chunks
  bool undoable_ = false;   // require_undo(): the finish keeps the previous version
  std::uint64_t chunks_ = 0;
  std::uint64_t applied_ = 0;  // in_place chunks of the active session (they reached the model)
  std::string failure_;        // a chunk of the active session failed: how
  std::optional<std::int64_t> version_;
  std::optional<std::int64_t> undo_version_;  // the version an undo held returns to
};

}  // namespace refit
