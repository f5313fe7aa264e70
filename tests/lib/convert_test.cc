// Tests of tests/support/convert against references that share no code with it: GCC's
// _Float16 (soft-float) for fp16, and tables built in double from each format's
// definition with brute-force nearest-value search (ties to even) for bf16 and fp8.
// 16-bit and 8-bit decoding is checked exhaustively; encoding over large strided
// samples of all 2^32 floats plus every halfway point between neighbours.
#include "tests/support/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "tests/lib/expect.h"

namespace refit::convert {
namespace {

using ::testing::HasSubstr;

#ifdef REFIT_SANITIZED  // --config=asan, --config=tsan
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif

// Strides (primes) over the 32-bit float patterns: ~20M values in the optimised
// build, fewer under sanitizers (exhaustive 8/16-bit coverage is kept there).
constexpr std::uint64_t wide_stride = sanitized ? 421 : 211;
constexpr std::uint64_t fp8_stride = sanitized ? 613 : 307;

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t b) { return std::bit_cast<float>(b); }

// "Same value": bit-identical, or both NaN with the same sign.
bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) && std::signbit(a) == std::signbit(b);
  return bits_of(a) == bits_of(b);
}

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Collects mismatches: the first few as test failures, all of them counted. The
// description is built only for a failure (the loops check tens of millions).
struct mismatches {
  std::uint64_t checked = 0, failed = 0;
  template <class Describe>
  void check(bool ok, Describe&& what) {
    ++checked;
    if (ok) [[likely]]
      return;
    if (++failed <= 10) ADD_FAILURE() << what();
  }
  ~mismatches() { EXPECT_EQ(failed, 0u) << "of " << checked << " checked"; }
};

// Calls f(float) for every float whose bits are begin + k * stride, below end.
template <class F>
std::uint64_t for_strided_floats(std::uint64_t stride, std::uint64_t begin, std::uint64_t end, F&& f) {
  std::uint64_t n = 0;
  for (std::uint64_t b = begin; b < end; b += stride, ++n) f(float_of(static_cast<std::uint32_t>(b)));
  return n;
}

// ---- the references

// Value of a magnitude code of a binary format with M mantissa bits and exponent
// `bias`, by the definition, treating every exponent as finite (so the code after
// the largest finite one is the next power of two: the IEEE overflow threshold's
// upper neighbour).
double definition_value(std::uint32_t code, int M, int bias) {
  const std::uint32_t e = code >> M, m = code & ((1u << M) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias - M);
  return std::ldexp(static_cast<double>((1u << M) | m), static_cast<int>(e) - bias - M);
}

// An IEEE-like 16-bit format (overflow to infinity): magnitudes of codes
// 0..inf_code, the last being 2^(emax+1).
struct ieee16 {
  int M, bias;
  std::uint16_t inf_code, nan_code;
  std::vector<double> mags;
  ieee16(int m, int b, std::uint16_t inf, std::uint16_t nan) : M(m), bias(b), inf_code(inf), nan_code(nan) {
    for (std::uint32_t c = 0; c <= inf; ++c) mags.push_back(definition_value(c, M, bias));
  }
  // Nearest by search over the sorted magnitudes, ties to the even code.
  std::uint16_t nearest(float x) const {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    if (std::isnan(x)) return sign | nan_code;
    const double a = std::fabs(static_cast<double>(x));
    auto it = std::upper_bound(mags.begin(), mags.end(), a);
    if (it == mags.end()) return sign | inf_code;  // >= 2^(emax+1), infinity included
    const auto hi = static_cast<std::uint16_t>(it - mags.begin());
    const std::uint16_t lo = hi - 1;               // mags[0] = 0 <= a, so hi >= 1
    const double mid = (mags[lo] + mags[hi]) / 2;  // exact: adjacent short significands
    std::uint16_t c = a < mid ? lo : a > mid ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | c;
  }
};

const ieee16& bf16_ref() {
  static const ieee16 f(7, 127, 0x7f80, 0x7fc0);
  return f;
}
const ieee16& fp16_ref() {
  static const ieee16 f(10, 15, 0x7c00, 0x7e00);
  return f;
}

// An fp8 format: all 256 values from the definition, and brute-force saturating
// nearest over the finite ones.
struct fp8_format {
  const char* name;
  int M, bias;
  std::uint8_t max_code, nan_code;
  double table[256];
  bool is_nan[256];

  std::uint8_t nearest(float x) const {
    const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return sign | nan_code;
    const double a = std::fabs(static_cast<double>(x));
    // Saturation; also keeps the distances below exact (x near the table).
    if (a >= table[max_code]) return sign | max_code;
    std::uint8_t best = 0;
    double best_d = a;  // distance to +0
    for (unsigned c = 1; c <= max_code; ++c) {
      // Exact distances: a and table[c] are within a few dozen binades of each
      // other whenever the comparison can matter.
      const double d = std::fabs(a - table[c]);
      if (d < best_d || (d == best_d && c % 2 == 0)) {
        best = static_cast<std::uint8_t>(c);
        best_d = d;
      }
      if (table[c] > a && d > best_d) break;  // sorted: only further away from here
    }
    return sign | best;
  }
};

fp8_format make_e4m3fn() {
  fp8_format f{"e4m3fn", 3, 7, 0x7e, 0x7f, {}, {}};
  for (unsigned c = 0; c < 256; ++c) {
    const unsigned mag = c & 0x7f;
    f.is_nan[c] = mag == 0x7f;  // S.1111.111 only: no infinities
    const double v = f.is_nan[c] ? NAN : definition_value(mag, 3, 7);
    f.table[c] = (c & 0x80) ? -v : v;
  }
  return f;
}

fp8_format make_e5m2() {
  fp8_format f{"e5m2", 2, 15, 0x7b, 0x7e, {}, {}};
  for (unsigned c = 0; c < 256; ++c) {
    const unsigned mag = c & 0x7f, e = mag >> 2, m = mag & 3;
    f.is_nan[c] = e == 31 && m != 0;
    const double v = e == 31 ? (m == 0 ? INFINITY : NAN) : definition_value(mag, 2, 15);
    f.table[c] = (c & 0x80) ? -v : v;
  }
  return f;
}

const fp8_format& e4m3fn() {
  static const fp8_format f = make_e4m3fn();
  return f;
}
const fp8_format& e5m2() {
  static const fp8_format f = make_e5m2();
  return f;
}

TEST(convert_reference, fp8_tables_match_the_format_definitions) {
  const fp8_format& a = e4m3fn();
  EXPECT_EQ(a.table[0x7e], 448.0);
  EXPECT_EQ(a.table[0x01], std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(a.table[0x08], std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(a.table[0x38], 1.0);
  EXPECT_EQ(std::count(a.is_nan, a.is_nan + 256, true), 2);
  const fp8_format& b = e5m2();
  EXPECT_EQ(b.table[0x7b], 57344.0);
  EXPECT_EQ(b.table[0x7c], INFINITY);
  EXPECT_EQ(b.table[0xfc], -INFINITY);
  EXPECT_EQ(b.table[0x01], std::ldexp(1.0, -16));
  EXPECT_EQ(b.table[0x04], std::ldexp(1.0, -14));
  EXPECT_EQ(b.table[0x3c], 1.0);
  EXPECT_EQ(std::count(b.is_nan, b.is_nan + 256, true), 6);
  for (const fp8_format* f : {&a, &b})
    for (unsigned c = 1; c <= f->max_code; ++c) EXPECT_LT(f->table[c - 1], f->table[c]);
  EXPECT_EQ(fp8_max(dtype::float8_e4m3fn), 448.0f);
  EXPECT_EQ(fp8_max(dtype::float8_e5m2), 57344.0f);
  EXPECT_EQ(fp8_max(dtype::float16), 0.0f);
  EXPECT_EQ(fp8_max(dtype::int8), 0.0f);
}

// ---- hand-checkable values (rounding edges a reader can verify)

TEST(convert_scalar, known_values) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(float_of(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(float_of(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(float_of(0x7f7f8000)), 0x7f80);  // max + half ulp -> inf
  EXPECT_EQ(float_to_bf16(float_of(0x7f7f7fff)), 0x7f7f);
  EXPECT_EQ(float_to_bf16(float_of(0x00000001)), 0x0000);  // float subnormal
  EXPECT_EQ(float_to_bf16(float_of(0x00018000)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(float_to_bf16(-NAN), 0xffc0);
  EXPECT_EQ(float_to_bf16(float_of(0x7f800001)), 0x7fc0);  // signalling NaN quieted

  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_fp16(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_fp16(0x1p-24f), 0x0001);
  EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000);  // tie with 0 -> 0
  EXPECT_EQ(float_to_fp16(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(float_to_fp16(0x3p-25f), 0x0002);      // 1.5 units -> 2
  EXPECT_EQ(float_to_fp16(0x1.ff8p-15f), 0x03ff);  // largest subnormal
  EXPECT_EQ(float_to_fp16(0x1.ffcp-15f), 0x0400);  // tie, carries into the normals
  EXPECT_EQ(float_to_fp16(std::nextafter(0x1.ffcp-15f, 0.0f)), 0x03ff);
  EXPECT_EQ(float_to_fp16(-1e-30f), 0x8000);
  EXPECT_EQ(float_to_fp16(NAN), 0x7e00);
  EXPECT_EQ(float_to_fp16(-NAN), 0xfe00);
  EXPECT_EQ(bits_of(fp16_to_float(0x7c01)), 0x7f802000u);  // payload kept, as documented
  EXPECT_EQ(bits_of(fp16_to_float(0xfe00)), 0xffc00000u);

  EXPECT_EQ(float_to_fp8_e4m3fn(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3fn(464.0f), 0x7e);  // would round to 480 (the NaN slot)
  EXPECT_EQ(float_to_fp8_e4m3fn(1e9f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3fn(INFINITY), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3fn(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3fn(NAN), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3fn(-NAN), 0xff);
  EXPECT_EQ(float_to_fp8_e4m3fn(0x1p-9f), 0x01);
  EXPECT_EQ(float_to_fp8_e4m3fn(0x1p-10f), 0x00);   // tie with 0 -> 0
  EXPECT_EQ(float_to_fp8_e4m3fn(0x3p-10f), 0x02);   // 1.5 units -> 2
  EXPECT_EQ(float_to_fp8_e4m3fn(0x1.ep-7f), 0x08);  // tie 7.5 units -> 8 = 2^-6
  EXPECT_EQ(float_to_fp8_e4m3fn(1.0625f), 0x38);    // tie -> 1.0
  EXPECT_EQ(float_to_fp8_e4m3fn(1.1875f), 0x3a);    // tie -> 1.25
  EXPECT_EQ(float_to_fp8_e4m3fn(-0.0f), 0x80);
  EXPECT_EQ(bits_of(fp8_e4m3fn_to_float(0xff)), 0xffc00000u);

  EXPECT_EQ(float_to_fp8_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(61440.0f), 0x7b);  // halfway to 65536: saturates
  EXPECT_EQ(float_to_fp8_e5m2(INFINITY), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(-INFINITY), 0xfb);
  EXPECT_EQ(float_to_fp8_e5m2(NAN), 0x7e);
  EXPECT_EQ(float_to_fp8_e5m2(-NAN), 0xfe);
  EXPECT_EQ(float_to_fp8_e5m2(0x1p-16f), 0x01);
  EXPECT_EQ(float_to_fp8_e5m2(0x1p-17f), 0x00);
  EXPECT_EQ(float_to_fp8_e5m2(0x3p-17f), 0x02);
  EXPECT_EQ(fp8_e5m2_to_float(0x7c), INFINITY);
  EXPECT_EQ(fp8_e5m2_to_float(0xfc), -INFINITY);
}

// ---- fp16 against _Float16

// The compiler's own fp16 (_Float16) as the reference where it has one: GCC 12 on
// x86-64. clang 14 there has none (the ASan build uses it): the format's definition
// and the nearest-code search above stand in.
float reference_fp16_decode(std::uint16_t b) {
#ifdef __FLT16_MANT_DIG__
  return static_cast<float>(std::bit_cast<_Float16>(b));
#else
  const float sign = (b & 0x8000) ? -1.0f : 1.0f;
  if ((b & 0x7c00) == 0x7c00) return std::copysign((b & 0x3ff) ? NAN : INFINITY, sign);
  return sign * static_cast<float>(definition_value(b & 0x7fff, 10, 15));
#endif
}
std::uint16_t reference_fp16_encode(float x) {
#ifdef __FLT16_MANT_DIG__
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
#else
  return fp16_ref().nearest(x);
#endif
}

TEST(convert_fp16, decodes_all_65536_patterns_like_float16) {
  mismatches m;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float want = reference_fp16_decode(static_cast<std::uint16_t>(b));
    const float got = fp16_to_float(static_cast<std::uint16_t>(b));
    m.check(same_float(got, want),
            [&] { return "fp16 " + hex(b) + ": got " + hex(bits_of(got)) + ", _Float16 gives " + hex(bits_of(want)); });
    // And by the definition, for the finite ones.
    if ((b & 0x7c00) != 0x7c00) {
      const double v = definition_value(b & 0x7fff, 10, 15);
      m.check(static_cast<double>(got) == ((b & 0x8000) ? -v : v), [&] { return "fp16 definition " + hex(b); });
    }
  }
  EXPECT_EQ(m.checked, 65536u + 63488u);
}

void check_fp16_encode(mismatches& m, float x) {
  const std::uint16_t got = float_to_fp16(x);
  if (std::isnan(x)) {
    m.check(got == (std::signbit(x) ? 0xfe00 : 0x7e00), [&] { return "fp16 NaN " + hex(bits_of(x)); });
    return;
  }
  const std::uint16_t want = reference_fp16_encode(x);
  m.check(got == want,
          [&] { return "float " + hex(bits_of(x)) + " -> fp16: got " + hex(got) + ", _Float16 gives " + hex(want); });
}

TEST(convert_fp16, encodes_a_stride_of_all_floats_like_float16) {
  mismatches m;
  const std::uint64_t n =
      for_strided_floats(wide_stride, 0x1234, 1ull << 32, [&](float x) { check_fp16_encode(m, x); });
  std::printf("fp16 encode: %llu strided floats\n", static_cast<unsigned long long>(n));
}

TEST(convert_fp16, encodes_every_halfway_point_and_its_neighbours) {
  mismatches m;
  const ieee16& ref = fp16_ref();
  // Pairs of adjacent magnitudes, up to (65504, 65536): the overflow threshold.
  for (std::uint32_t c = 0; c < 0x7c00; ++c) {
    const float mid = static_cast<float>((ref.mags[c] + ref.mags[c + 1]) / 2);
    ASSERT_EQ(static_cast<double>(mid), (ref.mags[c] + ref.mags[c + 1]) / 2);  // exact
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)})
      for (float s : {x, -x}) {
        check_fp16_encode(m, s);
        m.check(float_to_fp16(s) == ref.nearest(s), [&] { return "fp16 reference " + hex(bits_of(s)); });
      }
  }
  EXPECT_EQ(m.checked, 0x7c00u * 12);
}

TEST(convert_fp16, encodes_specials) {
  mismatches m;
  for (float x :
       {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
        std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()})
    check_fp16_encode(m, x);
  // NaNs of every payload bit, both signs, quiet and signalling: always canonical.
  for (std::uint32_t p = 1; p < (1u << 23); p = p * 3 + 1)
    for (std::uint32_t s : {0u, 0x80000000u}) check_fp16_encode(m, float_of(s | 0x7f800000u | p));
}

TEST(convert_fp16, round_trips_every_value) {
  mismatches m;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const std::uint16_t back = float_to_fp16(fp16_to_float(h));
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    m.check(back == (nan ? ((h & 0x8000) | 0x7e00) : h), [&] { return "fp16 round trip " + hex(b); });
  }
}

// ---- bf16

TEST(convert_bf16, decodes_all_65536_patterns_by_definition) {
  mismatches m;
  for (std::uint32_t b = 0; b < 0x10000; ++b)
    m.check(bits_of(bf16_to_float(static_cast<std::uint16_t>(b))) == b << 16, [&] { return "bf16 " + hex(b); });
}

void check_bf16_encode(mismatches& m, float x) {
  const std::uint16_t got = float_to_bf16(x), want = bf16_ref().nearest(x);
  m.check(got == want,
          [&] { return "float " + hex(bits_of(x)) + " -> bf16: got " + hex(got) + ", nearest is " + hex(want); });
}

TEST(convert_bf16, encodes_a_stride_of_all_floats_to_the_nearest) {
  mismatches m;
  const std::uint64_t n = for_strided_floats(wide_stride, 0x777, 1ull << 32, [&](float x) { check_bf16_encode(m, x); });
  std::printf("bf16 encode: %llu strided floats\n", static_cast<unsigned long long>(n));
}

TEST(convert_bf16, encodes_every_halfway_point_and_its_neighbours) {
  mismatches m;
  const ieee16& ref = bf16_ref();
  for (std::uint32_t c = 0; c < 0x7f80; ++c) {
    const float mid = static_cast<float>((ref.mags[c] + ref.mags[c + 1]) / 2);
    ASSERT_EQ(static_cast<double>(mid), (ref.mags[c] + ref.mags[c + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)})
      for (float s : {x, -x}) check_bf16_encode(m, s);
  }
  for (float x : {0.0f, -0.0f, INFINITY, -INFINITY}) check_bf16_encode(m, x);
  for (std::uint32_t p = 1; p < (1u << 23); p = p * 3 + 1)
    for (std::uint32_t s : {0u, 0x80000000u}) check_bf16_encode(m, float_of(s | 0x7f800000u | p));
}

// ---- fp8

std::uint8_t encode(const fp8_format& f, float x) {
  return f.max_code == 0x7e ? float_to_fp8_e4m3fn(x) : float_to_fp8_e5m2(x);
}
float decode(const fp8_format& f, std::uint8_t b) {
  return f.max_code == 0x7e ? fp8_e4m3fn_to_float(b) : fp8_e5m2_to_float(b);
}

class convert_fp8 : public ::testing::TestWithParam<const fp8_format*> {
 protected:
  const fp8_format& f() const { return *GetParam(); }
  void check_encode(mismatches& m, float x) const {
    const std::uint8_t got = encode(f(), x), want = f().nearest(x);
    m.check(got == want, [&] {
      return std::string(f().name) + ": float " + hex(bits_of(x)) + " (" + std::to_string(x) + ") -> got " + hex(got) +
             ", nearest is " + hex(want);
    });
  }
};

TEST_P(convert_fp8, decodes_all_256_patterns_by_definition) {
  mismatches m;
  for (unsigned b = 0; b < 256; ++b) {
    const float got = decode(f(), static_cast<std::uint8_t>(b));
    if (f().is_nan[b]) {
      m.check(std::isnan(got) && std::signbit(got) == (b >= 0x80), [&] { return "NaN " + hex(b); });
    } else {
      m.check(static_cast<double>(got) == f().table[b] && std::signbit(got) == (b >= 0x80),
              [&] { return std::string(f().name) + " " + hex(b) + " decodes to " + std::to_string(got); });
    }
  }
  EXPECT_EQ(m.checked, 256u);
}

TEST_P(convert_fp8, encodes_every_value_midpoint_and_neighbour) {
  mismatches m;
  for (unsigned c = 0; c <= f().max_code; ++c) {
    const float v = static_cast<float>(f().table[c]);
    std::vector<float> xs{v, std::nextafter(v, 0.0f), std::nextafter(v, INFINITY)};
    if (c < f().max_code) {
      const double mid_d = (f().table[c] + f().table[c + 1]) / 2;
      const float mid = static_cast<float>(mid_d);
      EXPECT_EQ(static_cast<double>(mid), mid_d);
      xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)});
      // Ties go to the even code: the lower one when c is even.
      EXPECT_EQ(encode(f(), mid), c % 2 == 0 ? c : c + 1) << f().name << " mid after " << c;
    }
    for (float x : xs)
      for (float s : {x, -x}) check_encode(m, s);
  }
  // Every value decodes and re-encodes to itself (NaNs to the canonical NaN).
  for (unsigned b = 0; b < 256; ++b) {
    const std::uint8_t back = encode(f(), decode(f(), static_cast<std::uint8_t>(b)));
    std::uint8_t want = static_cast<std::uint8_t>(b);
    if (f().is_nan[b]) want = (b & 0x80) | f().nan_code;
    if (std::isinf(f().table[b])) want = (b & 0x80) | f().max_code;  // saturates
    m.check(back == want, [&] { return std::string(f().name) + " round trip " + hex(b); });
  }
}

TEST_P(convert_fp8, saturates_overflow_and_infinities_and_keeps_nan_and_zero_signs) {
  const float max = fp8_max(f().max_code == 0x7e ? dtype::float8_e4m3fn : dtype::float8_e5m2);
  EXPECT_EQ(static_cast<double>(max), f().table[f().max_code]);
  mismatches m;
  for (float x : {max, std::nextafter(max, INFINITY), max * 1.03125f, max * 1.0625f, max * 1.125f, max * 2, 1e10f,
                  1e30f, std::numeric_limits<float>::max(), INFINITY}) {
    m.check(encode(f(), x) == f().max_code, [&] { return std::string(f().name) + " " + std::to_string(x); });
    m.check(encode(f(), -x) == (0x80 | f().max_code), [&] { return std::string(f().name) + " -" + std::to_string(x); });
    check_encode(m, x);
    check_encode(m, -x);
  }
  for (std::uint32_t p = 1; p < (1u << 23); p = p * 3 + 1)
    for (std::uint32_t s : {0u, 0x80000000u}) {
      const std::uint8_t got = encode(f(), float_of(s | 0x7f800000u | p));
      m.check(got == ((s ? 0x80 : 0) | f().nan_code), [&] { return std::string(f().name) + " NaN " + hex(p); });
    }
  EXPECT_EQ(encode(f(), 0.0f), 0x00);
  EXPECT_EQ(encode(f(), -0.0f), 0x80);
  EXPECT_EQ(encode(f(), -std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(encode(f(), -std::numeric_limits<float>::min()), 0x80);
}

TEST_P(convert_fp8, encodes_subnormal_range_densely) {
  // Every float from below half the smallest subnormal up to twice the smallest
  // normal, on a fine stride (about 2^19 values per sign).
  mismatches m;
  const float lo = static_cast<float>(f().table[1] / 4);
  const float hi = static_cast<float>(f().table[(1u << f().M)] * 2);  // code 1<<M: smallest normal
  const std::uint64_t stride = sanitized ? 61 : 31;
  for_strided_floats(stride, bits_of(lo), bits_of(hi), [&](float x) {
    check_encode(m, x);
    check_encode(m, -x);
  });
  EXPECT_GT(m.checked, sanitized ? 100000u : 500000u);
}

TEST_P(convert_fp8, encodes_strided_samples_of_all_floats_and_the_fp8_range) {
  mismatches m;
  std::uint64_t n = for_strided_floats(fp8_stride, 0x55, 1ull << 32, [&](float x) { check_encode(m, x); });
  // Denser over the magnitudes fp8 represents: 2^-24 .. 2^17.
  const std::uint64_t dense = sanitized ? 127 : 61;
  n += for_strided_floats(dense, bits_of(0x1p-24f), bits_of(0x1p17f), [&](float x) {
    check_encode(m, x);
    check_encode(m, -x);
  });
  std::printf("%s encode: %llu sampled floats (+ negated dense part), %llu checks\n", f().name,
              static_cast<unsigned long long>(n), static_cast<unsigned long long>(m.checked));
}

INSTANTIATE_TEST_SUITE_P(formats, convert_fp8, ::testing::Values(&e4m3fn(), &e5m2()),
                         [](const auto& info) { return std::string(info.param->name); });

// ---- tensors

constexpr dtype all_dtypes[] = {dtype::bool_,   dtype::uint8,   dtype::int8,          dtype::int16,
                                dtype::int32,   dtype::int64,   dtype::float16,       dtype::bfloat16,
                                dtype::float32, dtype::float64, dtype::float8_e4m3fn, dtype::float8_e5m2};
constexpr dtype wide[] = {dtype::float32, dtype::bfloat16, dtype::float16};
constexpr dtype fp8s[] = {dtype::float8_e4m3fn, dtype::float8_e5m2};

bool in(dtype t, std::initializer_list<dtype> set) { return std::find(set.begin(), set.end(), t) != set.end(); }

TEST(convert_tensor, supported_pairs) {
  for (dtype s : all_dtypes)
    for (dtype d : all_dtypes) {
      const bool wide_dst = in(d, {dtype::float32, dtype::bfloat16, dtype::float16});
      const bool wide_src = in(s, {dtype::float32, dtype::bfloat16, dtype::float16});
      const bool fp8_src = in(s, {dtype::float8_e4m3fn, dtype::float8_e5m2});
      const bool fp8_dst = in(d, {dtype::float8_e4m3fn, dtype::float8_e5m2});
      EXPECT_EQ(can_convert(s, d), wide_dst && (wide_src || fp8_src)) << to_string(s) << " -> " << to_string(d);
      EXPECT_EQ(can_quantize(s, d), wide_src && fp8_dst) << to_string(s) << " -> " << to_string(d);
    }
}

// Scalar decode/encode per dtype, for the element-wise expectations.
float decode_element(dtype t, const std::byte* p) {
  std::uint32_t v = 0;
  std::memcpy(&v, p, element_size(t));
  switch (t) {
    case dtype::float32:
      return float_of(v);
    case dtype::bfloat16:
      return bf16_to_float(static_cast<std::uint16_t>(v));
    case dtype::float16:
      return fp16_to_float(static_cast<std::uint16_t>(v));
    case dtype::float8_e4m3fn:
      return fp8_e4m3fn_to_float(static_cast<std::uint8_t>(v));
    case dtype::float8_e5m2:
      return fp8_e5m2_to_float(static_cast<std::uint8_t>(v));
    default:
      ADD_FAILURE() << "no decode for " << to_string(t);
      return 0;
  }
}
void encode_element(dtype t, float x, std::byte* p) {
  std::uint32_t v = 0;
  switch (t) {
    case dtype::float32:
      v = bits_of(x);
      break;
    case dtype::bfloat16:
      v = float_to_bf16(x);
      break;
    case dtype::float16:
      v = float_to_fp16(x);
      break;
    case dtype::float8_e4m3fn:
      v = float_to_fp8_e4m3fn(x);
      break;
    case dtype::float8_e5m2:
      v = float_to_fp8_e5m2(x);
      break;
    default:
      ADD_FAILURE() << "no encode for " << to_string(t);
      break;
  }
  std::memcpy(p, &v, element_size(t));
}

// Source elements: every pattern of the 8- and 16-bit types; for float32, specials,
// NaN payloads, the fp16/bf16 overflow edges and a stride of all floats (~100k).
std::vector<std::byte> source_bytes(dtype t) {
  std::vector<std::uint32_t> values;
  if (t == dtype::float32) {
    for (std::uint32_t b :
         {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fbfffffu,
          0xff812345u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0x477ff000u, 0x477fefffu, 0x7f7f8000u})
      values.push_back(b);
    for (std::uint64_t b = 3; b < (1ull << 32); b += 42953) values.push_back(static_cast<std::uint32_t>(b));
  } else {
    const std::uint32_t n = element_size(t) == 2 ? 0x10000 : 0x100;
    for (std::uint32_t b = 0; b < n; ++b) values.push_back(b);
  }
  const std::size_t size = element_size(t);
  std::vector<std::byte> out(values.size() * size);
  for (std::size_t i = 0; i < values.size(); ++i) std::memcpy(&out[i * size], &values[i], size);
  return out;
}

// A buffer whose data starts one byte past an aligned address, so element accesses
// that assumed alignment would be caught (UBSan) rather than pass by luck.
struct unaligned_buffer {
  std::vector<std::byte> storage;
  std::vector<std::int64_t> shape;
  explicit unaligned_buffer(std::size_t bytes, std::int64_t numel)
      : storage(bytes + 1, std::byte{0xa5}), shape{numel} {}
  std::byte* data() { return storage.data() + 1; }
};

void check_conversion(dtype s, dtype d, float scale) {
  const std::vector<std::byte> src_bytes = source_bytes(s);
  const std::size_t n = src_bytes.size() / element_size(s);
  unaligned_buffer src(src_bytes.size(), static_cast<std::int64_t>(n));
  std::memcpy(src.data(), src_bytes.data(), src_bytes.size());
  unaligned_buffer dst(n * element_size(d), static_cast<std::int64_t>(n));
  const tensor_view sv("w", s, src.shape, src.data()), dv("out", d, dst.shape, dst.data());
  const bool fp8_src = in(s, {dtype::float8_e4m3fn, dtype::float8_e5m2});
  const bool fp8_dst = in(d, {dtype::float8_e4m3fn, dtype::float8_e5m2});
  if (fp8_dst)
    quantize_fp8(sv, dv, scale);
  else
    convert_tensor(sv, dv, scale);
  std::vector<std::byte> want(element_size(d));
  std::uint64_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::byte* in_p = src.data() + i * element_size(s);
    if (s == d) {
      std::memcpy(want.data(), in_p, want.size());  // a copy keeps every bit
    } else {
      float x = decode_element(s, in_p);
      if (fp8_dst)
        x /= scale;  // quantise
      else if (fp8_src)
        x *= scale;  // dequantise
      encode_element(d, x, want.data());
    }
    if (std::memcmp(want.data(), dst.data() + i * element_size(d), want.size()) != 0 && ++bad <= 5)
      ADD_FAILURE() << to_string(s) << " -> " << to_string(d) << " scale " << scale << ": element " << i << " differs";
  }
  EXPECT_EQ(bad, 0u) << to_string(s) << " -> " << to_string(d) << " over " << n << " elements";
  EXPECT_EQ(dst.storage[0], std::byte{0xa5}) << "wrote before the tensor";
}

TEST(convert_tensor, every_pair_matches_the_scalar_conversions) {
  for (dtype s : wide)
    for (dtype d : wide) check_conversion(s, d, 1.0f);
  for (dtype s : fp8s)
    for (dtype d : wide)
      for (float scale : {1.0f, 0.37f, 3.0f, 1e-6f, 1e6f}) check_conversion(s, d, scale);
}

TEST(quantize_fp8, every_pair_matches_the_scalar_conversions) {
  for (dtype s : wide)
    for (dtype d : fp8s)
      for (float scale : {1.0f, 0.5f, 3.7e-3f, 1e4f, 1e-30f}) check_conversion(s, d, scale);
}

// The contract is one float division, x / scale, not x * (1 / scale): the two differ
// by an ulp, which matters when the quotient lands next to an fp8 midpoint. Inputs
// whose quotient is at or beside every midpoint tell them apart.
TEST(quantize_fp8, divides_by_the_scale) {
  for (dtype q : fp8s) {
    const fp8_format& f = q == dtype::float8_e4m3fn ? e4m3fn() : e5m2();
    std::size_t reciprocal_differs = 0;
    for (float scale : {3.7e-3f, 0.37f, 7.1f, 1.1e3f, 0.3f, 0.7f}) {
      std::vector<float> x;
      for (unsigned c = 0; c < f.max_code; ++c) {
        const float near = static_cast<float>((f.table[c] + f.table[c + 1]) / 2 * scale);
        float v = near;
        for (int k = 0; k < 3; ++k) v = std::nextafter(v, 0.0f);
        for (int k = 0; k < 7; ++k, v = std::nextafter(v, INFINITY)) x.push_back(v);
      }
      const std::vector<std::int64_t> shape{static_cast<std::int64_t>(x.size())};
      std::vector<std::uint8_t> codes(x.size());
      quantize_fp8(tensor_view("x", dtype::float32, shape, x.data()), tensor_view("q", q, shape, codes.data()), scale);
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(codes[i], f.nearest(x[i] / scale)) << to_string(q) << " x=" << x[i];
        reciprocal_differs += f.nearest(x[i] * (1.0f / scale)) != codes[i];
      }
    }
    EXPECT_GT(reciprocal_differs, 0u) << "inputs do not tell division from reciprocal";
  }
}

TEST(convert_tensor, same_type_copy_keeps_nan_payloads) {
  std::vector<std::uint16_t> src{0x7f81, 0xffff, 0x7c01, 0x3c00}, dst(4);
  const std::vector<std::int64_t> shape{2, 2}, flat{4};
  for (dtype t : {dtype::bfloat16, dtype::float16}) {
    convert_tensor(tensor_view("a", t, shape, src.data()), tensor_view("b", t, flat, dst.data()));
    EXPECT_EQ(dst, src) << to_string(t);
  }
}

TEST(convert_tensor, empty_tensors_convert_without_data) {
  const std::vector<std::int64_t> shape{0, 3};
  convert_tensor(tensor_view("a", dtype::float32, shape, nullptr), tensor_view("b", dtype::bfloat16, shape, nullptr));
  quantize_fp8(tensor_view("a", dtype::float32, shape, nullptr), tensor_view("b", dtype::float8_e4m3fn, shape, nullptr),
               2.0f);
  EXPECT_EQ(fp8_scale(tensor_view("a", dtype::float32, shape, nullptr), dtype::float8_e4m3fn), 1.0f);
}

// The error names both tensors, says what is wrong, and leaves dst untouched.
void expect_refused(const std::function<void()>& f, const std::string& why, const std::vector<std::byte>& dst_before,
                    const std::vector<std::byte>& dst) {
  auto e = REFIT_THROWN(f());
  EXPECT_EQ(e.kind(), errc::invalid_argument) << e.what();
  EXPECT_THAT(e.message(), HasSubstr("'layer.weight'"));
  EXPECT_THAT(e.message(), HasSubstr("'staging.out'"));
  EXPECT_THAT(e.message(), HasSubstr(why));
  EXPECT_EQ(dst, dst_before) << "dst written despite the error: " << e.message();
}

TEST(convert_tensor, refuses_bad_arguments_naming_both_tensors) {
  std::vector<std::byte> src(64, std::byte{0x3c}), dst(64, std::byte{0x11});
  const std::vector<std::byte> before = dst;
  const std::vector<std::int64_t> four{4}, five{5}, two_by_two{2, 2};
  using shape_t = std::span<const std::int64_t>;
  auto s = [&](dtype t, shape_t shape, device dev = {}) {
    return tensor_view("layer.weight", t, shape, src.data(), dev);
  };
  auto d = [&](dtype t, shape_t shape, device dev = {}) {
    return tensor_view("staging.out", t, shape, dst.data(), dev);
  };
  // Count mismatch (also 2x2 against 4 is fine).
  EXPECT_NO_THROW(convert_tensor(s(dtype::float16, two_by_two), d(dtype::float32, four)));
  dst = before;
  expect_refused([&] { convert_tensor(s(dtype::float16, five), d(dtype::float32, four)); },
                 "element counts differ: 5 vs 4", before, dst);
  // Unsupported pairs, including float -> fp8 (that is quantize_fp8) and fp8 -> fp8.
  for (const auto& pair : {std::pair{dtype::int32, dtype::float32},
                           {dtype::float32, dtype::int32},
                           {dtype::float32, dtype::float8_e4m3fn},
                           {dtype::bfloat16, dtype::float8_e5m2},
                           {dtype::float8_e4m3fn, dtype::float8_e5m2},
                           {dtype::float64, dtype::float32},
                           {dtype::float32, dtype::float64},
                           {dtype::uint8, dtype::float16}}) {
    const auto [a, b] = pair;
    expect_refused([&, a = a, b = b] { convert_tensor(s(a, four), d(b, four)); }, "unsupported dtype pair", before,
                   dst);
  }
  // A device tensor on either side.
  expect_refused([&] { convert_tensor(s(dtype::float32, four, device::cuda(0)), d(dtype::float16, four)); },
                 "host memory", before, dst);
  expect_refused([&] { convert_tensor(s(dtype::float32, four), d(dtype::float16, four, device::cuda(1))); },
                 "host memory", before, dst);
  // A scale for a non-fp8 source.
  for (float scale : {2.0f, 0.0f, -1.0f, NAN, INFINITY})
    expect_refused([&] { convert_tensor(s(dtype::bfloat16, four), d(dtype::float32, four), scale); },
                   "a scale applies to fp8 sources only", before, dst);
  // A bad scale for an fp8 source.
  for (float scale : {0.0f, -0.0f, -2.0f, NAN, INFINITY, -INFINITY})
    expect_refused([&] { convert_tensor(s(dtype::float8_e4m3fn, four), d(dtype::float32, four), scale); },
                   "must be finite and > 0", before, dst);
  // Overlap.
  expect_refused(
      [&] {
        convert_tensor(s(dtype::float32, four), tensor_view("staging.out", dtype::bfloat16, four, src.data() + 8));
      },
      "overlap", before, dst);
  // A null pointer with elements.
  expect_refused(
      [&] { convert_tensor(s(dtype::float32, four), tensor_view("staging.out", dtype::bfloat16, four, nullptr)); },
      "null data pointer", before, dst);
}

TEST(quantize_fp8, refuses_bad_arguments_naming_both_tensors) {
  std::vector<std::byte> src(64, std::byte{0x3c}), dst(64, std::byte{0x11});
  const std::vector<std::byte> before = dst;
  const std::vector<std::int64_t> four{4}, three{3};
  using shape_t = std::span<const std::int64_t>;
  auto s = [&](dtype t, shape_t shape, device dev = {}) {
    return tensor_view("layer.weight", t, shape, src.data(), dev);
  };
  auto d = [&](dtype t, shape_t shape, device dev = {}) {
    return tensor_view("staging.out", t, shape, dst.data(), dev);
  };
  for (float scale : {0.0f, -1.0f, NAN, INFINITY})
    expect_refused([&] { quantize_fp8(s(dtype::float32, four), d(dtype::float8_e4m3fn, four), scale); },
                   "must be finite and > 0", before, dst);
  for (const auto& pair : {std::pair{dtype::float32, dtype::float16},
                           {dtype::float8_e4m3fn, dtype::float8_e5m2},
                           {dtype::int8, dtype::float8_e4m3fn},
                           {dtype::float64, dtype::float8_e5m2},
                           {dtype::float16, dtype::uint8}}) {
    const auto [a, b] = pair;
    expect_refused([&, a = a, b = b] { quantize_fp8(s(a, four), d(b, four), 1.0f); }, "unsupported dtype pair", before,
                   dst);
  }
  expect_refused([&] { quantize_fp8(s(dtype::float32, three), d(dtype::float8_e5m2, four), 1.0f); },
                 "element counts differ: 3 vs 4", before, dst);
  expect_refused([&] { quantize_fp8(s(dtype::float32, four, device::cuda(0)), d(dtype::float8_e5m2, four), 1.0f); },
                 "host memory", before, dst);
}

// ---- per-tensor scales

std::vector<float> pseudo_random(std::size_t n, std::uint64_t seed) {
  std::vector<float> out(n);
  for (float& x : out) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(seed >> 11) * 0x1p-53;  // [0, 1)
    // Magnitudes over 2^-20 .. 1, both signs.
    x = static_cast<float>(std::ldexp(0.5 + u / 2, -static_cast<int>((seed >> 3) % 21)) * ((seed & 1) ? -1 : 1));
  }
  return out;
}

TEST(fp8_scale, maps_amax_onto_the_largest_value_and_round_trips_within_half_a_step) {
  for (dtype q : fp8s) {
    const fp8_format& f = q == dtype::float8_e4m3fn ? e4m3fn() : e5m2();
    const double max = f.table[f.max_code];
    const double sub_step = f.table[1];
    for (float magnitude : {1e-30f, 1e-3f, 1.0f, 3.0e4f, 1e30f}) {
      std::vector<float> x = pseudo_random(4096, 42);
      for (float& v : x) v *= magnitude;
      const std::size_t at = 1234;
      x[at] = -1.5f * magnitude;  // the amax, negative
      const std::vector<std::int64_t> shape{static_cast<std::int64_t>(x.size())};
      const tensor_view xv("x", dtype::float32, shape, x.data());
      const float scale = fp8_scale(xv, q);
      EXPECT_EQ(scale, 1.5f * magnitude / static_cast<float>(max));
      std::vector<std::uint8_t> codes(x.size());
      quantize_fp8(xv, tensor_view("q", q, shape, codes.data()), scale);
      EXPECT_EQ(codes[at], 0x80 | f.max_code) << to_string(q) << " magnitude " << magnitude;
      std::vector<float> back(x.size());
      convert_tensor(tensor_view("q", q, shape, codes.data()), tensor_view("back", dtype::float32, shape, back.data()),
                     scale);
      double worst = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_FALSE(f.is_nan[codes[i]]);
        // Half a step of the fp8 grid around x / scale, in x's units, plus the two
        // float roundings (division and dequantising product).
        const double y = std::fabs(static_cast<double>(x[i])) / scale;
        const double half_step = std::max(y * std::ldexp(1.0, -(f.M + 1)), sub_step / 2);
        const double bound = half_step * scale * (1 + 1e-6) + std::fabs(x[i]) * 0x1p-22;
        const double err = std::fabs(static_cast<double>(back[i]) - x[i]);
        worst = std::max(worst, err / bound);
        ASSERT_LE(err, bound) << to_string(q) << " x=" << x[i] << " back=" << back[i];
      }
      EXPECT_LE(worst, 1.0);
    }
  }
}

TEST(fp8_scale, zeros_nans_infinities_and_tiny_values) {
  const std::vector<std::int64_t> four{4};
  auto scale_of = [&](std::vector<float> x, dtype q = dtype::float8_e4m3fn) {
    return fp8_scale(tensor_view("x", dtype::float32, four, x.data()), q);
  };
  EXPECT_EQ(scale_of({0.0f, -0.0f, 0.0f, 0.0f}), 1.0f);
  EXPECT_EQ(scale_of({NAN, -NAN, NAN, NAN}), 1.0f);
  EXPECT_EQ(scale_of({NAN, -896.0f, 2.0f, NAN}), 2.0f);  // NaNs ignored
  EXPECT_EQ(scale_of({NAN, 1.0f, -57344.0f, NAN}, dtype::float8_e5m2), 1.0f);
  // An infinity: an infinite scale, which quantize_fp8 refuses.
  std::vector<float> x{1.0f, -INFINITY, 2.0f, NAN};
  const float inf_scale = fp8_scale(tensor_view("x", dtype::float32, four, x.data()), dtype::float8_e4m3fn);
  EXPECT_TRUE(std::isinf(inf_scale) && inf_scale > 0);
  std::vector<std::uint8_t> q(4);
  auto e = REFIT_THROWN(quantize_fp8(tensor_view("x", dtype::float32, four, x.data()),
                                     tensor_view("q", dtype::float8_e4m3fn, four, q.data()), inf_scale));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  // Tiny float32 amax: amax / 448 underflows; the scale stays positive and usable.
  for (float tiny : {std::numeric_limits<float>::denorm_min(), 0x1p-140f, 0x1p-130f}) {
    std::vector<float> t{tiny, -tiny / 2, 0.0f, tiny};
    const float s = fp8_scale(tensor_view("t", dtype::float32, four, t.data()), dtype::float8_e4m3fn);
    EXPECT_TRUE(std::isfinite(s) && s > 0) << tiny;
    EXPECT_NO_THROW(quantize_fp8(tensor_view("t", dtype::float32, four, t.data()),
                                 tensor_view("q", dtype::float8_e4m3fn, four, q.data()), s));
    EXPECT_FALSE(e4m3fn().is_nan[q[0]]);
    EXPECT_NE(q[0], 0) << tiny;
  }
}

TEST(fp8_scale, reads_16_bit_sources) {
  // Every bf16 / fp16 pattern: amax is the largest finite (fp16) or infinite; over the
  // finite ones it is the format's largest value.
  std::vector<std::uint16_t> all(0x10000);
  for (std::uint32_t b = 0; b < all.size(); ++b) all[b] = static_cast<std::uint16_t>(b);
  const std::vector<std::int64_t> shape{0x10000};
  EXPECT_TRUE(std::isinf(fp8_scale(tensor_view("h", dtype::float16, shape, all.data()), dtype::float8_e4m3fn)));
  std::vector<std::uint16_t> finite;
  for (std::uint16_t b : all)
    if ((b & 0x7c00) != 0x7c00) finite.push_back(b);
  const std::vector<std::int64_t> fshape{static_cast<std::int64_t>(finite.size())};
  EXPECT_EQ(fp8_scale(tensor_view("h", dtype::float16, fshape, finite.data()), dtype::float8_e4m3fn),
            65504.0f / 448.0f);
  std::vector<std::uint16_t> bf{0x3f80, 0xc040, 0x7fc0, 0x0001};  // 1, -3, NaN, tiny
  const std::vector<std::int64_t> four{4};
  EXPECT_EQ(fp8_scale(tensor_view("b", dtype::bfloat16, four, bf.data()), dtype::float8_e5m2), 3.0f / 57344.0f);
}

TEST(fp8_scale, refuses_device_tensors_and_other_types) {
  std::vector<float> x{1, 2, 3, 4};
  const std::vector<std::int64_t> four{4};
  auto e =
      REFIT_THROWN(fp8_scale(tensor_view("x", dtype::float32, four, x.data(), device::cuda(0)), dtype::float8_e4m3fn));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'x'"));
  EXPECT_THAT(e.message(), HasSubstr("host memory"));
  for (const auto& pair : {std::pair{dtype::float32, dtype::float16},
                           {dtype::int32, dtype::float8_e4m3fn},
                           {dtype::float8_e5m2, dtype::float8_e5m2}}) {
    const dtype s = pair.first, q = pair.second;
    auto e2 = REFIT_THROWN(fp8_scale(tensor_view("x", s, four, x.data()), q));
    EXPECT_EQ(e2.kind(), errc::invalid_argument);
    EXPECT_THAT(e2.message(), HasSubstr("'x'"));
    EXPECT_THAT(e2.message(), HasSubstr(std::string(to_string(q))));
  }
}

}  // namespace
}  // namespace refit::convert
