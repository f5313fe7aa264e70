// The trainer side of the control plane: calls a worker_host's methods. Calls may
// overlap (update_weights stays open while the trainer streams the bytes); answers
// are matched by id. Several workers at once, and the whole weight-update
// sequence: lib/control/worker_group.h.
//
// Params, and GCC 12: a braced json inside a co_await expression does not compile
// there ("array used as initializer"), whatever call() takes:
//
//   co_await c.call("finish_weight_update", {{"weight_version", 7}});        // GCC 12: error
//   co_await c.call("finish_weight_update", params("weight_version", 7));    // fine
//   json body = {{"weight_version", 7}};                                     // fine: a local
//   co_await c.call("finish_weight_update", body);
//
// call() takes its method and params by value, so an awaitable may be kept and
// awaited later (ops.push_back(c.call("update_weights", body)) with a temporary
// method name), e.g. with async::all_of.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <asio/awaitable.hpp>
#include <asio/experimental/channel.hpp>

#include <refit/json.h>

namespace refit::control {

class frame_stream;

namespace detail {
inline void add_params(json&) {}
template <class V, class... Rest>
void add_params(json& j, std::string key, V&& value, Rest&&... rest) {
  j[std::move(key)] = json(std::forward<V>(value));
  add_params(j, std::forward<Rest>(rest)...);
}
}  // namespace detail

/// A JSON object from alternating keys and values: params("weight_version", 7,
/// "names", names) is {"weight_version": 7, "names": [...]}; params() is {}. The
/// braced form's replacement where it cannot compile (see above).
template <class... Args>
requires(sizeof...(Args) % 2 == 0) json params(Args&&... key_values) {
  json j = json::object();
  detail::add_params(j, std::forward<Args>(key_values)...);
  return j;
}

class client {
 public:
  /// `timeout` bounds every call unless the call gives its own. With a non-empty
  /// `secret`, connect() authenticates with it (lib/integrity/auth.h); the worker must hold
  /// the same one.
  client(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret = {});
  ~client();

  /// Connects (retrying refused connections until the timeout).
  asio::awaitable<void> connect(std::string host, std::uint16_t port);
  /// Calls `method`; returns its result or throws the refit::error the worker
  /// answered with (same kind and message, prefixed with the method), timeout if
  /// no answer comes in time, peer_lost if the connection drops. Nothing is sent
  /// until the awaitable is first resumed; it owns everything it needs (method and
  /// params by value), so it may outlive the expression that made it.
  asio::awaitable<json> call(std::string method, json params = json::object(),
                             std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  void close();
  bool connected() const;

 private:
  using reply_channel = asio::experimental::channel<void(std::error_code, json)>;
  // Shared with the reader coroutine, which may outlive the client by a little.
  struct connection {
    std::shared_ptr<frame_stream> stream;
    std::string peer;
    std::map<std::uint64_t, std::shared_ptr<reply_channel>> pending;
  };
  static asio::awaitable<void> read_loop(std::shared_ptr<connection> c, std::chrono::milliseconds timeout);

  asio::any_io_executor executor_;
  std::chrono::milliseconds timeout_;
  std::string secret_;
  std::shared_ptr<connection> state_;
  std::uint64_t next_id_ = 1;
};

}  // namespace refit::control
