#include <refit/internal/hex.h>

namespace refit {
namespace {

constexpr char digits[] = "0123456789abcdef";

int digit_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string to_hex(std::span<const std::byte> bytes) {
  std::string out;
  out.reserve(2 * bytes.size());
  for (std::byte b : bytes) {
    out += digits[static_cast<unsigned>(b) >> 4];
    out += digits[static_cast<unsigned>(b) & 15];
  }
  return out;
}

std::string to_hex(std::uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = digits[v & 15];
  return out;
}

bool is_hex(std::string_view text) noexcept {
  if (text.size() % 2 != 0) return false;
  for (char c : text)
    if (digit_value(c) < 0) return false;
  return true;
}

bool from_hex(std::string_view text, std::span<std::byte> out) noexcept {
  if (text.size() != 2 * out.size()) return false;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int hi = digit_value(text[2 * i]), lo = digit_value(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<std::byte>(hi * 16 + lo);
  }
  return true;
}

}  // namespace refit
