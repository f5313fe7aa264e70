// Engines reach the helper through the backend API's header, the core through its
// internal one: both declare the same functions (a difference in a return type or
// noexcept fails to compile here, one in a parameter fails to link).
#include <refit/backend/hex.h>
#include <refit/internal/hex.h>

#include <gtest/gtest.h>

#include <array>

namespace refit {
namespace {

TEST(hex, bytes_round_trip) {
  const std::array<std::byte, 4> in{std::byte{0x00}, std::byte{0x0f}, std::byte{0xa5}, std::byte{0xff}};
  EXPECT_EQ(to_hex(in), "000fa5ff");
  std::array<std::byte, 4> out{};
  EXPECT_TRUE(from_hex("000FA5ff", out));
  EXPECT_EQ(out, in);
  EXPECT_EQ(to_hex(std::span<const std::byte>{}), "");
}

TEST(hex, uint64_is_sixteen_digits) {
  EXPECT_EQ(to_hex(std::uint64_t{0}), "0000000000000000");
  EXPECT_EQ(to_hex(std::uint64_t{0x0123456789abcdefULL}), "0123456789abcdef");
}

TEST(hex, bad_text_is_refused) {
  std::array<std::byte, 2> out{};
  EXPECT_FALSE(from_hex("abc", out)) << "odd length";
  EXPECT_FALSE(from_hex("abcdef", out)) << "too long";
  EXPECT_FALSE(from_hex("ab g0", out));
  EXPECT_FALSE(from_hex("+fff", out));
  EXPECT_TRUE(is_hex("00ffAA"));
  EXPECT_FALSE(is_hex("0"));
  EXPECT_FALSE(is_hex("0x"));
  EXPECT_TRUE(is_hex(""));
}

}  // namespace
}  // namespace refit
