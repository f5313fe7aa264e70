// How late an event loop runs its work: a timer that fires every `period` and
// records by how much it was late. An inference server that shares its loop with
// refit uses it to see whether anything (refit's included) stalls request
// handling; the main job and the control-plane benchmark report it per phase.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/steady_timer.hpp>

#include <refit/json_reader.h>

namespace refit::async {

class lag_probe {
 public:
  /// What take() reports: lateness of the timer's wake-ups since the last take().
  struct report {
    double max_ms = 0;  ///< the largest stall seen
    double p99_ms = 0;  ///< 99th percentile (0.1 ms resolution up to 100 ms)
    std::uint64_t samples = 0;
    json to_json() const;
  };

  /// Starts probing `ex` (every `period`) at once; stops on destruction or stop().
  explicit lag_probe(asio::any_io_executor ex, std::chrono::microseconds period = std::chrono::milliseconds(1));
  ~lag_probe();
  lag_probe(const lag_probe&) = delete;
  lag_probe& operator=(const lag_probe&) = delete;

  void stop();
  /// The lateness recorded since the last take(), then starts afresh. Call from
  /// the probed executor.
  report take();

 private:
  struct state;
  static asio::awaitable<void> run(std::shared_ptr<state> s, std::chrono::microseconds period);
  std::shared_ptr<state> state_;
};

}  // namespace refit::async
