// Waiting, from a test's thread, for something that has no event to wait on: a
// child process's exit (waitpid has no timeout), a count the kernel keeps (the
// threads in /proc/self/task), a remote peer's state that is only ever polled.
// Where there is an event (a thread's result, a coroutine's completion), wait
// on it instead: a std::future's wait_for, or run_until (run.h) on a loop.
#pragma once

#include <chrono>
#include <thread>

namespace refit::testing {

/// Calls `done()` every `every` until it is true or `limit` has passed; returns
/// its last value (true at once if it already holds). The only sleep of the test
/// suites is this one: a polling interval under a deadline.
template <class Pred>
bool poll_until(Pred done, std::chrono::milliseconds limit,
                std::chrono::milliseconds every = std::chrono::milliseconds(5)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return done();
    std::this_thread::sleep_for(every);
  }
}

}  // namespace refit::testing
