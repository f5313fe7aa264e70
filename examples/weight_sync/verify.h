// Verification, the same for every job: after each round every worker's
// weight_fingerprint (hashed from what its model holds now) is compared with what
// it must hold, every difference counted, the first one kept for the report.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>

#include <refit/control/worker_group.h>
#include <refit/integrity/fingerprint.h>

namespace refit::example::weight_sync {

struct verification {
  bool verified = true;        // no round differed so far
  int rounds_done = 0;         // rounds checked
  std::string first_mismatch;  // "worker W after update R: <difference>"

  /// Records round `round`'s differences (by worker, as worker_group's
  /// fingerprint_differences gives them); returns how many there were.
  std::size_t record(const std::vector<std::vector<std::string>>& differences, int round);
};

/// Checks every worker against `expected` (the same model on every worker) after
/// update `round`; returns the number of differences (recorded in `v`).
asio::awaitable<std::size_t> verify_round(control::worker_group& workers, fingerprint_list expected, int round,
                                          verification& v);
/// The same with each worker's own expectation (a sharded transfer's slices).
asio::awaitable<std::size_t> verify_round(control::worker_group& workers, std::vector<fingerprint_list> expected,
                                          int round, verification& v);

/// "verified", or "MISMATCH in N tensors" (the progress lines' verdict).
std::string verdict(std::size_t differences);

}  // namespace refit::example::weight_sync
