// The socket helpers every refit transfer goes through: large transfers per system
// call (asio's default asks for at most 64 KiB a call), deadlines, peer loss.
#include <refit/backend/net.h>

#include <gtest/gtest.h>

#include <asio/io_context.hpp>

#include <refit/backend/async/all_of.h>
#include "tests/support/run.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

// A stream that counts what is asked of the socket under it, call by call.
struct counting_stream {
  asio::ip::tcp::socket& socket;
  std::size_t calls = 0;
  std::size_t largest_request = 0;
  std::size_t requested = 0;

  using executor_type = asio::ip::tcp::socket::executor_type;
  executor_type get_executor() { return socket.get_executor(); }
  template <class Buffers, class Token>
  auto async_read_some(const Buffers& b, Token&& token) {
    note(asio::buffer_size(b));
    return socket.async_read_some(b, std::forward<Token>(token));
  }
  template <class Buffers, class Token>
  auto async_write_some(const Buffers& b, Token&& token) {
    note(asio::buffer_size(b));
    return socket.async_write_some(b, std::forward<Token>(token));
  }
  void note(std::size_t n) {
    ++calls;
    requested += n;
    largest_request = std::max(largest_request, n);
  }
};

asio::awaitable<void> connected_pair(asio::io_context& io, asio::ip::tcp::socket& a, asio::ip::tcp::socket& b) {
  auto acceptor = net::listen(io.get_executor(), "127.0.0.1", 0);
  const auto port = acceptor.local_endpoint().port();
  auto accepting = acceptor.async_accept(asio::use_awaitable);
  a = co_await net::connect_with_retry("127.0.0.1", port, 5s, "test");
  b = co_await std::move(accepting);
}

asio::awaitable<void> move_bytes(counting_stream& out, counting_stream& in, std::vector<std::byte>& src,
                                 std::vector<std::byte>& dst, std::size_t read_per_call) {
  const asio::const_buffer from = asio::buffer(src);  // named: the operations keep references
  const asio::mutable_buffer to = asio::buffer(dst);
  std::vector<asio::awaitable<void>> both;
  both.push_back(net::write_all(out, from, 10s, "write"));
  both.push_back(net::read_exact(in, to, 10s, "read", read_per_call));
  co_await async::all_of(std::move(both));
}

// `bytes` over a loopback connection, read with `read_per_call`; the two sides'
// counts of what was asked of their sockets.
struct counts {
  std::size_t calls = 0, largest_request = 0;
};
struct moved {
  counts in, out;
};
moved move_over_loopback(std::size_t bytes, std::size_t read_per_call) {
  asio::io_context io;
  asio::ip::tcp::socket a(io), b(io);
  run_to_completion(io, connected_pair(io, a, b));
  std::vector<std::byte> src(bytes), dst(bytes);
  for (std::size_t i = 0; i < src.size(); i += 4096) src[i] = static_cast<std::byte>(i >> 12);
  counting_stream out{a}, in{b};
  run_to_completion(io, move_bytes(out, in, src, dst, read_per_call));
  EXPECT_TRUE(src == dst);
  return {{in.calls, in.largest_request}, {out.calls, out.largest_request}};
}

TEST(net, transfers_ask_for_all_that_is_left_per_call_not_64_KiB) {
  const auto [in, out] = move_over_loopback(64 << 20, net::unbounded_per_call);
  // The first call of each side asks for the whole 64 MiB; the kernel decides how
  // much it moves at once. With asio's default every call asks for 64 KiB.
  EXPECT_EQ(out.largest_request, 64u << 20);
  EXPECT_EQ(in.largest_request, 64u << 20);
  EXPECT_LT(in.calls, 64u << 20 >> 16) << "as many calls as 64 KiB ones: " << in.calls;
  EXPECT_LT(out.calls, 64u << 20 >> 16) << "as many calls as 64 KiB ones: " << out.calls;
  std::printf("64 MiB over loopback: %zu write calls, %zu read calls (64 KiB per call: 1024)\n", out.calls, in.calls);
}

// On an event loop a server shares, a call asks for at most loop_bytes_per_call
// (~60 us of kernel copying): still 4x fewer calls than 64 KiB ones, and no call
// holds the loop for milliseconds.
TEST(net, loop_transfers_ask_for_at_most_their_bound_per_call) {
  const auto m = move_over_loopback(16 << 20, net::loop_bytes_per_call);
  EXPECT_EQ(m.in.largest_request, net::loop_bytes_per_call);
  EXPECT_GE(m.in.calls, (16u << 20) / net::loop_bytes_per_call);
  EXPECT_LT(m.in.calls, (16u << 20) >> 16) << "as many calls as 64 KiB ones";
}

}  // namespace
}  // namespace refit::testing
