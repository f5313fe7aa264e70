#include <refit/net.h>

#include <algorithm>
#include <limits>

#include <asio/connect.hpp>
#include <asio/ip/address.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>

namespace refit::net {

void throw_io_error(const std::error_code& ec, const std::string& what) {
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe || ec == asio::error::connection_aborted)
    throw_error(errc::peer_lost, what + ": the peer closed the connection (" + ec.message() + ")");
  if (ec == asio::error::operation_aborted)
    throw_error(errc::cancelled, what + ": cancelled (" + ec.message() + ")");
  throw error(errc::io_error, what + ": " + ec.message());
}

asio::awaitable<tcp::socket> connect_with_retry(const std::string& host, std::uint16_t port,
                                                std::chrono::milliseconds deadline,
                                                std::string what) {
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
      throw_error(errc::timeout, where + ": could not connect within " +
                                     std::to_string(deadline.count()) + " ms (last error: " + last + ")");
    tcp::socket socket(ex);
    try {
      co_await async::with_deadline(asio::async_connect(socket, endpoints, asio::use_awaitable), left, where);
      tune(socket);
      co_return socket;
    } catch (const error& e) {
      if (e.kind() == errc::timeout) throw;
      last = e.message();
    } catch (const std::system_error& e) {
      // Refused or unreachable: the peer may not be listening yet.
      last = e.code().message();
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
    throw_error(errc::invalid_argument,
                "listen address '" + host + "' is not an IP address (" + ec.message() + ")");
  tcp::acceptor acceptor(ex);
  tcp::endpoint endpoint(address, port);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw_error(errc::io_error, "cannot listen on " + host + ":" + std::to_string(port) + ": " + ec.message());
  return acceptor;
}

asio::awaitable<tcp::socket> accept(tcp::acceptor& acceptor, std::chrono::milliseconds deadline,
                                    std::string what, asio::any_io_executor socket_executor) {
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

void set_buffers(tcp::socket& socket, std::size_t bytes) {
  if (bytes == 0) return;
  const int n = static_cast<int>(std::min<std::size_t>(bytes, std::numeric_limits<int>::max()));
  std::error_code ignored;
  socket.set_option(asio::socket_base::send_buffer_size(n), ignored);
  socket.set_option(asio::socket_base::receive_buffer_size(n), ignored);
}

}  // namespace refit::net
