// Every wait on a peer has a deadline: with_deadline races an operation against a
// timer and turns expiry into refit::error(timeout) naming what was awaited.
#pragma once

#include <chrono>
#include <string>
#include <type_traits>
#include <variant>

#include <asio/awaitable.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include "lib/error.h"

namespace refit::async {

/// Awaits `op`; if `limit` passes first, `op` is cancelled and refit::error(timeout)
/// "<what>: no progress within <limit> ms" is thrown.
template <class T>
asio::awaitable<T> with_deadline(asio::awaitable<T> op, std::chrono::milliseconds limit,
                                 std::string what) {
  using namespace asio::experimental::awaitable_operators;
  asio::steady_timer timer(co_await asio::this_coro::executor, limit);
  auto result = co_await (std::move(op) || timer.async_wait(asio::use_awaitable));
  if (result.index() == 1)
    throw_error(errc::timeout,
                what + ": no progress within " + std::to_string(limit.count()) + " ms");
  if constexpr (std::is_void_v<T>)
    co_return;
  else
    co_return std::get<0>(std::move(result));
}

}  // namespace refit::async
