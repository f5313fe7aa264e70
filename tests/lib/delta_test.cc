// lib/backend/delta.h: every encoding decodes to exactly the bytes encoded, in place
// or not; the choice is the smallest; corrupt payloads are refused with
// protocol_error, sparse and bitmap ones before a byte of `out` changes.
#include <refit/backend/delta.h>

#include <cstring>
#include <random>
#include <vector>

#include "tests/lib/expect.h"

namespace refit::backend::delta {
namespace {

std::vector<std::byte> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// `base` with about `fraction` of its elements changed, scattered at random.
std::vector<std::byte> perturb(const std::vector<std::byte>& base, std::size_t elem, double fraction,
                               std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(fraction);
  std::vector<std::byte> next = base;
  for (std::size_t i = 0; i < base.size() / elem; ++i)
    if (pick(rng)) next[i * elem] = static_cast<std::byte>(static_cast<std::uint8_t>(next[i * elem]) ^ 1);
  return next;
}

std::size_t count_changed(const std::vector<std::byte>& a, const std::vector<std::byte>& b, std::size_t elem) {
  std::size_t c = 0;
  for (std::size_t i = 0; i < a.size() / elem; ++i) c += std::memcmp(&a[i * elem], &b[i * elem], elem) != 0;
  return c;
}

encode_result round_trip(const std::vector<std::byte>& base, const std::vector<std::byte>& next, std::size_t elem,
                         const encode_options& o = {}) {
  std::vector<std::byte> wire{std::byte{0xAB}};  // encode appends
  const auto r = encode(base, next, elem, wire, o);
  EXPECT_EQ(r.bytes, wire.size() - 1);
  EXPECT_EQ(r.changed, count_changed(base, next, elem));
  std::span<const std::byte> payload(wire.data() + 1, r.bytes);
  std::vector<std::byte> out(base.size());
  decode(r.kind, payload, base, out, elem);
  EXPECT_TRUE(out == next) << name(r.kind) << " did not decode to the encoded bytes";
  std::vector<std::byte> in_place = base;
  decode(r.kind, payload, in_place, in_place, elem);
  EXPECT_TRUE(in_place == next) << name(r.kind) << " in place did not decode to the encoded bytes";
  EXPECT_LE(r.bytes, base.size()) << "an encoding larger than the full bytes was chosen";
  return r;
}

TEST(Delta, NothingChangedIsAnEmptySparsePayload) {
  auto base = random_bytes(4096, 1);
  auto r = round_trip(base, base, 2);
  EXPECT_EQ(r.kind, encoding::sparse);
  EXPECT_EQ(r.bytes, 0u);
  EXPECT_EQ(r.changed, 0u);
}

TEST(Delta, FewChangesAreSparseOrSmaller) {
  auto base = random_bytes(1 << 20, 2);
  auto next = perturb(base, 2, 0.001, 3);
  auto s = round_trip(base, next, 2, {.allow_zstd = false});
  EXPECT_EQ(s.kind, encoding::sparse);
  // Each changed bf16: its 2 value bytes and a gap of at most 3 bytes.
  EXPECT_LE(s.bytes, s.changed * 5);
  EXPECT_GT(s.changed, 0u);
  // xor_planes is made in the same pass and kept only when smaller.
  auto r = round_trip(base, next, 2);
  EXPECT_TRUE(r.kind == encoding::sparse || r.kind == encoding::xor_planes) << name(r.kind);
  EXPECT_LE(r.bytes, s.bytes);
}

TEST(Delta, ModerateChangesBeatSparseWithBitmapOrZstd) {
  auto base = random_bytes(1 << 20, 4);
  auto next = perturb(base, 2, 0.2, 5);
  auto r = round_trip(base, next, 2);
  EXPECT_NE(r.kind, encoding::sparse);
  EXPECT_NE(r.kind, encoding::full);
  // Without zstd: the bitmap, exactly 1/16 of the elements plus the values.
  auto b = round_trip(base, next, 2, {.allow_zstd = false});
  EXPECT_EQ(b.kind, encoding::bitmap);
  EXPECT_EQ(b.bytes, (base.size() / 2 + 7) / 8 + b.changed * 2);
  EXPECT_LE(r.bytes, b.bytes);
}

TEST(Delta, XorPlanesWinOnSmallValueChanges) {
  // bf16 weights nudged by one ulp in their low bits (an optimizer step): the XOR
  // is mostly zeros and one-bit patterns. Its byte planes over the changed
  // elements pack below sparse, bitmap and xor_zstd.
  auto base = random_bytes(1 << 20, 6);
  auto next = perturb(base, 2, 0.1, 7);
  auto r = round_trip(base, next, 2);
  EXPECT_EQ(r.kind, encoding::xor_planes);
  auto z = round_trip(base, next, 2, {.allow_planes = false});
  EXPECT_EQ(z.kind, encoding::xor_zstd);
  EXPECT_LT(r.bytes, z.bytes);
  // Both tried: the smaller is kept, alone in the output.
  auto both = round_trip(base, next, 2, {.zstd_with_planes = true});
  EXPECT_EQ(both.kind, encoding::xor_planes);
  EXPECT_EQ(both.bytes, r.bytes);
}

TEST(Delta, XorPlanesSpanManyBlocksForEveryElementSize) {
  // More elements than one block of the encoder (64 Ki), and an odd count.
  for (std::size_t elem : {2u, 4u, 8u}) {
    const std::size_t n = 3 * (1u << 16) + 5;
    auto base = random_bytes(n * elem, static_cast<std::uint32_t>(30 + elem));
    for (double f : {0.0005, 0.05, 0.5}) {
      auto next = perturb(base, elem, f, static_cast<std::uint32_t>(40 + elem));
      next[next.size() - elem] ^= std::byte{1};  // the last element too
      auto r = round_trip(base, next, elem, {.zstd_above_fraction = 0});
      EXPECT_EQ(r.kind, encoding::xor_planes) << "elem " << elem << ", fraction " << f;
    }
  }
}

TEST(Delta, TwoByteElementsAtEveryTailAndBlockEdge) {
  // bf16's scan goes 64 elements at a time, then the tail one by one: every tail
  // length, changes in the low byte, the high byte or both, the first and the last
  // element, around the 64 Ki-element block edge; the planes at both settings.
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= 130; ++n) sizes.push_back(n);
  for (std::size_t n : {65472u, 65535u, 65536u, 65537u, 65599u, 65600u, 131073u}) sizes.push_back(n);
  for (std::size_t n : sizes) {
    auto base = random_bytes(2 * n, static_cast<std::uint32_t>(n));
    std::mt19937 rng(static_cast<std::uint32_t>(n) + 1);
    for (int form = 0; form < 3; ++form) {
      auto next = base;
      for (std::size_t i = 0; i < n; ++i) {
        if (i != 0 && i != n - 1 && rng() % 4 != 0) continue;
        if (form != 1) next[2 * i] ^= std::byte{0x01};
        if (form != 0) next[2 * i + 1] ^= std::byte{0x80};
      }
      for (bool fast : {true, false}) {
        auto r = round_trip(base, next, 2, {.fast_planes = fast, .zstd_above_fraction = 0});
        ASSERT_EQ(r.changed, count_changed(base, next, 2)) << "n " << n << ", form " << form;
      }
    }
  }
}

TEST(Delta, AHandfulOfChangesGoSparseWithPlanesAllowed) {
  // xor_planes' header and frames cost more than a few sparse records: the
  // sparse form is counted and chosen, at its exact size.
  auto base = random_bytes(1 << 20, 12);
  auto next = base;
  for (std::size_t i : {5u, 70000u, 400000u}) next[2 * i] ^= std::byte{1};
  auto r = round_trip(base, next, 2);
  EXPECT_EQ(r.kind, encoding::sparse);
  EXPECT_EQ(r.bytes, round_trip(base, next, 2, {.allow_zstd = false}).bytes);
  EXPECT_EQ(r.changed, 3u);
}

TEST(Delta, EverythingChangedFallsBackToFull) {
  auto base = random_bytes(1 << 16, 8);
  auto next = random_bytes(1 << 16, 9);
  auto r = round_trip(base, next, 2);
  EXPECT_EQ(r.kind, encoding::full);
  EXPECT_EQ(r.bytes, base.size());
}

TEST(Delta, EveryElementSizeAndOddLengths) {
  for (std::size_t elem : {1u, 2u, 4u, 8u}) {
    for (std::size_t n : {1u, 3u, 7u, 9u, 1001u}) {
      auto base = random_bytes(n * elem, static_cast<std::uint32_t>(n + elem));
      for (double f : {0.0, 0.05, 0.5, 1.0}) {
        auto next = perturb(base, elem, f, static_cast<std::uint32_t>(n * 7 + elem));
        round_trip(base, next, elem);
        round_trip(base, next, elem, {.allow_zstd = false});
      }
    }
  }
}

TEST(Delta, TheLastElementChangesInEveryForm) {
  auto base = random_bytes(2 * 1000, 10);
  auto next = base;
  next.back() ^= std::byte{0x80};
  EXPECT_EQ(round_trip(base, next, 2).changed, 1u);
  next = base;
  next.front() ^= std::byte{0x01};
  EXPECT_EQ(round_trip(base, next, 2).changed, 1u);
}

TEST(Delta, BadArgumentsAreInvalidArgument) {
  std::vector<std::byte> a(8), b(6), out;
  EXPECT_EQ(REFIT_THROWN(encode(a, b, 2, out)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(encode(a, a, 3, out)).kind(), errc::invalid_argument);
  std::vector<std::byte> o(6);
  EXPECT_EQ(REFIT_THROWN(decode(encoding::sparse, {}, a, o, 2)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(encoding_from_wire(5)).kind(), errc::protocol_error);
  EXPECT_EQ(encoding_from_wire(3), encoding::xor_zstd);
  EXPECT_EQ(encoding_from_wire(4), encoding::xor_planes);
}

// A corrupt payload: protocol_error, and `out` (the live base, in place) unchanged.
void expect_refused_untouched(encoding kind, std::vector<std::byte> payload, std::size_t n_bytes, const char* what) {
  auto base = random_bytes(n_bytes, 11);
  auto live = base;
  auto e = REFIT_THROWN(decode(kind, payload, live, live, 2));
  EXPECT_EQ(e.kind(), errc::protocol_error) << what;
  EXPECT_TRUE(live == base) << what << ": the target changed before the payload was refused";
}

TEST(Delta, CorruptSparseAndBitmapAreRefusedBeforeAByteChanges) {
  using B = std::byte;
  // sparse: gap 3 then a value, then a gap past the end of 8 elements.
  expect_refused_untouched(encoding::sparse, {B{3}, B{1}, B{2}, B{9}, B{1}, B{2}}, 16, "gap past the end");
  expect_refused_untouched(encoding::sparse, {B{1}, B{1}}, 16, "value cut short");
  expect_refused_untouched(encoding::sparse, {B{0x80}}, 16, "gap cut short");
  expect_refused_untouched(encoding::sparse, std::vector<B>(11, B{0xff}), 16, "gap over 64 bits");
  // bitmap: 8 elements -> one map byte.
  expect_refused_untouched(encoding::bitmap, {}, 16, "no map");
  expect_refused_untouched(encoding::bitmap, {B{0x03}, B{1}, B{2}}, 16, "2 marked, 1 value");
  expect_refused_untouched(encoding::bitmap, {B{0x01}, B{1}, B{2}, B{3}, B{4}}, 16, "1 marked, 2 values");
  // 5 elements: bits 5..7 of the map must be zero.
  expect_refused_untouched(encoding::bitmap, {B{0x20}, B{1}, B{2}}, 10, "bit past the end");
  expect_refused_untouched(encoding::full, {B{1}}, 16, "full of the wrong size");
}

TEST(Delta, CorruptZstdFramesAreRefused) {
  auto base = random_bytes(1 << 18, 12);
  auto next = perturb(base, 2, 0.1, 13);
  std::vector<std::byte> wire;
  auto r = encode(base, next, 2, wire, {.allow_planes = false});
  ASSERT_EQ(r.kind, encoding::xor_zstd);
  std::vector<std::byte> out(base.size());
  // Cut short, trailing bytes, a frame for another size, garbage.
  std::vector<std::byte> cut(wire.begin(), wire.begin() + static_cast<std::ptrdiff_t>(wire.size() / 2));
  EXPECT_EQ(REFIT_THROWN(decode(encoding::xor_zstd, cut, base, out, 2)).kind(), errc::protocol_error);
  auto trailing = wire;
  trailing.push_back(std::byte{0});
  EXPECT_EQ(REFIT_THROWN(decode(encoding::xor_zstd, trailing, base, out, 2)).kind(), errc::protocol_error);
  std::vector<std::byte> smaller_base(base.begin(), base.end() - 2), smaller_out(smaller_base.size());
  EXPECT_EQ(REFIT_THROWN(decode(encoding::xor_zstd, wire, smaller_base, smaller_out, 2)).kind(), errc::protocol_error);
  auto garbage = random_bytes(wire.size(), 14);
  EXPECT_EQ(REFIT_THROWN(decode(encoding::xor_zstd, garbage, base, out, 2)).kind(), errc::protocol_error);
  // The intact frame still decodes.
  decode(encoding::xor_zstd, wire, base, out, 2);
  EXPECT_TRUE(out == next);
}

TEST(Delta, CorruptXorPlanesAreRefused) {
  auto base = random_bytes(1 << 18, 15);
  auto next = perturb(base, 2, 0.1, 16);
  std::vector<std::byte> wire;
  ASSERT_EQ(encode(base, next, 2, wire).kind, encoding::xor_planes);
  std::vector<std::byte> out(base.size());
  auto refused = [&](const std::vector<std::byte>& payload, const std::vector<std::byte>& b, std::size_t elem,
                     const char* what) {
    std::vector<std::byte> o(b.size());
    EXPECT_EQ(REFIT_THROWN(decode(encoding::xor_planes, payload, b, o, elem)).kind(), errc::protocol_error) << what;
  };
  refused({}, base, 2, "no header");
  refused(std::vector<std::byte>(wire.begin(), wire.begin() + 20), base, 2, "header cut short");
  refused(std::vector<std::byte>(wire.begin(), wire.end() - 1), base, 2, "last frame cut short");
  auto trailing = wire;
  trailing.push_back(std::byte{0});
  refused(trailing, base, 2, "trailing byte");
  // Header: the changed count, then the frame sizes (bitmap, plane 0, plane 1).
  constexpr std::size_t header = 32;
  std::uint64_t fields[4];
  std::memcpy(fields, wire.data(), header);
  auto with = [&](std::size_t k, std::uint64_t v) {
    auto w = wire;
    std::memcpy(w.data() + 8 * k, &v, 8);
    return w;
  };
  refused(with(1, fields[1] + 1), base, 2, "frame sizes that do not add up");
  refused(with(0, fields[0] + 1), base, 2, "a count the bitmap does not mark");
  refused(with(0, fields[0] - 1), base, 2, "a bitmap marking more than the count");
  refused(with(0, base.size()), base, 2, "a count over the elements");
  std::vector<std::byte> smaller_base(base.begin(), base.end() - 16);  // 8 elements: one bitmap byte fewer
  refused(wire, smaller_base, 2, "a bitmap for another element count");
  refused(wire, base, 1, "1-byte elements");
  // The planes of another update (other changed elements, another count).
  std::vector<std::byte> other;
  ASSERT_EQ(encode(base, perturb(base, 2, 0.2, 17), 2, other).kind, encoding::xor_planes);
  std::uint64_t other_fields[4];
  std::memcpy(other_fields, other.data(), header);
  std::vector<std::byte> mixed(header);  // this one's count and bitmap, the other's planes
  const std::uint64_t mixed_fields[4] = {fields[0], fields[1], other_fields[2], other_fields[3]};
  std::memcpy(mixed.data(), mixed_fields, header);
  mixed.insert(mixed.end(), wire.begin() + header, wire.begin() + header + static_cast<std::ptrdiff_t>(fields[1]));
  mixed.insert(mixed.end(), other.begin() + header + static_cast<std::ptrdiff_t>(other_fields[1]), other.end());
  refused(mixed, base, 2, "planes of another count");
  auto garbage = random_bytes(wire.size(), 18);
  std::memcpy(garbage.data(), wire.data(), header);  // plausible sizes, garbage frames
  refused(garbage, base, 2, "garbage frames");
  // The intact payload still decodes.
  decode(encoding::xor_planes, wire, base, out, 2);
  EXPECT_TRUE(out == next);
}

// A bucket of pieces (several tensors, each in its own memory): one record per
// non-empty piece, decoded piece by piece in place or into other memory.
TEST(DeltaPieces, RoundTripOverPiecesOfMixedElementSizes) {
  const auto a = random_bytes(4096, 20), b = random_bytes(1000, 21), c = random_bytes(8192, 22);
  const auto a2 = perturb(a, 2, 0.01, 23), b2 = random_bytes(1000, 24), c2 = c;  // sparse, all new, unchanged
  const std::vector<piece_in> in{{a, a2, 2}, {{}, {}, 4}, {b, b2, 4}, {c, c2, 1}};
  std::vector<std::byte> wire;
  const auto r = encode_pieces(in, wire);
  EXPECT_EQ(r.bytes, wire.size());
  EXPECT_EQ(r.changed, count_changed(a, a2, 2) + count_changed(b, b2, 4));
  EXPECT_LT(wire.size(), 3 * piece_header_bytes + 1000 + a.size() / 4) << "the sparse and unchanged pieces are small";
  // In place.
  auto x = a, y = b, z = c;
  std::vector<piece_out> out{{x, x, 2}, {{}, {}, 4}, {y, y, 4}, {z, z, 1}};
  decode_pieces(wire, out);
  EXPECT_TRUE(x == a2 && y == b2 && z == c2);
  // From the base into other memory.
  std::vector<std::byte> x2(a.size()), y2(b.size()), z2(c.size());
  std::vector<piece_out> apart{{a, x2, 2}, {b, y2, 4}, {c, z2, 1}};
  decode_pieces(wire, apart);
  EXPECT_TRUE(x2 == a2 && y2 == b2 && z2 == c2);
}

TEST(DeltaPieces, CorruptRecordsAreProtocolErrors) {
  const auto a = random_bytes(512, 30), a2 = perturb(a, 2, 0.05, 31);
  const auto b = random_bytes(256, 32), b2 = perturb(b, 4, 0.05, 33);
  const std::vector<piece_in> in{{a, a2, 2}, {b, b2, 4}};
  std::vector<std::byte> wire;
  encode_pieces(in, wire);
  auto x = a, y = b;
  const std::vector<piece_out> out{{x, x, 2}, {y, y, 4}};
  auto cut = wire;
  cut.resize(wire.size() - 1);
  EXPECT_EQ(REFIT_THROWN(decode_pieces(cut, out)).kind(), errc::protocol_error);
  auto left_over = wire;
  left_over.push_back(std::byte{0});
  x = a, y = b;
  EXPECT_EQ(REFIT_THROWN(decode_pieces(left_over, out)).kind(), errc::protocol_error);
  auto unknown = wire;
  unknown[0] = std::byte{9};
  EXPECT_EQ(REFIT_THROWN(decode_pieces(unknown, out)).kind(), errc::protocol_error);
  auto too_long = wire;
  too_long[1] = std::byte{0xff};
  too_long[8] = std::byte{0x7f};
  EXPECT_EQ(REFIT_THROWN(decode_pieces(too_long, out)).kind(), errc::protocol_error);
  const std::vector<piece_out> one_missing{{x, x, 2}};  // more records than pieces
  x = a;
  EXPECT_EQ(REFIT_THROWN(decode_pieces(wire, one_missing)).kind(), errc::protocol_error);
  // The intact records still decode.
  x = a, y = b;
  decode_pieces(wire, out);
  EXPECT_TRUE(x == a2 && y == b2);
}

TEST(DeltaPieces, ElementSizeFallsBackToBytesOffBoundaries) {
  EXPECT_EQ(piece_elem(2, 64, 128), 2u);
  EXPECT_EQ(piece_elem(4, 2, 128), 1u);
  EXPECT_EQ(piece_elem(4, 0, 6), 1u);
  EXPECT_EQ(piece_elem(3, 0, 6), 1u);
}

}  // namespace
}  // namespace refit::backend::delta
