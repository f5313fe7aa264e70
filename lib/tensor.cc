#include <refit/tensor.h>

#include <charconv>
#include <limits>

#include <refit/error.h>

namespace refit {

std::string to_string(const device& d) { return d.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(d.index); }

device parse_device(std::string_view text) {
  if (text == "cpu") return device::cpu();
  if (text == "cuda") return device::cuda(0);
  if (text.starts_with("cuda:")) {
    std::string_view digits = text.substr(5);
    int index = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc{} && end == digits.data() + digits.size() && index >= 0) return device::cuda(index);
  }
  throw_error(errc::invalid_argument, "invalid device '" + std::string(text) + "': expected 'cpu' or 'cuda:N'");
}

std::string shape_to_string(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::int64_t checked_numel(std::span<const std::int64_t> shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) throw_error(errc::invalid_argument, "negative dimension in shape " + shape_to_string(shape));
    if (__builtin_mul_overflow(n, d, &n))
      throw_error(errc::invalid_argument, "shape " + shape_to_string(shape) + " overflows the element count");
  }
  return n;
}

std::uint64_t checked_nbytes(dtype type, std::span<const std::int64_t> shape, std::string_view what) {
  auto fail = [&](const std::string& why) {
    std::string prefix = what.empty() ? "" : "tensor '" + std::string(what) + "': ";
    throw_error(errc::invalid_argument, prefix + why);
  };
  std::uint64_t n = element_size(type);
  for (std::int64_t d : shape) {
    if (d < 0) fail("negative dimension in shape " + shape_to_string(shape));
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n))
      fail("shape " + shape_to_string(shape) + " of " + std::string(to_string(type)) + " overflows the byte size");
  }
  // Byte offsets are also used as signed sizes (ptrdiff_t) downstream.
  if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    fail("shape " + shape_to_string(shape) + " is too large");
  return n;
}

void check_matches_declared(const tensor_spec& declared, const tensor_view& got, std::size_t index) {
  auto fail = [&](const std::string& what, const std::string& expected, const std::string& came) {
    throw_error(errc::invalid_argument, "parameter #" + std::to_string(index) + " ('" + declared.name + "') " + what +
                                            ": declared " + expected + ", sent " + came);
  };
  if (got.name != declared.name) fail("name", "'" + declared.name + "'", "'" + std::string(got.name) + "'");
  if (got.dtype != declared.dtype)
    fail("dtype", std::string(to_string(declared.dtype)), std::string(to_string(got.dtype)));
  if (!std::equal(got.shape.begin(), got.shape.end(), declared.shape.begin(), declared.shape.end()))
    fail("shape", shape_to_string(declared.shape), shape_to_string(got.shape));
  if (got.data == nullptr && got.nbytes() != 0) fail("data", "non-null data", "a null pointer");
}

}  // namespace refit
