#include "lib/control/frame.h"

#include <array>
#include <vector>

#include <asio/read.hpp>
#include <asio/use_awaitable.hpp>

#include "lib/net.h"

namespace refit::control {

std::uint32_t decode_frame_length(std::span<const std::uint8_t, 4> raw, std::uint32_t max_frame,
                                  const std::string& what) {
  const std::uint32_t len = (std::uint32_t(raw[0]) << 24) | (std::uint32_t(raw[1]) << 16) |
                            (std::uint32_t(raw[2]) << 8) | std::uint32_t(raw[3]);
  if (len > max_frame)
    throw_error(errc::protocol_error, what + ": frame of " + std::to_string(len) + " bytes, limit " +
                                          std::to_string(max_frame));
  return len;
}

json parse_frame_body(std::string_view text, const std::string& what) {
  // nlohmann's parser is iterative, but copying or dumping a value recurses once per
  // level: a small frame of nested brackets would otherwise overflow the stack.
  if (json_nesting_depth(text) > max_json_depth)
    throw_error(errc::protocol_error, what + ": JSON frame nests deeper than " + std::to_string(max_json_depth) +
                                          " levels");
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw_error(errc::protocol_error, what + ": malformed JSON frame at byte " + std::to_string(e.byte));
  } catch (const json::exception& e) {
    // out_of_range: a number too large for a double ("1e999").
    throw_error(errc::protocol_error, what + ": malformed JSON frame: " + valid_utf8(e.what()));
  }
}

control_request parse_request(const json& message, json& id) {
  json_reader r(message, "control request");
  control_request request;
  request.id = r.required<std::uint64_t>("id");
  id = request.id;
  request.method = r.required<std::string>("method");
  request.params = r.optional<json>("params", json::object());
  r.finish();
  return request;
}

frame_stream::frame_stream(asio::ip::tcp::socket socket, std::uint32_t max_frame)
    : socket_(std::move(socket)), max_frame_(max_frame), write_idle_(socket_.get_executor()) {
  write_idle_.set();
}

asio::awaitable<json> frame_stream::read(std::chrono::milliseconds deadline, bool idle_ok,
                                         const std::string& what) {
  std::array<std::uint8_t, 4> len_raw;
  if (idle_ok) {
    try {
      co_await asio::async_read(socket_, asio::buffer(len_raw), asio::use_awaitable);
    } catch (const std::system_error& e) {
      net::throw_io_error(e.code(), what);
    }
  } else {
    co_await net::read_exact(socket_, asio::buffer(len_raw), deadline, what);
  }
  const std::uint32_t len = decode_frame_length(len_raw, max_frame_, what);
  std::string text(len, '\0');
  co_await net::read_exact(socket_, asio::buffer(text), deadline, what);
  co_return parse_frame_body(text, what);
}

asio::awaitable<void> frame_stream::write(const json& message, std::chrono::milliseconds deadline,
                                          const std::string& what) {
  const std::string text = message.dump();
  if (text.size() > max_frame_)
    throw_error(errc::invalid_argument, what + ": message of " + std::to_string(text.size()) +
                                            " bytes exceeds the frame limit " + std::to_string(max_frame_));
  const auto len = static_cast<std::uint32_t>(text.size());
  const std::array<std::uint8_t, 4> len_raw{std::uint8_t(len >> 24), std::uint8_t(len >> 16),
                                            std::uint8_t(len >> 8), std::uint8_t(len)};
  // One writer at a time: a frame is never interleaved with another.
  while (writing_) co_await write_idle_.wait();
  writing_ = true;
  write_idle_.reset();
  struct release {
    frame_stream* self;
    ~release() {
      self->writing_ = false;
      self->write_idle_.set();
    }
  } guard{this};
  std::vector<asio::const_buffer> buffers{asio::buffer(len_raw), asio::buffer(text)};
  co_await net::write_all(socket_, buffers, deadline, what);
}

void frame_stream::close() {
  std::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

}  // namespace refit::control
