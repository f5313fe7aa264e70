// The control plane's framing: a 4-byte big-endian length, then that many bytes of
// JSON. Lengths above a limit are refused before anything is allocated.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <string_view>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include "lib/async/event.h"
#include "lib/json_reader.h"

namespace refit::control {

/// Default largest frame: metadata of ~1M tensors fits.
inline constexpr std::uint32_t default_max_frame = 256u << 20;

/// A frame's length from its 4-byte big-endian prefix; above `max_frame` is
/// protocol_error (before anything is allocated for the body).
std::uint32_t decode_frame_length(std::span<const std::uint8_t, 4> raw, std::uint32_t max_frame,
                                  const std::string& what);

/// A frame's body as JSON; malformed JSON (a number out of range and nesting deeper
/// than max_json_depth included) is protocol_error.
json parse_frame_body(std::string_view text, const std::string& what);

/// A control request: {"id": uint64, "method": string, "params": any (default {})}.
struct control_request {
  std::uint64_t id = 0;
  std::string method;
  json params;
};

/// Reads a control request strictly (invalid_argument on a missing, mistyped or
/// unknown member). `id` is set as soon as the id has been read, so the answer to
/// a request that fails later in reading can still name it.
control_request parse_request(const json& message, json& id);

/// One framed-JSON connection. Writes are queued, so any number of coroutines on
/// the connection's executor may write at once; reads are for one reader.
class frame_stream {
 public:
  frame_stream(asio::ip::tcp::socket socket, std::uint32_t max_frame = default_max_frame);

  /// Reads one frame. Waits indefinitely for its first byte when `idle_ok` (a
  /// server between requests), else within `deadline`; the rest of the frame
  /// always within `deadline`. Malformed JSON or an oversized length is
  /// protocol_error.
  asio::awaitable<json> read(std::chrono::milliseconds deadline, bool idle_ok, const std::string& what);
  /// Queues `message` and completes when it has been written.
  asio::awaitable<void> write(const json& message, std::chrono::milliseconds deadline, const std::string& what);

  void close();
  bool is_open() const { return socket_.is_open(); }
  asio::ip::tcp::socket& socket() { return socket_; }

 private:
  asio::ip::tcp::socket socket_;
  std::uint32_t max_frame_;
  bool writing_ = false;
  async::event write_idle_;
};

}  // namespace refit::control
