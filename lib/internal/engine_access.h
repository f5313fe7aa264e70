// How weight_update_session, the control plane and the Python module coordinate
// with an engine: update sessions (staged commits), dirty marks and refusals. Not
// part of any API: these calls have rules (lib/backend/engine.h, "Staged commits")
// that only the session and the control plane keep. They are private virtuals of
// weight_transfer_engine (lib/engine.h), implemented by backend::engine: the core
// needs nothing of the backend API for them.
#pragma once

#include <cstddef>
#include <string>

#include <asio/awaitable.hpp>

#include <refit/engine.h>

namespace refit::internal {

class engine_access {
 public:
  static void begin_session(weight_transfer_engine& e) { e.begin_session(); }
  static asio::awaitable<void> commit_session(weight_transfer_engine& e, bool keep_undo = false) {
    return e.commit_session(keep_undo);
  }
  /// Why the engine could not undo a commit of `meta` (empty: it can).
  static std::string undo_refusal(weight_transfer_engine& e, const update_metadata& meta) {
    return e.undo_refusal(meta);
  }
  /// The commit's undo scratch, reserved at the vote (resource_exhausted: it cannot be).
  static asio::awaitable<void> reserve_undo(weight_transfer_engine& e) { return e.reserve_undo(); }
  static asio::awaitable<void> rollback_session(weight_transfer_engine& e) { return e.rollback_session(); }
  static void release_undo(weight_transfer_engine& e) noexcept { e.release_undo(); }
  static bool holds_undo(const weight_transfer_engine& e) noexcept { return e.holds_undo(); }
  static void discard_session(weight_transfer_engine& e) { e.discard_session(); }
  static bool session_open(const weight_transfer_engine& e) noexcept { return e.session_open(); }
  static std::size_t staged_chunks(const weight_transfer_engine& e) noexcept { return e.staged_chunks(); }
  static void mark_weights_dirty(weight_transfer_engine& e, std::string reason) {
    e.mark_weights_dirty(std::move(reason));
  }
  static void session_finished(weight_transfer_engine& e) { e.session_finished(); }
  static void refuse_update(weight_transfer_engine& e, errc kind, const std::string& reason) noexcept {
    e.refuse_update(kind, reason);
  }
  /// The engine's processing executor: where the control plane parses large
  /// requests and serializes large answers off the event loop.
  static asio::any_io_executor processing_executor(weight_transfer_engine& e) { return e.offload_executor(); }
};

}  // namespace refit::internal
