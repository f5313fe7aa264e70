// The worker side of the control plane: owns one engine and serves the weight
// transfer verbs of vLLM's RL API over framed JSON, with vLLM's request bodies:
//
//   init_weight_transfer_engine  {"init_info": {...}}
//   start_weight_update          {}
//   update_weights               {"update_info": {...}}
//   finish_weight_update         {"weight_version": int}   (optional member)
//   weight_info                  {}
//       -> {"weight_version", "state": "clean" | "updating" | "dirty", "dirty_reason",
//           "session_active", "session_owner", "receiving", "commit",
//           "last_update": stats, "last_error", "last_refused_connection",
//           "connections", "accept_errors", "last_accept_error", ...}
//   weight_fingerprint           {"names": [str]}  (optional; all weights when absent)
//       -> {"algorithm", "tensors": {name: hex}, "weight_version", "state"}
//          (needs the engine context's model_target; see lib/fingerprint.h)
//
// A request is {"id": int, "method": str, "params": {...}}; the answer is
// {"id": int, "result": {...}} or {"id": int, "error": {"kind": str, "message": str}}.
// Every request runs in its own coroutine, so weight_info (or any other method)
// is answered while an update is in flight.
//
// Sessions have an owner: the control connection whose start_weight_update opened
// it. update_weights and finish_weight_update from any other connection, and
// start_weight_update or init_weight_transfer_engine from any other connection
// while the session is open, are refused (invalid_state, naming the owner): a
// stale trainer or a second client cannot finish, cut short or re-initialise
// someone else's update. The owner's own init aborts its session first (refused
// while a chunk is being received). When the owner's connection closes, its
// session is aborted (at once, or when the chunk being received ends). An aborted
// session that had applied anything leaves the weights dirty: weight_info reports
// "clean" at version V only when the model holds exactly the weights of V's update.
//
// No client can starve or bloat the host: connections are capped (a refused one
// is told so in the authentication challenge), each has a bounded number of
// requests in flight and a request rate (its reading stops until one is answered,
// or until the rate allows the next), frames cost what
// was received (lib/control/frame.h), connections that do not authenticate within
// the handshake deadline are cut, and accept failures (out of descriptors) back
// off and are reported instead of spinning.
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

#include <refit/control/frame.h>
#include <refit/engine.h>
#include <refit/factory.h>
#include <refit/session.h>

namespace refit::control {

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

  weight_transfer_engine& engine() { return *engine_; }
  weight_update_session& session() { return session_; }
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
  json weight_info() const;
  std::string weight_state() const;
  void note_error(const std::string& method, std::exception_ptr e);
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
  bool owner_left_ = false;  // the owner closed while its chunk was being received
  bool stopped_ = false;
  std::string last_error_;
  std::string refused_;  // why the last control connection was refused
  std::uint64_t accept_errors_ = 0;
  std::string last_accept_error_;
};

}  // namespace refit::control
