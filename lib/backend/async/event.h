// A manual-reset event for coroutines on one executor: the building block for
// "wait until this becomes true" without threads or sleeps.
#pragma once

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/steady_timer.hpp>

#include <cstdint>

namespace refit::async {

/// Waiters suspend until set(); set() wakes all of them and stays set until reset().
/// Not thread-safe: use it from its executor only (a single-threaded io_context or a
/// strand).
class event {
 public:
  explicit event(asio::any_io_executor ex);

  bool is_set() const noexcept { return set_; }
  /// Wakes every waiter; later waits complete at once until reset().
  void set();
  void reset();
  /// Completes when the event is set.
  asio::awaitable<void> wait();

 private:
  // A timer that never expires on its own; cancelling it is the wake-up broadcast.
  asio::steady_timer timer_;
  bool set_ = false;
  // Counts set() calls: a waiter woken by a set() returns even if reset() came
  // before it resumed.
  std::uint64_t generation_ = 0;
};

}  // namespace refit::async
