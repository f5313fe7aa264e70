#include <refit/backend/net.h>

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <limits>

#include <asio/ip/address.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>

namespace refit::net {

namespace {
// An errno: asio reports them in a category of its own ("asio.system").
bool is_errno(const std::error_code& ec, int value) noexcept {
  return ec.value() == value &&
         (ec.category() == asio::error::get_system_category() || ec.category() == std::system_category());
}
}  // namespace

bool out_of_descriptors(const std::error_code& ec) noexcept { return is_errno(ec, EMFILE) || is_errno(ec, ENFILE); }

std::string describe(const std::error_code& ec) {
  if (is_errno(ec, EMFILE)) {
    rlimit limit{};
    std::string n = "its";
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
      n = "all " + std::to_string(limit.rlim_cur);
    return ec.message() + " (EMFILE: this process has " + n +
           " descriptors of its limit open; raise it, ulimit -n, or close some)";
  }
  if (is_errno(ec, ENFILE)) return ec.message() + " (ENFILE: the system-wide file table is full, fs.file-max)";
  return ec.message();
}

void throw_io_error(const std::error_code& ec, const std::string& what) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset || ec == asio::error::broken_pipe ||
      ec == asio::error::connection_aborted)
    throw_error(errc::peer_lost, what + ": the peer closed the connection (" + ec.message() + ")");
  if (ec == asio::error::operation_aborted) throw_error(errc::cancelled, what + ": cancelled (" + ec.message() + ")");
  if (out_of_descriptors(ec)) throw_error(errc::resource_exhausted, what + ": " + describe(ec));
  throw error(errc::io_error, what + ": " + ec.message());
}

asio::awaitable<tcp::socket> connect_with_retry(const std::string& host, std::uint16_t port,
                                                std::chrono::milliseconds deadline, std::string what) {
  auto ex = co_await asio::this_coro::executor;
  const auto give_up = std::chrono::steady_clock::now() + deadline;
  std::error_code address_error;
  auto address = asio::ip::make_address(host, address_error);
  std::vector<tcp::endpoint> endpoints;
  if (!address_error) {
    endpoints.emplace_back(address, port);
  } else {
    tcp::resolver resolver(ex);
    std::error_code ec;
    auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec) throw_error(errc::invalid_argument, what + ": cannot resolve '" + host + "': " + ec.message());
    for (const auto& r : results) endpoints.push_back(r.endpoint());
  }
  const std::string where = what + " (" + host + ":" + std::to_string(port) + ")";
  std::chrono::milliseconds backoff(5);
  std::string last = "no attempt";
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      throw_error(errc::timeout, where + ": could not connect within " + std::to_string(deadline.count()) +
                                     " ms (last error: " + last + ")");
    // One endpoint after the other, each socket opened here: asio's range connect
    // opens them itself and, when it cannot (out of descriptors), reports only
    // "Operation aborted".
    for (const auto& endpoint : endpoints) {
      tcp::socket socket(ex);
      std::error_code opened;
      socket.open(endpoint.protocol(), opened);
      if (opened) {
        if (out_of_descriptors(opened))
          throw_error(errc::resource_exhausted, where + ": cannot open a socket: " + describe(opened));
        last = describe(opened);
        continue;
      }
      try {
        co_await async::with_deadline(socket.async_connect(endpoint, asio::use_awaitable), left, where);
        tune(socket);
        co_return socket;
      } catch (const error& e) {
        if (e.kind() == errc::timeout) throw;
        last = e.message();
      } catch (const std::system_error& e) {
        // Refused or unreachable: the peer may not be listening yet.
        last = describe(e.code());
      }
    }
    asio::steady_timer timer(ex, std::min(backoff, left));
    co_await timer.async_wait(asio::use_awaitable);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

tcp::acceptor listen(const asio::any_io_executor& ex, const std::string& host, std::uint16_t port) {
  std::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (ec)
    throw_error(errc::invalid_argument, "listen address '" + host + "' is not an IP address (" + ec.message() + ")");
  tcp::acceptor acceptor(ex);
  tcp::endpoint endpoint(address, port);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw_error(errc::io_error, "cannot listen on " + host + ":" + std::to_string(port) + ": " + ec.message());
  return acceptor;
}

asio::awaitable<tcp::socket> accept(tcp::acceptor& acceptor, std::chrono::milliseconds deadline, std::string what,
                                    asio::any_io_executor socket_executor) {
  try {
    tcp::socket socket(socket_executor ? socket_executor : acceptor.get_executor());
    co_await async::with_deadline(acceptor.async_accept(socket, asio::use_awaitable), deadline, what);
    tune(socket);
    co_return socket;
  } catch (const error&) {
    throw;
  } catch (const std::system_error& e) {
    throw_io_error(e.code(), what);
  }
}

void tune(tcp::socket& socket) {
  std::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
}

void close(tcp::socket& socket) noexcept {
  std::error_code ignored;
  socket.shutdown(tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
}

void set_buffers(tcp::socket& socket, std::size_t bytes) {
  if (bytes == 0) return;
  const int n = static_cast<int>(std::min<std::size_t>(bytes, std::numeric_limits<int>::max()));
  std::error_code ignored;
  socket.set_option(asio::socket_base::send_buffer_size(n), ignored);
  socket.set_option(asio::socket_base::receive_buffer_size(n), ignored);
}

}  // namespace refit::net
