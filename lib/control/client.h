// The trainer side of the control plane: calls a worker_host's methods. Calls may
// overlap (update_weights stays open while the trainer streams the bytes); answers
// are matched by id.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/experimental/channel.hpp>

#include <refit/control/frame.h>

namespace refit::control {

class client {
 public:
  /// `timeout` bounds every call unless the call gives its own. With a non-empty
  /// `secret`, connect() authenticates with it (lib/auth.h); the worker must hold
  /// the same one.
  client(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret = {});
  ~client();

  /// Connects (retrying refused connections until the timeout).
  asio::awaitable<void> connect(std::string host, std::uint16_t port);
  /// Calls `method`; returns its result or throws the refit::error the worker
  /// answered with (same kind and message, prefixed with the method), timeout if
  /// no answer comes in time, peer_lost if the connection drops.
  asio::awaitable<json> call(const std::string& method, json params = json::object(),
                             std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  void close();
  bool connected() const { return state_ && state_->stream->is_open(); }

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
