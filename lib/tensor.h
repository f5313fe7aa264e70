// What refit moves: named, typed, shaped byte ranges. The core never owns tensor
// memory; engines hand load_weights non-owning views into their staging memory, and
// trainers hand senders views of their own tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <refit/dtype.h>

namespace refit {

/// Where bytes live: host memory or a CUDA device.
struct device {
  enum class kind : std::uint8_t { cpu, cuda };
  kind type = kind::cpu;
  int index = 0;  ///< CUDA ordinal; 0 for cpu

  static device cpu() noexcept { return {}; }
  static device cuda(int index) noexcept { return {kind::cuda, index}; }
  bool is_cpu() const noexcept { return type == kind::cpu; }
  bool is_cuda() const noexcept { return type == kind::cuda; }
  friend bool operator==(const device&, const device&) = default;
};

/// "cpu" or "cuda:N" (torch's spelling; bare "cuda" means cuda:0).
std::string to_string(const device& d);
/// Parses to_string's output; throws refit::error(invalid_argument) otherwise.
device parse_device(std::string_view text);

/// Element count of a shape; throws invalid_argument on a negative dimension or on
/// overflow of int64.
std::int64_t checked_numel(std::span<const std::int64_t> shape);
/// Byte size of a shape of `type`; throws invalid_argument on negative dimensions or
/// any overflow, naming `what` (usually the tensor name) in the message.
std::uint64_t checked_nbytes(dtype type, std::span<const std::int64_t> shape, std::string_view what = {});
/// "[2, 3]".
std::string shape_to_string(std::span<const std::int64_t> shape);

/// Metadata of one tensor: what the trainer declares and the worker expects.
struct tensor_spec {
  std::string name;
  refit::dtype dtype = dtype::float32;
  std::vector<std::int64_t> shape;

  /// Validated byte size (see checked_nbytes).
  std::uint64_t nbytes() const { return checked_nbytes(dtype, shape, name); }
  friend bool operator==(const tensor_spec&, const tensor_spec&) = default;
};

/// A non-owning view of one tensor's bytes (contiguous, row-major). Everything it
/// refers to (name, shape, data) must outlive it; it is cheap to copy.
struct tensor_view {
  std::string_view name;
  refit::dtype dtype = dtype::float32;
  std::span<const std::int64_t> shape;
  std::byte* data = nullptr;
  refit::device device;

  tensor_view() = default;
  tensor_view(std::string_view name, refit::dtype type, std::span<const std::int64_t> shape, void* data,
              refit::device dev = {})
      : name(name), dtype(type), shape(shape), data(static_cast<std::byte*>(data)), device(dev) {}
  /// A view of `spec` at `data`; `spec` must outlive the view.
  tensor_view(const tensor_spec& spec, void* data, refit::device dev = {})
      : tensor_view(spec.name, spec.dtype, spec.shape, data, dev) {}

  std::int64_t numel() const { return checked_numel(shape); }
  std::uint64_t nbytes() const { return checked_nbytes(dtype, shape, name); }
  /// The bytes, for host views.
  std::span<std::byte> bytes() const { return {data, static_cast<std::size_t>(nbytes())}; }
  /// An owning copy of the metadata.
  tensor_spec spec() const { return {std::string(name), dtype, std::vector<std::int64_t>(shape.begin(), shape.end())}; }
};

/// Checks that `got` (what a trainer iterates) matches `declared` (what it announced
/// as parameter number `index`); throws invalid_argument naming the first divergent
/// parameter and what differs.
void check_matches_declared(const tensor_spec& declared, const tensor_view& got, std::size_t index);

}  // namespace refit
