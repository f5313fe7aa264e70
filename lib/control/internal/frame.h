// The control plane's framing: a 4-byte big-endian length, then that many bytes of
// JSON. A peer cannot make a connection hold more than it actually sent: lengths
// above a limit are refused before anything is allocated, the body is read into a
// buffer that grows with what arrives, and a body that would parse into more
// values than a limit is refused before it is parsed.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/async/event.h>
#include <refit/control/limits.h>
#include <refit/json_reader.h>

namespace refit::control {

/// A frame's length from its 4-byte big-endian prefix; above `max_frame` is
/// protocol_error (before anything is allocated for the body).
std::uint32_t decode_frame_length(std::span<const std::uint8_t, 4> raw, std::uint32_t max_frame,
                                  const std::string& what);

/// A frame's body as JSON; malformed JSON (a number out of range and nesting deeper
/// than max_json_depth included) and a body of more than `max_values` values
/// (scan_json) are protocol_error, the latter two found before anything is parsed.
/// When a frame is refused for its depth or its values but is well-formed JSON,
/// `request_id` (when given) is set to its top-level "id" (a second parse that
/// keeps nothing below the top level: bounded memory, no recursion), so that the
/// answer can name the request and the caller's call fails with the reason
/// instead of its connection closing; it stays null otherwise.
json parse_frame_body(std::string_view text, const std::string& what, std::size_t max_values = default_max_frame_values,
                      json* request_id = nullptr);

/// A control request: {"id": uint64, "method": string, "params": any (default {})}.
struct control_request {
  std::uint64_t id = 0;
  std::string method;
  json params;
};

/// Reads a control request strictly (invalid_argument on a missing, mistyped or
/// unknown member), moving its params out of `message`. `id` is set as soon as the
/// id has been read, so the answer to a request that fails later in reading can
/// still name it.
control_request parse_request(json&& message, json& id);

/// One framed-JSON connection. Reads go through a buffer (one syscall takes in
/// as many pipelined frames as have arrived); writes are queued in order and
/// written by one writer at a time, as many queued frames per syscall as are
/// waiting (a write wakes only its own caller), so any number of coroutines on
/// the connection's executor may write at once; reads are for one reader.
class frame_stream {
 public:
  frame_stream(asio::ip::tcp::socket socket, frame_limits limits = {});

  /// Reads one frame. Waits indefinitely for its first byte when `idle_ok` (a
  /// server between requests), else within `deadline`; the rest of the frame (the
  /// length's other bytes included) always within `deadline`. Malformed JSON, an
  /// oversized length or too many values is protocol_error.
  asio::awaitable<json> read(std::chrono::milliseconds deadline, bool idle_ok, const std::string& what);
  /// Reads one frame's body without parsing it (read() is this, then
  /// parse_frame_body with limits().max_values). Only an oversized length is
  /// protocol_error here: the framing is then lost. A body that then fails to parse
  /// has still been consumed whole, so the frame after it can be read: a server
  /// answers it and goes on.
  asio::awaitable<std::string> read_text(std::chrono::milliseconds deadline, bool idle_ok, const std::string& what);
  /// Queues `message` and completes when it has been written.
  asio::awaitable<void> write(const json& message, std::chrono::milliseconds deadline, const std::string& what);
  /// The same for a message already serialized (a large one, dumped off the loop).
  asio::awaitable<void> write_text(std::string text, std::chrono::milliseconds deadline, const std::string& what);

  void close();
  bool is_open() const { return socket_.is_open(); }
  asio::ip::tcp::socket& socket() { return socket_; }
  const frame_limits& limits() const noexcept { return limits_; }
  /// Frames queued or being written.
  std::size_t queued_writes() const noexcept { return queue_.size(); }
  /// The body size of the frame read last.
  std::size_t last_frame_bytes() const noexcept { return last_frame_bytes_; }

 private:
  struct pending_write;
  asio::awaitable<void> drain_queue(std::chrono::milliseconds deadline);
  // Reads at least `n` more bytes into the read buffer (more if they are there).
  asio::awaitable<void> fill(std::size_t n, std::chrono::milliseconds deadline, bool idle_ok, const std::string& what);

  asio::ip::tcp::socket socket_;
  frame_limits limits_;
  std::vector<char> in_;  // bytes read and not yet consumed: [in_begin_, in_.size())
  std::size_t in_begin_ = 0;
  std::deque<std::shared_ptr<pending_write>> queue_;  // front: being written
  bool writing_ = false;
  std::size_t last_frame_bytes_ = 0;
};

}  // namespace refit::control
