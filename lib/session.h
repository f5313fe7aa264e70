// The weight-update session of vLLM's RL API on top of an engine:
// start_weight_update -> update_weights (one or more chunks) ->
// finish_weight_update(weight_version). One session is active at a time.
#pragma once

#include <cstdint>
#include <optional>

#include <asio/awaitable.hpp>

#include <refit/engine.h>

namespace refit {

/// Orders the verbs of one weight update around an engine and records the weight
/// version. Misuse (start twice, update or finish without start, concurrent
/// update_weights) is refit::error(invalid_state). Use from the engine's executor.
class weight_update_session {
 public:
  explicit weight_update_session(weight_transfer_engine& engine) : engine_(engine) {}

  /// Opens a session; throws invalid_state when one is already active.
  void start_weight_update();

  /// Receives one chunk of the update into `load_weights`.
  asio::awaitable<void> update_weights(const update_info& info, load_weights_fn load_weights);
  /// Same, parsing `update_info_json` with the engine's parser first.
  asio::awaitable<void> update_weights(const json& update_info_json, load_weights_fn load_weights);

  /// Drains deferred processing, records `weight_version` and closes the session.
  /// If draining fails the session still closes (the error is rethrown) and the
  /// version is not recorded. A session that finishes without any failure clears
  /// the engine's dirty mark (the trainer sent a full update).
  asio::awaitable<void> finish_weight_update(std::optional<std::int64_t> weight_version = std::nullopt);

  /// Closes an active session without recording a version (after a failure). If
  /// chunks of it were already applied, the weights are a mix of two versions: the
  /// engine is marked dirty, with `why` (when given) in the reason. Refused
  /// (invalid_state) while a chunk is being received: its bytes may be reaching
  /// the model, and only its end says how far they got.
  asio::awaitable<void> abort_weight_update(std::string why = {});

  bool active() const noexcept { return active_; }
  /// True while a chunk (update_weights) is being received.
  bool receiving() const noexcept { return updating_ || reading_; }
  /// The version recorded by the last successful finish, if any.
  std::optional<std::int64_t> weight_version() const noexcept { return version_; }
  /// Chunks received in the active (or last) session.
  std::uint64_t chunks() const noexcept { return chunks_; }

 private:
  weight_transfer_engine& engine_;
  bool active_ = false;
  bool updating_ = false;
  bool reading_ = false;  // update_weights(json): its update_info is being read off the loop
  std::uint64_t chunks_ = 0;
  bool failed_ = false;  // a chunk of the active session failed
  std::optional<std::int64_t> version_;
};

}  // namespace refit
