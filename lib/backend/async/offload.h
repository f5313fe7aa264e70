// Runs CPU work on a thread pool and resumes the caller on its own executor, so a
// coroutine on an event loop never blocks the loop on heavy work.
#pragma once

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/awaitable.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

namespace refit::async {

/// Calls `fn()` on `pool` (any executor, typically asio::thread_pool's) and delivers
/// its result, or the exception it threw, to `token`'s handler on the handler's own
/// executor. With the default token, `co_await offload(pool, fn)` returns fn's result
/// or rethrows its exception in the awaiting coroutine.
///
/// Pass a lambda that captures only pointers, references and trivially copyable
/// values when it is written inside the co_await expression: GCC 12 may destroy such
/// a temporary twice (seen as a shared_ptr released twice), so anything that owns
/// memory lives in the coroutine frame and is captured by reference.
template <class Executor, class Fn, class Token = const asio::use_awaitable_t<>&>
auto offload(const Executor& pool, Fn fn, Token&& token = asio::use_awaitable) {
  using result = std::invoke_result_t<Fn&>;
  if constexpr (std::is_void_v<result>) {
    return asio::async_initiate<Token, void(std::exception_ptr)>(
        [pool](auto handler, Fn fn) {
          auto home = asio::make_work_guard(asio::get_associated_executor(handler));
          asio::post(pool, [handler = std::move(handler), fn = std::move(fn), home = std::move(home)]() mutable {
            std::exception_ptr error;
            try {
              fn();
            } catch (...) {
              error = std::current_exception();
            }
            auto ex = home.get_executor();
            // Moved, not copied: the pool thread keeps no reference to the result,
            // so it is created here and destroyed on the caller's side only.
            asio::post(
                ex, [handler = std::move(handler), error = std::move(error)]() mutable { std::move(handler)(error); });
          });
        },
        token, std::move(fn));
  } else {
    return asio::async_initiate<Token, void(std::exception_ptr, result)>(
        [pool](auto handler, Fn fn) {
          auto home = asio::make_work_guard(asio::get_associated_executor(handler));
          asio::post(pool, [handler = std::move(handler), fn = std::move(fn), home = std::move(home)]() mutable {
            std::exception_ptr error;
            std::optional<result> value;
            try {
              value.emplace(fn());
            } catch (...) {
              error = std::current_exception();
            }
            auto ex = home.get_executor();
            asio::post(ex,
                       [handler = std::move(handler), error = std::move(error), value = std::move(value)]() mutable {
                         std::move(handler)(error, value ? std::move(*value) : result{});
                       });
          });
        },
        token, std::move(fn));
  }
}

/// Lets the handlers waiting on the coroutine's executor run before it goes on: a
/// loop over thousands of items on an event loop calls it every few hundred, so no
/// stretch of it holds the loop for long.
inline asio::awaitable<void> yield_now() {
  auto ex = co_await asio::this_coro::executor;
  co_await asio::post(ex, asio::use_awaitable);
}

}  // namespace refit::async
