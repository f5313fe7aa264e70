// The torch_ipc workers' "digest" answer for one tensor: over its bytes b_i,
// sum = sum of b_i and weighted = sum of (i + 1) * b_i, both modulo 2^64. Cheap to
// compute with torch on the trainer's side (refit_ipc.py's digest()), and
// sensitive to any byte out of place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

namespace refit::example {

inline std::pair<std::uint64_t, std::uint64_t> byte_digest(std::span<const std::byte> bytes) {
  std::uint64_t sum = 0, weighted = 0, i = 1;
  for (std::byte b : bytes) {
    sum += static_cast<std::uint64_t>(b);
    weighted += i++ * static_cast<std::uint64_t>(b);
  }
  return {sum, weighted};
}

}  // namespace refit::example
