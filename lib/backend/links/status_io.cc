#include <refit/backend/links/status_io.h>

#include <optional>
#include <vector>

#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>

namespace refit::links {

asio::awaitable<void> send_status(asio::ip::tcp::socket& socket, std::uint32_t code, std::uint64_t seq,
                                  std::string message, std::chrono::milliseconds deadline, std::string what) {
  wire::status s;
  s.code = code;
  s.seq = seq;
  const std::string text = message.substr(0, wire::max_message);
  s.message_bytes = static_cast<std::uint32_t>(text.size());
  auto header = wire::encode(s);
  std::vector<asio::const_buffer> buffers{asio::buffer(header), asio::buffer(text)};
  co_await net::write_all(socket, buffers, deadline, what);
}

asio::awaitable<status_message> read_status(asio::ip::tcp::socket& socket, std::chrono::milliseconds deadline,
                                            std::string what) {
  std::array<std::byte, sizeof(wire::status)> raw;
  co_await net::read_exact(socket, asio::buffer(raw), deadline, what);
  auto s = wire::decode<wire::status>(raw);
  if (s.magic != wire::status_magic)
    throw_error(
        errc::protocol_error, what + ": expected a status message, got magic 0x" + [&] {
          char b[16];
          std::snprintf(b, sizeof b, "%08x", s.magic);
          return std::string(b);
        }());
  if (s.message_bytes > wire::max_message)
    throw_error(errc::protocol_error, what + ": status message of " + std::to_string(s.message_bytes) +
                                          " bytes, limit " + std::to_string(wire::max_message));
  status_message out{s.code, s.seq, std::string(s.message_bytes, '\0')};
  if (s.message_bytes) co_await net::read_exact(socket, asio::buffer(out.message), deadline, what);
  co_return out;
}

void throw_if_failed(const status_message& s, const std::string& who) {
  if (s.code == 0) return;
  auto kind = s.code <= static_cast<std::uint32_t>(last_errc) ? static_cast<errc>(s.code) : errc::protocol_error;
  throw_error(kind, who + ": " + s.message);
}

asio::awaitable<void> rethrow_with_peer_reason(asio::ip::tcp::socket& socket, std::exception_ptr failure,
                                               std::string who) {
  std::optional<status_message> said;
  bool timed_out = false;
  try {
    std::rethrow_exception(failure);
  } catch (const error& e) {
    timed_out = e.kind() == errc::timeout;  // a silent peer: waiting longer says nothing
  } catch (...) {
  }
  if (!timed_out && socket.is_open()) {
    try {
      said = co_await read_status(socket, reason_wait, who + ": reading why the peer failed");
    } catch (...) {
    }
  }
  if (said && said->code != 0) throw_if_failed(*said, who + " failed the update");
  std::rethrow_exception(failure);
}

asio::awaitable<void> tell_failure(asio::ip::tcp::socket& socket, std::exception_ptr failure, std::uint64_t seq) {
  errc kind = errc::io_error;
  std::string message;
  try {
    std::rethrow_exception(failure);
  } catch (const error& e) {
    kind = e.kind();
    message = e.message();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown failure";
  }
  if (!socket.is_open()) co_return;
  try {
    co_await send_status(socket, static_cast<std::uint32_t>(kind), seq, std::move(message), reason_wait,
                         "telling the peer why the update failed");
  } catch (...) {
  }
}

}  // namespace refit::links
