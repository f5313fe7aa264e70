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

#include <refit/backend/async/deadline.h>
#include <refit/error.h>

namespace refit::net {

using tcp = asio::ip::tcp;

/// Throws the refit error for socket error `ec` during `what`: end of stream,
/// reset and broken pipe are peer_lost; cancellation is cancelled; running out of
/// descriptors (EMFILE, ENFILE) is resource_exhausted; the rest io_error. The
/// message is describe(ec).
[[noreturn]] void throw_io_error(const std::error_code& ec, const std::string& what);

/// `ec`'s message, naming the errno where an operator must act on it: EMFILE
/// ("... (EMFILE: this process has all N descriptors of its limit open, ulimit
/// -n)") and ENFILE (the system-wide table). Every connect and accept error refit
/// reports goes through it.
std::string describe(const std::error_code& ec);

/// Whether `ec` is EMFILE or ENFILE: out of descriptors, for the process or the
/// system.
bool out_of_descriptors(const std::error_code& ec) noexcept;

/// Bytes per system call on an event loop an inference server shares with refit:
/// the kernel copies ~4 GB/s here, so one call of this size costs ~60 us of the
/// loop, within its ~100 us budget, and a 1 GB update is ~4,000 calls (against
/// ~16,000 of asio's default).
inline constexpr std::size_t loop_bytes_per_call = std::size_t(256) << 10;
/// Bytes per call on refit's own threads (the trainer's I/O pool): as many as the
/// buffers (up to 64 of them) and the kernel take.
inline constexpr std::size_t unbounded_per_call = std::size_t(1) << 30;

/// The completion condition of every refit socket transfer: up to `per_call` bytes
/// a system call, where asio's default (transfer_all) asks for at most 64 KiB.
struct transfers {
  std::size_t per_call = unbounded_per_call;
  template <class Error>
  std::size_t operator()(const Error& err, std::size_t) const noexcept {
    return err ? 0 : per_call;
  }
};

/// Reads exactly buffer_size(buffers) bytes, or throws (timeout, peer_lost, ...),
/// with at most `per_call` bytes per system call. Any stream asio can read (a tcp
/// socket; tests count its calls).
template <class Stream, class MutableBuffers>
asio::awaitable<void> read_exact(Stream& socket, const MutableBuffers& buffers, std::chrono::milliseconds deadline,
                                 std::string what, std::size_t per_call = unbounded_per_call) {
  try {
    co_await async::with_deadline(asio::async_read(socket, buffers, transfers{per_call}, asio::use_awaitable), deadline,
                                  what);
  } catch (const error&) {
    throw;
  } catch (const std::system_error& e) {
    throw_io_error(e.code(), what);
  }
}

/// Writes all of `buffers`, or throws; `per_call` as for read_exact.
template <class Stream, class ConstBuffers>
asio::awaitable<void> write_all(Stream& socket, const ConstBuffers& buffers, std::chrono::milliseconds deadline,
                                std::string what, std::size_t per_call = unbounded_per_call) {
  try {
    co_await async::with_deadline(asio::async_write(socket, buffers, transfers{per_call}, asio::use_awaitable),
                                  deadline, what);
  } catch (const error&) {
    throw;
  } catch (const std::system_error& e) {
    throw_io_error(e.code(), what);
  }
}

/// Connects to host:port, retrying refused connections (the peer may not listen
/// yet) until `deadline` passes; then timeout naming `what`, the address and the
/// last error. A socket that cannot be opened for want of descriptors (EMFILE,
/// ENFILE) fails at once with resource_exhausted naming it: retrying does not free
/// descriptors, and "could not connect" would hide why.
asio::awaitable<tcp::socket> connect_with_retry(const std::string& host, std::uint16_t port,
                                                std::chrono::milliseconds deadline, std::string what);

/// A listening socket on host:port (port 0: any free port).
tcp::acceptor listen(const asio::any_io_executor& ex, const std::string& host, std::uint16_t port);

/// Accepts one connection within `deadline`; the socket runs on `socket_executor`
/// (the acceptor's when empty).
asio::awaitable<tcp::socket> accept(tcp::acceptor& acceptor, std::chrono::milliseconds deadline, std::string what,
                                    asio::any_io_executor socket_executor = {});

/// Sets TCP_NODELAY (every connection refit makes or accepts: headers and statuses
/// are small and must not wait for Nagle's algorithm).
void tune(tcp::socket& socket);

/// Sets the kernel's send and receive buffers of a data connection to `bytes`
/// (SO_SNDBUF, SO_RCVBUF); 0 leaves Linux's autotuning, which grows them up to
/// net.ipv4.tcp_wmem/tcp_rmem's maximum (a few MiB: enough where bandwidth x
/// round trip is smaller). Set it to at least that product on long fat links (and
/// raise net.core.wmem_max/rmem_max, which cap it). Failures are ignored: the
/// kernel keeps its own sizes.
void set_buffers(tcp::socket& socket, std::size_t bytes);

/// Shuts both directions down and closes, ignoring errors (a peer that reads gets
/// end of stream at once; a pending operation on it completes with an error).
void close(tcp::socket& socket) noexcept;

}  // namespace refit::net
