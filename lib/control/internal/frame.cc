#include <refit/control/internal/frame.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include <asio/read.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/net.h>

namespace refit::control {

std::uint32_t decode_frame_length(std::span<const std::uint8_t, 4> raw, std::uint32_t max_frame,
                                  const std::string& what) {
  const std::uint32_t len = (std::uint32_t(raw[0]) << 24) | (std::uint32_t(raw[1]) << 16) |
                            (std::uint32_t(raw[2]) << 8) | std::uint32_t(raw[3]);
  if (len > max_frame)
    throw_error(errc::protocol_error,
                what + ": frame of " + std::to_string(len) + " bytes, limit " + std::to_string(max_frame));
  return len;
}

namespace {
// The top-level "id" of a well-formed frame, every value below the top level
// discarded as it is parsed (nlohmann's parser is iterative and its callback parser
// keeps one flag per level), so a frame refused for its depth or size costs no
// more memory here than its text; null when there is none.
json top_level_id(std::string_view text) {
  const json::parser_callback_t top_level_only = [](int depth, json::parse_event_t event, json&) {
    const bool opens = event == json::parse_event_t::object_start || event == json::parse_event_t::array_start;
    return depth == 0 || (depth == 1 && !opens);
  };
  json top = json::parse(text, top_level_only, /*allow_exceptions=*/false);
  if (top.is_object()) {
    auto id = top.find("id");
    if (id != top.end() && id->is_number_unsigned()) return *id;
  }
  return nullptr;
}
}  // namespace

json parse_frame_body(std::string_view text, const std::string& what, std::size_t max_values, json* request_id) {
  // nlohmann's parser is iterative, but copying or dumping a value recurses once per
  // level: a small frame of nested brackets would otherwise overflow the stack. And
  // a parsed value costs tens of bytes however short its text: both are found
  // before anything is parsed.
  const json_shape shape = scan_json(text);
  if (shape.depth > max_json_depth || shape.values > max_values) {
    if (request_id) *request_id = top_level_id(text);
    if (shape.depth > max_json_depth)
      throw_error(errc::protocol_error, what + ": JSON frame nests " + std::to_string(shape.depth) +
                                            " levels deep, deeper than the limit of " + std::to_string(max_json_depth) +
                                            " levels");
    throw_error(errc::protocol_error, what + ": JSON frame of about " + std::to_string(shape.values) +
                                          " values, limit " + std::to_string(max_values));
  }
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    // nlohmann's message without its "[json.exception.parse_error.101] " tag: what
    // it expected and the text it last read (raw bytes: made valid UTF-8).
    std::string detail = e.what();
    if (const auto tag = detail.find("] "); detail.starts_with("[json.exception.") && tag != std::string::npos)
      detail.erase(0, tag + 2);
    // "last read" quotes the token so far: a long one (a huge string) is cut.
    constexpr std::size_t max_detail = 240;
    if (detail.size() > max_detail) detail = detail.substr(0, max_detail) + "...";
    throw_error(errc::protocol_error, what + ": malformed JSON frame of " + std::to_string(text.size()) +
                                          " bytes, at byte " + std::to_string(e.byte) + ": " + valid_utf8(detail));
  } catch (const json::exception& e) {
    // out_of_range: a number too large for a double ("1e999").
    throw_error(errc::protocol_error, what + ": malformed JSON frame: " + valid_utf8(e.what()));
  }
}

control_request parse_request(json&& message, json& id) {
  json_reader r(message, "control request");
  control_request request;
  request.id = r.required<std::uint64_t>("id");
  id = request.id;
  request.method = r.required<std::string>("method");
  if (message.is_object() && message.contains("params")) {
    request.params = std::move(message["params"]);  // moved, not copied: it may be most of the frame
    message["params"] = nullptr;                    // still a known member for finish()
  } else {
    request.params = json::object();
  }
  (void)r.optional<json>("params", json::object());
  r.finish();
  return request;
}

frame_stream::frame_stream(asio::ip::tcp::socket socket, frame_limits limits)
    : socket_(std::move(socket)), limits_(limits) {}

namespace {
// What one read takes in at most for the buffer (a connection's standing cost);
// a larger body is read straight into its own string.
constexpr std::size_t buffer_chunk = 16 << 10;
constexpr std::size_t read_chunk = 64 << 10;
}  // namespace

asio::awaitable<void> frame_stream::fill(std::size_t n, std::chrono::milliseconds deadline, bool idle_ok,
                                         const std::string& what) {
  // Compact: what is left of the buffer moves to its front.
  if (in_begin_ > 0) {
    in_.erase(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(in_begin_));
    in_begin_ = 0;
  }
  const std::size_t want = in_.size() + n;
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (in_.size() < want) {
    const std::size_t at = in_.size();
    in_.resize(at + std::max(buffer_chunk, want - at));
    std::size_t got = 0;
    try {
      if (idle_ok && at == 0) {
        // An idle server waits as long as it likes for a frame to begin.
        got = co_await socket_.async_read_some(asio::buffer(in_.data() + at, in_.size() - at), asio::use_awaitable);
      } else {
        const auto left =
            std::max(std::chrono::milliseconds(1),
                     std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()));
        got = co_await async::with_deadline(
            socket_.async_read_some(asio::buffer(in_.data() + at, in_.size() - at), asio::use_awaitable), left, what);
      }
    } catch (const error&) {
      in_.resize(at);
      throw;
    } catch (const std::system_error& e) {
      in_.resize(at);
      net::throw_io_error(e.code(), what);
    }
    in_.resize(at + got);
  }
}

asio::awaitable<json> frame_stream::read(std::chrono::milliseconds deadline, bool idle_ok, const std::string& what) {
  const std::string text = co_await read_text(deadline, idle_ok, what);
  co_return parse_frame_body(text, what, limits_.max_values);
}

asio::awaitable<std::string> frame_stream::read_text(std::chrono::milliseconds deadline, bool idle_ok,
                                                     const std::string& what) {
  // Once a frame's first byte is here, the rest (the length's other three bytes
  // too) has a deadline.
  const std::size_t buffered = in_.size() - in_begin_;
  if (buffered < 4) co_await fill(4 - buffered, deadline, idle_ok && buffered == 0, what);
  std::array<std::uint8_t, 4> len_raw;
  std::memcpy(len_raw.data(), in_.data() + in_begin_, 4);
  in_begin_ += 4;
  const std::uint32_t len = decode_frame_length(len_raw, limits_.max_bytes, what);
  last_frame_bytes_ = len;
  // The body: what is buffered, then the rest read straight into it, in chunks
  // that double from 64 KiB, so a length without its bytes costs nothing: memory
  // follows bytes received, not announced.
  std::string text;
  const std::size_t now = std::min<std::size_t>(len, in_.size() - in_begin_);
  text.assign(in_.data() + in_begin_, now);
  in_begin_ += now;
  if (in_begin_ == in_.size()) {
    in_.clear();
    in_begin_ = 0;
  }
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (text.size() < len) {
    const std::size_t at = text.size();
    const std::size_t chunk = std::min<std::size_t>(len - at, std::max<std::size_t>(read_chunk, at));
    text.resize(at + chunk);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    co_await net::read_exact(socket_, asio::buffer(text.data() + at, chunk),
                             std::max(left, std::chrono::milliseconds(1)), what);
  }
  co_return text;
}

// One queued frame; its writer waits on `done`.
struct frame_stream::pending_write {
  explicit pending_write(const asio::any_io_executor& ex) : done(ex) {}
  std::array<std::uint8_t, 4> length;
  std::string text;
  std::string what;
  async::event done;
  std::exception_ptr error;
};

asio::awaitable<void> frame_stream::write(const json& message, std::chrono::milliseconds deadline,
                                          const std::string& what) {
  std::string text = message.dump();
  co_await write_text(std::move(text), deadline, what);
}

asio::awaitable<void> frame_stream::write_text(std::string text, std::chrono::milliseconds deadline,
                                               const std::string& what) {
  auto w = std::make_shared<pending_write>(socket_.get_executor());
  w->text = std::move(text);
  if (w->text.size() > limits_.max_bytes)
    throw_error(errc::invalid_argument, what + ": message of " + std::to_string(w->text.size()) +
                                            " bytes exceeds the frame limit " + std::to_string(limits_.max_bytes));
  const auto len = static_cast<std::uint32_t>(w->text.size());
  w->length = {std::uint8_t(len >> 24), std::uint8_t(len >> 16), std::uint8_t(len >> 8), std::uint8_t(len)};
  w->what = what;
  queue_.push_back(w);
  // The first writer drains the queue for everyone; the others wait for their own
  // frame only (no writer is woken for another's).
  if (!writing_) {
    writing_ = true;
    co_await drain_queue(deadline);
  } else {
    co_await w->done.wait();
  }
  if (w->error) std::rethrow_exception(w->error);
}

asio::awaitable<void> frame_stream::drain_queue(std::chrono::milliseconds deadline) {
  struct release {
    frame_stream* self;
    ~release() { self->writing_ = false; }
  } guard{this};
  std::vector<asio::const_buffer> buffers;
  while (!queue_.empty()) {
    // Every frame queued now goes out in one write (pipelined answers: one syscall,
    // not one each); frames queued meanwhile go in the next.
    const std::size_t n = std::min<std::size_t>(queue_.size(), 64);
    buffers.clear();
    for (std::size_t i = 0; i < n; ++i) {
      buffers.push_back(asio::buffer(queue_[i]->length));
      buffers.push_back(asio::buffer(queue_[i]->text));
    }
    std::exception_ptr error;
    try {
      co_await net::write_all(socket_, buffers, deadline, queue_.front()->what);
    } catch (...) {
      error = std::current_exception();
    }
    for (std::size_t i = 0; i < n; ++i) {
      queue_.front()->error = error;
      queue_.front()->done.set();
      queue_.pop_front();
    }
    if (error) {
      // The stream is broken: every frame still queued fails with the same error.
      for (auto& rest : queue_) {
        rest->error = error;
        rest->done.set();
      }
      queue_.clear();
    }
  }
}

void frame_stream::close() {
  std::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

}  // namespace refit::control
