// Helpers for coroutine tests: run coroutines on an io_context to completion, with a
// watchdog so a hang fails the test instead of stalling it (no sleeps anywhere).
#pragma once

#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>

#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit::testing {

/// The outcome of one spawned coroutine.
struct outcome {
  bool done = false;
  std::exception_ptr error;

  /// The message of the exception (empty if none).
  std::string message() const;
  /// The refit error kind, if the exception was a refit::error.
  int kind() const;
};

/// Spawns `work` on `io`; the returned outcome fills in when it finishes.
template <class Awaitable>
std::shared_ptr<outcome> spawn(asio::io_context& io, Awaitable work) {
  auto result = std::make_shared<outcome>();
  asio::co_spawn(io, std::move(work), [result](std::exception_ptr e) {
    result->done = true;
    result->error = e;
  });
  return result;
}

/// Runs `io` until it has no work or `limit` passes; returns false on the latter.
bool run(asio::io_context& io, std::chrono::milliseconds limit = std::chrono::seconds(60));

/// Runs `io` until `done()` is true or `limit` passes; returns done().
template <class Pred>
bool run_until(asio::io_context& io, Pred done, std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  io.restart();
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < deadline) io.run_one_for(std::chrono::milliseconds(100));
  return done();
}

/// Runs one coroutine to completion (other work on `io` may stay pending) and
/// rethrows its exception.
void run_to_completion(asio::io_context& io, asio::awaitable<void> work,
                       std::chrono::milliseconds limit = std::chrono::seconds(60));

/// Sends `views` declared as `meta` (coroutine parameters, not lambda captures, so
/// they live as long as the coroutine; `meta` must outlive it).
asio::awaitable<void> send_views(weight_sender& sender, const update_metadata& meta, std::vector<tensor_view> views);
/// Receives one update and, when `drain`, drains it.
asio::awaitable<void> receive_update(weight_transfer_engine& engine, std::unique_ptr<update_info> info,
                                     load_weights_fn load, bool drain = true);

}  // namespace refit::testing
