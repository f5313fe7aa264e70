// The worker side of the control plane: owns one engine and serves the weight
// transfer verbs of vLLM's RL API (init_weight_transfer_engine,
// start_weight_update, update_weights, finish_weight_update, weight_info,
// weight_fingerprint) over framed JSON, with vLLM's request bodies.
//
// The protocol is described once, in docs/control-plane.md: the verbs and their
// answers (weight_info's members included), the request and answer frames and
// what a malformed one gets, the handshake every connection starts with, who owns
// a session and when it is aborted (its owner's connection closing, its owner's
// silence), what an ended session leaves, the limits that keep a client from
// starving or bloating the host, and the memory a large frame leaves behind.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/control/limits.h>
#include <refit/engine.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/model/tensor_map_target.h>
#include <refit/session.h>

namespace refit::control {

namespace internal {
struct worker_state;
}

/// An application's hooks on the weight-update session, e.g. an inference server
/// that flushes its KV cache and bumps its served version when an update lands.
/// They wrap the built-in verbs (the session's bookkeeping, version, state, dirty
/// reason and owner, is the same with or without them) and are called:
///
///  * on the host's event loop (the engine_context's executor, where every verb
///    runs), synchronously, inside the verb, before its answer is written: when
///    finish_weight_update answers, on_update_finished has returned. Keep them
///    short and non-blocking: while one runs no request is served and no weight
///    is received. Post long work elsewhere. A hook may read weight_info() (it
///    already shows the state the hook is called for); it must not call stop() or
///    destroy the host.
///  * in pairs: every on_update_started that returns normally is followed by
///    exactly one on_update_finished or on_update_failed for that session (a
///    rollback_weight_update, after the session, adds one on_update_finished).
///
/// What a hook throws never escapes into the host; it is recorded in weight_info's
/// "last_hook_error" ("<hook>: <kind>: <message>"), and:
///  * on_update_started: the application refuses the session. It is closed again
///    (nothing was received, so the weights are untouched), start_weight_update
///    answers with the hook's error (a refit::error keeps its kind; anything else
///    is processing_failed), and no other hook is called for it.
///  * on_update_finished: the update stays committed (clean at its version, as
///    weight_info says), but finish_weight_update answers with the hook's error
///    (also in last_error), so the trainer learns that this server did not take
///    it in.
///  * on_update_failed: the failure being reported is the news; the verb answers
///    as it would have.
struct update_hooks {
  /// start_weight_update opened a session; `owner` names its connection
  /// ("connection #3 (127.0.0.1:40000)").
  std::function<void(const std::string& owner)> on_update_started;
  /// finish_weight_update closed the session and the state is clean at `version`:
  /// the version the finish named, else the one recorded before it, else -1 (none
  /// was ever recorded). `stats` is the finish's answer's "stats".
  std::function<void(std::int64_t version, const json& stats)> on_update_finished;
  /// The session ended without a clean finish; `reason` says how: a chunk failed
  /// ("update_weights: <kind>: <message>", the update refused before its first byte
  /// included), its owner's connection closed, its owner re-initialised the engine,
  /// the finish failed, or it finished with the weights still dirty. weight_info()
  /// says whether the weights are dirty (and why). A fleet-atomic commit that
  /// failed loaded the previous version back through load_weights: weight_info()
  /// then says clean at that version, and a tensor_map_target should be told
  /// finish(that version), not abort() (which would mark its readers dirty):
  /// tensor_map_hooks() below does so.
  /// rollback_weight_update calls on_update_finished with the version it
  /// returned to (no on_update_started before it).
  /// `kind` is what ended it (branch on it, never on the text; weight_info's
  /// "last_error_kind" is the same where "last_error" records the failure): a
  /// failed verb's error kind; timeout when its owner fell silent; peer_lost when
  /// its owner's connection closed; the kind the trainer's abort_weight_update
  /// named (default cancelled); cancelled when its owner re-initialised the
  /// engine; invalid_state when it finished with the weights still dirty.
  std::function<void(const std::string& reason, errc kind)> on_update_failed;
};

/// What one worker host grants its clients.
struct host_limits {
  /// Connections served at once; one more is refused (resource_exhausted on its side).
  std::size_t max_connections = 256;
  /// Requests of one connection being handled at once; beyond, its frames wait
  /// in the kernel (back-pressure) until an answer is written.
  std::size_t max_requests_in_flight = 32;
  /// Requests one connection may start per second (a token bucket with a burst of
  /// max_requests_in_flight); beyond, its reading pauses. A client that floods the
  /// host gets this much of the event loop, which receives weights too; 0: no cap.
  double max_requests_per_second = 1000;
  /// The authentication handshake's deadline (at most the config's timeout).
  std::chrono::milliseconds handshake_timeout{10000};
  /// How long a session's owner may send nothing (no request, no chunk being
  /// received) before its session is aborted (docs/control-plane.md); 0: the
  /// config's timeout.
  std::chrono::milliseconds session_timeout{0};
  frame_limits frames;
};

class worker_host {
 public:
  /// A method: params in, result out; throw refit::error to answer with an error.
  using method = std::function<asio::awaitable<json>(const json& params)>;

  /// Creates the engine for config.backend from `factory`; `load_weights` receives
  /// every update's tensors.
  worker_host(weight_transfer_config config, engine_context context, load_weights_fn load_weights,
              engine_factory& factory = engine_factory::instance(), host_limits limits = {});
  ~worker_host();

  /// Listens on host:port (0: any free port); returns the port.
  std::uint16_t listen(const std::string& host, std::uint16_t port);
  /// Accepts and serves connections until stop().
  asio::awaitable<void> serve();
  /// Closes the listener and every connection; the engine is shut down.
  void stop();

  /// Adds (or replaces) a method, e.g. an application's own query. The built-in
  /// verbs cannot be replaced.
  void add_method(const std::string& name, method m);

  /// Sets the application's session hooks (replacing any set before). Call it
  /// before serve(), or on the host's event loop.
  void set_hooks(update_hooks hooks);

  /// What the weight_info verb answers (docs/control-plane.md), for the
  /// application that runs this host. Call it on the host's event loop.
  json weight_info() const;

  /// The engine and its session, to look at (their state is also weight_info()'s);
  /// only the verbs change them, so that the session's ownership rules hold.
  const weight_transfer_engine& engine() const;
  const weight_update_session& session() const;
  /// Completes when the engine's deferred processing has finished (before a
  /// process that embeds the host stops); rethrows what it hit, once.
  asio::awaitable<void> drain_pending();
  /// Connections being served now (accepted and not yet closed).
  std::size_t connection_count() const noexcept;

 private:
  std::unique_ptr<internal::worker_state> state_;
};

/// The hooks that keep a tensor_map_target serving exactly what `host` holds, with
/// `also`'s hooks (each optional) run after: an update or a rollback that ends
/// clean at a version finishes the target at it; a failed one aborts the target
/// (its readers see it dirty, as the weights are) unless the engine is clean
/// again, as after a fleet-atomic commit that loaded the previous version back,
/// where the target is finished at that version instead. Pass the result to
/// host.set_hooks; `host` and `target` must outlive it.
update_hooks tensor_map_hooks(const worker_host& host, tensor_map_target& target, update_hooks also = {});

}  // namespace refit::control
