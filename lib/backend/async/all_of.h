// Runs several coroutines at once and waits for all of them: the trainer writes a
// bucket to every worker concurrently and moves on when the slowest has it.
#pragma once

#include <exception>
#include <memory>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>

#include <refit/backend/async/event.h>

namespace refit::async {

/// Starts every operation on the caller's executor and completes when all have
/// finished (none is abandoned half way); then rethrows the first error, if any.
inline asio::awaitable<void> all_of(std::vector<asio::awaitable<void>> ops) {
  if (ops.empty()) co_return;
  auto ex = co_await asio::this_coro::executor;
  struct shared {
    explicit shared(asio::any_io_executor ex, std::size_t n) : done(ex), left(n) {}
    event done;
    std::size_t left;
    std::exception_ptr first;
  };
  auto s = std::make_shared<shared>(ex, ops.size());
  for (auto& op : ops)
    asio::co_spawn(ex, std::move(op), [s](std::exception_ptr e) {
      if (e && !s->first) s->first = e;
      if (--s->left == 0) s->done.set();
    });
  co_await s->done.wait();
  if (s->first) std::rethrow_exception(s->first);
}

}  // namespace refit::async
