#include "examples/weight_sync/verify.h"

#include <utility>

namespace refit::example::weight_sync {

std::size_t verification::record(const std::vector<std::vector<std::string>>& differences, int round) {
  std::size_t bad = 0;
  for (std::size_t w = 0; w < differences.size(); ++w) {
    const auto& diff = differences[w];
    if (!diff.empty() && first_mismatch.empty())
      first_mismatch = "worker " + std::to_string(w) + " after update " + std::to_string(round) + ": " + diff[0];
    bad += diff.size();
  }
  if (bad) verified = false;
  ++rounds_done;
  return bad;
}

asio::awaitable<std::size_t> verify_round(control::worker_group& workers, fingerprint_list expected, int round,
                                          verification& v) {
  co_return v.record(co_await workers.fingerprint_differences(std::move(expected), round), round);
}

asio::awaitable<std::size_t> verify_round(control::worker_group& workers, std::vector<fingerprint_list> expected,
                                          int round, verification& v) {
  co_return v.record(co_await workers.fingerprint_differences(std::move(expected), round), round);
}

std::string verdict(std::size_t differences) {
  return differences ? "MISMATCH in " + std::to_string(differences) + " tensors" : "verified";
}

}  // namespace refit::example::weight_sync
