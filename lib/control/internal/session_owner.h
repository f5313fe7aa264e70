// Who owns the open weight-update session, and for how long: the connection whose
// start_weight_update opened it, until it finishes, fails, closes its connection
// or falls silent for the session timeout (docs/control-plane.md, "Sessions have
// an owner"). The verbs ask it who may act; it aborts the session when its owner
// is gone or silent and reports that through its `aborted` callback.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>

#include <refit/control/internal/rpc_server.h>
#include <refit/error.h>
#include <refit/session.h>

namespace refit::control::internal {

class session_owner {
 public:
  /// `in_flight(id)`: requests of connection `id` being handled; `aborted(why,
  /// kind)`: the session was aborted because its owner left (peer_lost) or fell
  /// silent (timeout); called on the loop, after the session ended.
  using aborted_fn = std::function<void(const std::string& why, errc kind)>;
  session_owner(asio::any_io_executor loop, weight_update_session& session, std::chrono::milliseconds timeout,
                std::function<std::size_t(std::uint64_t)> in_flight, aborted_fn aborted);
  ~session_owner() { end_watch(); }
  session_owner(const session_owner&) = delete;
  session_owner& operator=(const session_owner&) = delete;

  /// Whether `c` owns the session (whether or not it is still active).
  bool is(const rpc_connection& c) const noexcept { return owner_ == c.id; }
  bool has_owner() const noexcept { return owner_.has_value(); }
  /// "connection #1 (127.0.0.1:5301)", or "nobody".
  std::string name() const;
  /// How long the owner has sent nothing.
  std::chrono::milliseconds silence() const;
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// Whether the owner is doing something (a chunk being received, or a request
  /// of its own running): that is not silence.
  bool busy() const noexcept;

  /// start_weight_update by `c` opened the session: `c` owns it and its silence
  /// is watched from now.
  void opened_by(const rpc_connection& c);
  /// The session closed (or never opened): nobody owns it.
  void release() noexcept { owner_.reset(); }
  /// Throws invalid_state unless `caller` owns the active session (naming the
  /// owner, and why the caller's own session was aborted if it was).
  void require(const rpc_connection& caller, const std::string& method) const;

  /// A frame from `c`, or the end of one of its requests: the owner is not silent.
  void heard_from(const rpc_connection& c) noexcept;
  /// One of `c`'s requests was answered.
  void request_ended(const rpc_connection& c) noexcept;
  /// `c` closed: its session, if it owns one, is aborted (at once, or when the
  /// chunk being received ends: see left()).
  void connection_closed(const rpc_connection& c);
  /// Whether the owner closed while its chunk was being received; then the verb
  /// that received it calls end_after_owner_left().
  bool left() const noexcept { return owner_left_; }
  asio::awaitable<void> end_after_owner_left();
  /// Stops watching the owner's silence (stop(), the session's end).
  void end_watch() noexcept;

 private:
  struct watch_state;
  void start_watch();
  asio::awaitable<void> watch(std::shared_ptr<watch_state> w, std::uint64_t generation);
  asio::awaitable<void> abort_silent_session();

  asio::any_io_executor loop_;
  weight_update_session& session_;
  std::chrono::milliseconds timeout_;
  std::function<std::size_t(std::uint64_t)> in_flight_;
  aborted_fn aborted_;
  std::optional<std::uint64_t> owner_;  // the connection whose session is open
  std::string owner_peer_;
  bool owner_left_ = false;                            // the owner closed while its chunk was being received
  std::chrono::steady_clock::time_point owner_heard_;  // the owner's last frame, request end or session start
  std::uint64_t session_generation_ = 0;               // bumped by every start_weight_update
  std::shared_ptr<watch_state> watch_;
  // The connection whose session was aborted for its silence (until it starts
  // another or closes), and why: its late verbs are told.
  std::optional<std::uint64_t> silenced_;
  std::string silenced_why_;
};

}  // namespace refit::control::internal
