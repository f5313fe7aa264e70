// Every wait on a peer has a deadline: with_deadline races an operation against a
// timer and turns expiry into refit::error(timeout) naming what was awaited.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <type_traits>

#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/experimental/parallel_group.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/error.h>

namespace refit::async {

/// Awaits `op`; if `limit` passes first, `op` is cancelled and refit::error(timeout)
/// "<what>: no progress within <limit> ms" is thrown. An error of `op` propagates
/// at once (not at the deadline). T must be default-constructible.
template <class T>
asio::awaitable<T> with_deadline(asio::awaitable<T> op, std::chrono::milliseconds limit, std::string what) {
  namespace ex = asio::experimental;
  auto executor = co_await asio::this_coro::executor;
  asio::steady_timer timer(executor, limit);
  auto group =
      ex::make_parallel_group(asio::co_spawn(executor, std::move(op), ex::deferred), timer.async_wait(ex::deferred));
  auto timed_out = [&] {
    throw_error(errc::timeout, what + ": no progress within " + std::to_string(limit.count()) + " ms");
  };
  if constexpr (std::is_void_v<T>) {
    auto [order, error, ignored] = co_await group.async_wait(ex::wait_for_one(), asio::use_awaitable);
    if (order[0] == 1) timed_out();
    if (error) std::rethrow_exception(error);
  } else {
    auto [order, error, value, ignored] = co_await group.async_wait(ex::wait_for_one(), asio::use_awaitable);
    if (order[0] == 1) timed_out();
    if (error) std::rethrow_exception(error);
    co_return std::move(value);
  }
}

}  // namespace refit::async
