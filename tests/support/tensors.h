// Deterministic tensor sets for tests: owned host memory with a pattern derived
// from a seed, so sender and receiver can check every byte.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <refit/engine.h>
#include <refit/metadata.h>
#include <refit/tensor.h>

namespace refit::testing {

/// Tensors with owned, patterned bytes.
struct tensor_set {
  update_metadata meta;
  std::vector<std::vector<std::byte>> data;

  /// Adds a tensor whose bytes follow a pattern of (seed, index).
  void add(std::string name, dtype type, std::vector<std::int64_t> shape, std::uint64_t seed = 1);
  /// Views of every tensor, in order.
  std::vector<tensor_view> views();
};

/// The pattern byte i of a tensor with key k.
std::byte pattern_byte(std::uint64_t key, std::uint64_t i);

/// A load_weights that copies what it gets, for checking afterwards. Thread-safe.
class capture {
 public:
  load_weights_fn fn();
  std::size_t calls() const;
  /// Throws unless every tensor of `expected` arrived exactly once with identical
  /// metadata and bytes (gtest-agnostic so any test can use it).
  void check_equals(const tensor_set& expected) const;
  std::map<std::string, std::vector<std::byte>> received() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> got_;
  std::size_t calls_ = 0;
  std::vector<std::string> duplicates_;
};

}  // namespace refit::testing
