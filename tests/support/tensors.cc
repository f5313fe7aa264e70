#include "tests/support/tensors.h"

#include <functional>
#include <stdexcept>

namespace refit::testing {

std::byte pattern_byte(std::uint64_t key, std::uint64_t i) {
  std::uint64_t x = (key + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  return static_cast<std::byte>(x * 0x94D049BB133111EBull >> 56);
}

void tensor_set::add(std::string name, dtype type, std::vector<std::int64_t> shape, std::uint64_t seed) {
  tensor_spec spec{std::move(name), type, std::move(shape)};
  std::vector<std::byte> bytes(spec.nbytes());
  const std::uint64_t key = std::hash<std::string>{}(spec.name) ^ seed;
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = pattern_byte(key, i);
  meta.tensors.push_back(std::move(spec));
  data.push_back(std::move(bytes));
}

std::vector<tensor_view> tensor_set::views() {
  std::vector<tensor_view> out;
  for (std::size_t i = 0; i < meta.tensors.size(); ++i) out.emplace_back(meta.tensors[i], data[i].data());
  return out;
}

load_weights_fn capture::fn() {
  return [this](std::span<const tensor_view> views) {
    std::lock_guard lock(mutex_);
    ++calls_;
    for (const auto& v : views) {
      auto bytes = v.bytes();
      auto [it, inserted] =
          got_.try_emplace(std::string(v.name), v.spec(), std::vector<std::byte>(bytes.begin(), bytes.end()));
      if (!inserted) duplicates_.emplace_back(v.name);
    }
  };
}

std::size_t capture::calls() const {
  std::lock_guard lock(mutex_);
  return calls_;
}

std::map<std::string, std::vector<std::byte>> capture::received() const {
  std::lock_guard lock(mutex_);
  std::map<std::string, std::vector<std::byte>> out;
  for (const auto& [name, v] : got_) out[name] = v.second;
  return out;
}

void capture::check_equals(const tensor_set& expected) const {
  std::lock_guard lock(mutex_);
  if (!duplicates_.empty()) throw std::runtime_error("tensor delivered twice: " + duplicates_.front());
  if (got_.size() != expected.meta.tensors.size())
    throw std::runtime_error("received " + std::to_string(got_.size()) + " tensors, expected " +
                             std::to_string(expected.meta.tensors.size()));
  for (std::size_t i = 0; i < expected.meta.tensors.size(); ++i) {
    const auto& spec = expected.meta.tensors[i];
    auto it = got_.find(spec.name);
    if (it == got_.end()) throw std::runtime_error("tensor not received: " + spec.name);
    if (!(it->second.first == spec)) throw std::runtime_error("metadata differ for " + spec.name);
    if (it->second.second != expected.data[i]) throw std::runtime_error("bytes differ for " + spec.name);
  }
}

}  // namespace refit::testing
