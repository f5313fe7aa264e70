// TCP helpers shared by the TCP engine and the control plane: every read, write and
// connect has a deadline, and socket errors become refit errors that say which peer
// and which phase.
#pragma once

#include <chrono>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include "lib/async/deadline.h"
#include "lib/error.h"

namespace refit::net {

using tcp = asio::ip::tcp;

/// Throws the refit error for socket error `ec` during `what`: end of stream,
/// reset and broken pipe are peer_lost; cancellation is cancelled; the rest io_error.
[[noreturn]] void throw_io_error(const std::error_code& ec, const std::string& what);

/// Reads exactly buffer_size(buffers) bytes, or throws (timeout, peer_lost, ...).
template <class MutableBuffers>
asio::awaitable<void> read_exact(tcp::socket& socket, const MutableBuffers& buffers,
                                 std::chrono::milliseconds deadline, std::string what) {
  try {
    co_await async::with_deadline(asio::async_read(socket, buffers, asio::use_awaitable),
                                  deadline, what);
  } catch (const error&) {
    throw;
  } catch (const std::system_error& e) {
    throw_io_error(e.code(), what);
  }
}

/// Writes all of `buffers`, or throws.
template <class ConstBuffers>
asio::awaitable<void> write_all(tcp::socket& socket, const ConstBuffers& buffers,
                                std::chrono::milliseconds deadline, std::string what) {
  try {
    co_await async::with_deadline(asio::async_write(socket, buffers, asio::use_awaitable),
                                  deadline, what);
  } catch (const error&) {
    throw;
  } catch (const std::system_error& e) {
    throw_io_error(e.code(), what);
  }
}

/// Connects to host:port, retrying refused connections (the peer may not listen
/// yet) until `deadline` passes; then timeout naming `what` and the address.
asio::awaitable<tcp::socket> connect_with_retry(const std::string& host, std::uint16_t port,
                                                std::chrono::milliseconds deadline,
                                                std::string what);

/// A listening socket on host:port (port 0: any free port).
tcp::acceptor listen(const asio::any_io_executor& ex, const std::string& host, std::uint16_t port);

/// Accepts one connection within `deadline`; the socket runs on `socket_executor`
/// (the acceptor's when empty).
asio::awaitable<tcp::socket> accept(tcp::acceptor& acceptor, std::chrono::milliseconds deadline,
                                    std::string what, asio::any_io_executor socket_executor = {});

/// Sets TCP_NODELAY and generous kernel buffers for bulk transfer.
void tune(tcp::socket& socket);

}  // namespace refit::net
