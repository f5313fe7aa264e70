// The worker host's transport: a framed-JSON RPC server (docs/control-plane.md
// describes what it does on the wire). It accepts connections (backing off when
// accepting fails), runs lib/backend/handshake.h's handshake on each (with the
// connection cap riding on its challenge), reads frames under back-pressure (a
// bounded number of requests in flight and a token-bucket request rate per
// connection), parses large ones off the loop, and runs every request in its own
// coroutine: a registered handler's result or error is written back with the
// request's id. It knows nothing of weights or sessions; worker_host registers
// the verbs and listens to a connection's life through rpc_server::events.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>

#include <refit/backend/async/event.h>
#include <refit/control/internal/frame.h>
#include <refit/control/worker_host.h>

namespace refit::control::internal {

/// One control connection, alive while it is served (and while its requests run).
struct rpc_connection {
  rpc_connection(std::uint64_t id, std::string peer, std::shared_ptr<frame_stream> stream);
  std::uint64_t id;
  std::string peer;
  std::shared_ptr<frame_stream> stream;
  std::size_t in_flight = 0;  // requests being handled
  async::event request_done;  // set when one finishes
  double tokens = 0;          // the request-rate bucket
  std::chrono::steady_clock::time_point refilled = std::chrono::steady_clock::now();
  /// "connection #3 (127.0.0.1:40000)"
  std::string name() const;
};

class rpc_server {
 public:
  /// A handler: the calling connection and the request's params in, the result
  /// out; throw refit::error to answer with an error.
  using handler = std::function<asio::awaitable<json>(rpc_connection& caller, json params)>;

  /// What the server's user hears of a connection's life, on the loop.
  struct events {
    /// A whole frame arrived on the connection (before it is parsed).
    std::function<void(const rpc_connection&)> frame_read;
    /// One of its requests was answered (its in_flight already counts it out).
    std::function<void(const rpc_connection&)> request_ended;
    /// It closed (already out of connections()).
    std::function<void(const rpc_connection&)> closed;
  };

  /// `loop` serves; `offload()` is where large requests are parsed and large
  /// answers serialized (asked for when needed: the engine's pool starts lazily).
  /// `secret` and `timeout` are the config's (auth_secret, and the deadline of
  /// each frame's rest and of each answer).
  rpc_server(asio::any_io_executor loop, std::function<asio::any_io_executor()> offload, std::string secret,
             std::chrono::milliseconds timeout, host_limits limits, events on);

  std::uint16_t listen(const std::string& host, std::uint16_t port);
  /// Accepts and serves connections until stop().
  asio::awaitable<void> serve();
  /// Closes the listener and every connection.
  void stop();

  /// Registers a built-in method (never replaced).
  void add_builtin(const std::string& name, handler h);
  bool is_builtin(const std::string& name) const { return builtins_.count(name) > 0; }
  /// Adds or replaces an application's method.
  void add_method(const std::string& name, handler h) { methods_[name] = std::move(h); }

  std::size_t connection_count() const noexcept { return connections_.size(); }
  /// Requests of connection `id` being handled (0 when it is closed).
  std::size_t in_flight(std::uint64_t id) const noexcept;

  /// Why the last connection was refused (empty: none was).
  const std::string& last_refused() const noexcept { return refused_; }
  std::uint64_t accept_errors() const noexcept { return accept_errors_; }
  const std::string& last_accept_error() const noexcept { return last_accept_error_; }

 private:
  asio::awaitable<void> serve_connection(std::shared_ptr<rpc_connection> c);
  asio::awaitable<void> handle(std::shared_ptr<rpc_connection> c, json request, std::size_t frame_bytes);
  asio::awaitable<void> refuse(asio::ip::tcp::socket socket, std::string peer);
  // Waits until the connection may start another request (in-flight cap, rate);
  // false when it closed meanwhile.
  asio::awaitable<bool> admit(rpc_connection& c, asio::steady_timer& throttle);

  asio::any_io_executor loop_;
  std::function<asio::any_io_executor()> offload_;
  std::string secret_;
  std::chrono::milliseconds timeout_;
  host_limits limits_;
  events on_;
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  std::map<std::uint64_t, std::shared_ptr<rpc_connection>> connections_;  // pruned as each closes
  std::uint64_t next_connection_ = 1;
  std::map<std::string, handler> builtins_;
  std::map<std::string, handler> methods_;  // the application's
  bool stopped_ = false;
  std::string refused_;
  std::uint64_t accept_errors_ = 0;
  std::string last_accept_error_;
};

}  // namespace refit::control::internal
