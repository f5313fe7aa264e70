// What a worker_host is made of, shared by its verbs (lib/control/internal/verbs/):
// the engine and its session, the session's owner, the RPC server, the
// application's hooks and what the host reports in weight_info.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <string>

#include <refit/control/internal/rpc_server.h>
#include <refit/control/internal/session_owner.h>
#include <refit/control/worker_host.h>

namespace refit::control::internal {

struct worker_state {
  worker_state(weight_transfer_config config, engine_context context, load_weights_fn load_weights,
               engine_factory& factory, host_limits limits);
  worker_state(const worker_state&) = delete;
  worker_state& operator=(const worker_state&) = delete;

  /// Records a verb's failure as last_error ("<method>: <kind>: <message>") and
  /// its kind as last_error_kind.
  void note_error(const std::string& method, std::exception_ptr e);
  /// Records what ended a session that no verb's error describes (an abort, a
  /// rollback), with its kind.
  void set_error(std::string text, errc kind);
  void clear_error() noexcept;
  /// "clean", "updating" or "dirty" (weight_info's "state").
  std::string weight_state() const;
  /// The last update's receive stats, with "transport" (what the engine's
  /// transport chose, as in the init answer) where the engine reports one.
  json update_stats() const;

  // The hooks: what one throws is recorded (last_hook_error) and returned, never thrown.
  std::exception_ptr update_started() noexcept;
  std::exception_ptr update_finished(const json& stats) noexcept;
  void update_failed(const std::string& reason, errc kind) noexcept;
  /// on_update_failed with what last_error says.
  void update_failed() noexcept { update_failed(last_error, last_error_kind); }

  weight_transfer_config config;
  engine_context context;
  load_weights_fn load_weights;
  host_limits limits;  // handshake_timeout and session_timeout resolved against the config
  std::unique_ptr<weight_transfer_engine> engine;
  weight_update_session session;
  rpc_server server;
  session_owner owner;
  update_hooks hooks;
  std::string last_hook_error;
  std::string last_error;
  errc last_error_kind{};  // errc{} exactly when last_error is empty
  // Commit modes: of the chunk being received (while session.receiving()) and of
  // the last chunk applied.
  std::optional<commit_mode> receiving_commit;
  std::optional<commit_mode> applied_commit;

 private:
  void note_hook_error(const char* hook, std::exception_ptr e) noexcept;
};

/// A hook's failure as the error a verb answers with: a refit::error keeps its
/// kind, anything else is processing_failed (the application's code threw).
error hook_error(const std::string& verb, const char* hook, std::exception_ptr e);

}  // namespace refit::control::internal
