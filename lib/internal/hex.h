// Bytes as lowercase hex text and back: how refit writes binary values (handles,
// ids, digests) into JSON and messages. The core's declaration (integrity/ uses it);
// engines and other backend code include <refit/backend/hex.h>, which declares the
// same functions for them (tests/lib/hex_test.cc includes both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace refit {

/// Two lowercase hex digits per byte.
std::string to_hex(std::span<const std::byte> bytes);
/// The 16 hex digits of `v` (most significant first).
std::string to_hex(std::uint64_t v);
/// True when `text` is hex digits only (either case) and of even length.
bool is_hex(std::string_view text) noexcept;
/// Decodes exactly out.size() bytes; false (out partly written) unless `text` is
/// 2 * out.size() hex digits.
bool from_hex(std::string_view text, std::span<std::byte> out) noexcept;

}  // namespace refit
