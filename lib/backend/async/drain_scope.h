// The completion of deferred work: engines that set defers_processing start
// post-processing here, and drain_pending() is join().
#pragma once

#include <cstddef>
#include <exception>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>

#include <refit/backend/async/event.h>

namespace refit::async {

/// Counts work in flight and joins it. The first error of any piece of work is kept
/// and rethrown by the next join(), once; later errors of the same round are dropped
/// (they are usually consequences of the first). join() with nothing pending and no
/// error completes at once, so it is idempotent.
///
/// All members are called from the scope's executor; work may run elsewhere, its
/// completion is posted back here.
class drain_scope {
 public:
  explicit drain_scope(asio::any_io_executor ex);
  drain_scope(const drain_scope&) = delete;
  drain_scope& operator=(const drain_scope&) = delete;

  /// Runs `work` detached (on its own executor) and counts it until it finishes.
  void spawn(asio::awaitable<void> work);
  /// Manual counting for work started by other means: add() before, done() after.
  void add() noexcept;
  void done(std::exception_ptr error = nullptr);

  /// Completes when nothing is pending; rethrows the first error recorded since the
  /// last join (and forgets it).
  asio::awaitable<void> join();

  std::size_t pending() const noexcept { return pending_; }
  bool has_error() const noexcept { return static_cast<bool>(error_); }
  const asio::any_io_executor& get_executor() const noexcept { return ex_; }

 private:
  asio::any_io_executor ex_;
  std::size_t pending_ = 0;
  std::exception_ptr error_;
  event idle_;
};

}  // namespace refit::async
