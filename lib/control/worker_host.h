// The worker side of the control plane: owns one engine and serves the weight
// transfer verbs of vLLM's RL API over framed JSON, with vLLM's request bodies:
//
//   init_weight_transfer_engine  {"init_info": {...}}
//       -> {} or {"transport": ...} (weight_transfer_engine::transport_info())
//   start_weight_update          {}
//   update_weights               {"update_info": {...}}
//   finish_weight_update         {"weight_version": int}   (optional member)
//   weight_info                  {}
//       -> {"weight_version", "state": "clean" | "updating" | "dirty", "dirty_reason",
//           "session_active", "session_owner", "session_idle_ms" (how long its
//           owner has been silent; null without a session), "session_timeout_ms",
//           "session_chunks" (chunks received in the open session; null without),
//           "receiving", "commit", "default_commit",
//           "last_update": stats, "last_error", "last_hook_error",
//           "last_refused_connection", "connections", "accept_errors",
//           "last_accept_error", "transport" (what the engine's transport chose;
//           null for most), ...}
//       "commit" is the commit mode of the chunk being received, else of the last
//       chunk applied (its update_info's "commit", else the config's), else the
//       config's; "default_commit" is always the config's (worker_host::weight_info()
//       answers the same without a connection).
//   weight_fingerprint           {"names": [str]}  (optional; all weights when absent)
//       -> {"algorithm", "tensors": {name: hex}, "weight_version", "state"}
//          (needs the engine context's model_target; see lib/fingerprint.h)
//
// A request is {"id": int, "method": str, "params": {...}}; the answer is
// {"id": int, "result": {...}} or {"id": int, "error": {"kind": str, "message": str}}.
// Every request runs in its own coroutine, so weight_info (or any other method)
// is answered while an update is in flight. A frame whose body is not JSON is
// answered with
//   {"id": null, "error": {"kind": "protocol_error", "message": "control request:
//    malformed JSON frame of M bytes, at byte N: <what the parser expected> (the
//    request's id cannot be read: this answer's is null)"}}
// and one that nests deeper than max_json_depth (64) or would parse into more than
// host_limits.frames.max_values values with protocol_error naming the limit ("JSON
// frame nests 65 levels deep, deeper than the limit of 64 levels") and the
// request's own id (read with everything below the top level discarded), so a
// control::client's call fails with that reason; either way the connection goes
// on serving: its length prefix was honoured, so the next frame starts where it
// should. A length over host_limits.frames.max_bytes is answered with id null,
// then the connection is closed (the framing is lost).
//
// The handshake. Every control connection starts with lib/auth.h's handshake,
// with or without a secret, before any frame: the host writes a 48-byte challenge
// (magic "RFTA", version 1, flags, a random nonce), reads the client's 80-byte
// response, and writes a 48-byte verdict. Without a secret on either side
// (config.auth_secret empty, control::client's secret empty), the flags say "no
// secret", the macs are not checked (zeros) and the verdict is ok: the connection
// is unauthenticated but the 176 bytes are exchanged all the same, so a client must
// run auth::as_client(socket, "", ...) (control::client::connect does) before its
// first frame; a peer that sends frames at once is refused (protocol_error: no
// "RFTA" magic) and one that sends nothing is cut at host_limits.handshake_timeout
// (at most config.timeout). A secret on one side only fails on both (auth_error,
// and the host reports it in weight_info's last_refused_connection). The
// connection cap rides on the same challenge, secret or not: a connection beyond
// host_limits.max_connections gets a challenge with the busy flag and is closed
// without reading anything, and its client fails with resource_exhausted.
//
// Sessions have an owner: the control connection whose start_weight_update opened
// it. update_weights and finish_weight_update from any other connection, and
// start_weight_update or init_weight_transfer_engine from any other connection
// while the session is open, are refused (invalid_state, naming the owner): a
// stale trainer or a second client cannot finish, cut short or re-initialise
// someone else's update. The owner's own init aborts its session first (refused
// while a chunk is being received). When the owner's connection closes, its
// session is aborted (at once, or when the chunk being received ends).
//
// A session has a deadline too: its owner's silence. When the owner sends
// nothing for host_limits::session_timeout (default: the config's timeout), no
// request on its connection and no chunk being received (a chunk's bytes have
// their own deadlines, and a request of the owner's that is still running, such
// as a long finish, counts as activity), the session is aborted: a trainer that
// froze (SIGSTOP, a stuck collective, a debugger) between its chunks and its
// finish no longer owns the worker forever. The reason names the owner and the
// silence ("its owner, connection #1 (127.0.0.1:5301), sent nothing for 1502 ms:
// no request, no data; the session timeout is 1500 ms"); it is last_error, and
// on_update_failed's reason. The worker is then free for a new trainer's init.
// The frozen trainer, when it resumes, finds its session gone: its
// update_weights or finish_weight_update is refused (invalid_state, "this
// connection's weight update session was aborted: <reason>") and changes
// nothing. A trainer that computes for long between two chunks must keep its
// session alive (weight_info is enough) or be given a longer session_timeout.
//
// What an ended session leaves: staged chunks (commit staged: the update lands at
// finish_weight_update only, see weight_transfer_engine::begin_session) are
// discarded, so a session aborted for any reason (a failed chunk, its owner's
// silence, its connection closing, the owner's re-init) leaves the model's bytes
// and version exactly as they were, "clean", with last_error naming what failed.
// An in_place session aborted after any of its chunks was applied leaves the
// weights dirty: weight_info reports "clean" at version V only when the model
// holds exactly the weights of V's update.
// An application (an inference server) wraps these verbs with update_hooks (below):
// told when a session opens, finishes clean at a version, or ends otherwise, on
// the host's event loop, before the verb answers.
//
// No client can starve or bloat the host: connections are capped (a refused one
// is told so in the authentication challenge), each has a bounded number of
// requests in flight and a request rate (its reading stops until one is answered,
// or until the rate allows the next), frames cost what
// was received (lib/control/frame.h), connections that do not authenticate within
// the handshake deadline are cut, and accept failures (out of descriptors) back
// off and are reported instead of spinning.
//
// Memory after large frames. A frame of 1 MiB or more is freed before its answer
// and malloc_trim then runs off the loop, so RSS comes back to its level; the
// bound it comes back to is glibc's: each thread arena that parsed or freed a
// large frame may keep free memory at its top up to glibc's dynamic trim
// threshold (twice the largest block it has unmapped, at most 64 MiB), which
// malloc_trim does not return for arenas other than the main one. That residue is
// reached by the first large frames and reused, not added to, by later ones: five
// 8 MiB frames after two of them leave RSS within 2 MiB (hardening_test).
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
#include <refit/factory.h>
#include <refit/session.h>

namespace refit::control {

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
///    exactly one on_update_finished or on_update_failed for that session.
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
  /// says whether the weights are dirty (and why).
  std::function<void(const std::string& reason)> on_update_failed;
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
  /// received) before its session is aborted (see the top of this file); 0: the
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

  /// What the weight_info verb answers (see the top of this file), for the
  /// application that runs this host. Call it on the host's event loop.
  json weight_info() const;

  /// The engine and its session, to look at (their state is also weight_info()'s);
  /// only the verbs change them, so that the session's ownership rules hold.
  const weight_transfer_engine& engine() const { return *engine_; }
  const weight_update_session& session() const { return session_; }
  /// Completes when the engine's deferred processing has finished (before a
  /// process that embeds the host stops); rethrows what it hit, once.
  asio::awaitable<void> drain_pending();
  /// Connections being served now (accepted and not yet closed).
  std::size_t connection_count() const noexcept { return connections_.size(); }

 private:
  struct connection;
  using verb = std::function<asio::awaitable<json>(connection& caller, json params)>;

  asio::awaitable<void> serve_connection(std::shared_ptr<connection> c);
  asio::awaitable<void> handle(std::shared_ptr<connection> c, json request, std::size_t frame_bytes);
  asio::awaitable<void> refuse(asio::ip::tcp::socket socket, std::string peer);
  void connection_closed(connection& c);
  void require_owner(const connection& caller, const std::string& method) const;
  std::string owner_name() const;
  asio::awaitable<void> end_session_after_owner_left();
  // The owner's silence: one watch per session, ended by the session's end or stop().
  struct session_watch;
  void heard_from(const connection& c) noexcept;
  bool owner_busy() const noexcept;
  void watch_session();
  void end_watch() noexcept;
  asio::awaitable<void> watch(std::shared_ptr<session_watch> w, std::uint64_t generation);
  asio::awaitable<void> abort_silent_session();
  std::string weight_state() const;
  void note_error(const std::string& method, std::exception_ptr e);
  // The hooks: what one throws is recorded (last_hook_error) and returned, never thrown.
  std::exception_ptr update_started() noexcept;
  std::exception_ptr update_finished(const json& stats) noexcept;
  void update_failed(const std::string& reason) noexcept;
  void note_hook_error(const char* hook, std::exception_ptr e) noexcept;
  void add_verb(const std::string& name, verb v);

  weight_transfer_config config_;
  engine_context context_;
  load_weights_fn load_weights_;
  host_limits limits_;
  std::unique_ptr<weight_transfer_engine> engine_;
  weight_update_session session_;
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  std::map<std::uint64_t, std::shared_ptr<connection>> connections_;  // pruned as each closes
  std::uint64_t next_connection_ = 1;
  std::map<std::string, verb> verbs_;      // built in, with the caller
  std::map<std::string, method> methods_;  // the application's
  std::optional<std::uint64_t> owner_;     // the connection whose session is open
  std::string owner_peer_;
  bool owner_left_ = false;                            // the owner closed while its chunk was being received
  std::chrono::steady_clock::time_point owner_heard_;  // the owner's last frame, request end or session start
  std::uint64_t session_generation_ = 0;               // bumped by every start_weight_update
  std::shared_ptr<session_watch> watch_;
  // The connection whose session was aborted for its silence (until it starts
  // another or closes), and why: its late verbs are told.
  std::optional<std::uint64_t> silenced_;
  std::string silenced_why_;
  bool stopped_ = false;
  std::string last_error_;
  update_hooks hooks_;
  std::string last_hook_error_;
  // Commit modes: of the chunk being received (while session_.receiving()) and of
  // the last chunk applied.
  std::optional<commit_mode> receiving_commit_;
  std::optional<commit_mode> applied_commit_;
  std::string refused_;  // why the last control connection was refused
  std::uint64_t accept_errors_ = 0;
  std::string last_accept_error_;
};

}  // namespace refit::control
