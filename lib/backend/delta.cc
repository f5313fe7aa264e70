#include <refit/backend/delta.h>
#include <refit/error.h>
// The planes' compression parameters below (ZSTD_c_literalCompressionMode) are
// zstd's experimental API: stable within the release refit links statically
// (third_party/BUILD: Debian's libzstd.a).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

namespace refit::backend::delta {
namespace {

// The wire format's integers and the element lanes below are read with memcpy.
static_assert(std::endian::native == std::endian::little, "refit's delta codec assumes a little-endian host");

constexpr std::size_t scratch_bytes = 256 << 10;

bool valid_elem(std::size_t e) { return e == 1 || e == 2 || e == 4 || e == 8; }

std::size_t leb128_size(std::uint64_t v) {
  std::size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void put_leb128(std::vector<std::byte>& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<std::byte>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<std::byte>(v));
}

// Bit k (0..3) set when 16-bit lane k of x is not zero: bit 15 of each lane first
// (its low 15 bits plus 0x7fff carry into it, or its own top bit), then the four
// gathered by one multiply (no two partial products meet, so nothing carries).
inline std::uint64_t nonzero_lanes16(std::uint64_t x) {
  constexpr std::uint64_t low = 0x7fff7fff7fff7fffull;
  const std::uint64_t top = (((x & low) + low) | x) & ~low;
  return (top * 0x0000200040008001ull) >> 60;
}

// Calls f(index) for every element whose bytes differ, in order. Compares 8 bytes
// at a time: at the densities deltas are for, most words are equal. 2-byte
// elements (bf16, fp16: what deltas are for) go 64 at a time through a mask
// built without a branch per element.
template <class F>
void for_each_changed(const std::byte* a, const std::byte* b, std::size_t n, std::size_t elem, F&& f) {
  const std::size_t per_word = 8 / elem;
  std::size_t i = 0;
  if (elem == 2) {
    for (; i + 64 <= n; i += 64) {
      std::uint64_t m = 0;
      for (std::size_t w = 0; w < 16; ++w) {
        std::uint64_t x, y;
        std::memcpy(&x, a + (i + 4 * w) * 2, 8);
        std::memcpy(&y, b + (i + 4 * w) * 2, 8);
        m |= nonzero_lanes16(x ^ y) << (4 * w);
      }
      for (; m != 0; m &= m - 1) f(i + static_cast<std::size_t>(std::countr_zero(m)));
    }
  }
  for (; i + per_word <= n; i += per_word) {
    std::uint64_t x, y;
    std::memcpy(&x, a + i * elem, 8);
    std::memcpy(&y, b + i * elem, 8);
    std::uint64_t d = x ^ y;
    while (d != 0) {
      std::size_t k = static_cast<std::size_t>(std::countr_zero(d)) / (elem * 8);
      f(i + k);
      // Clear this element's bits.
      std::uint64_t mask = elem == 8 ? ~std::uint64_t{0} : ((std::uint64_t{1} << (elem * 8)) - 1) << (k * elem * 8);
      d &= ~mask;
    }
  }
  for (; i < n; ++i)
    if (std::memcmp(a + i * elem, b + i * elem, elem) != 0) f(i);
}

// 64 two-byte elements at a and b: returns the mask of those that differ (bit k:
// element k) and writes their 64 XORs to x. (SSE2 is part of x86-64; elsewhere the
// lanes are tested 4 at a time in 64-bit words.)
inline std::uint64_t changed64_2(const std::byte* a, const std::byte* b, std::uint16_t* x) {
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  std::uint64_t m = 0;
  for (int q = 0; q < 4; ++q) {
    const auto* pa = reinterpret_cast<const __m128i*>(a + 32 * q);
    const auto* pb = reinterpret_cast<const __m128i*>(b + 32 * q);
    const __m128i d0 = _mm_xor_si128(_mm_loadu_si128(pa), _mm_loadu_si128(pb));
    const __m128i d1 = _mm_xor_si128(_mm_loadu_si128(pa + 1), _mm_loadu_si128(pb + 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x + 16 * q), d0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x + 16 * q + 8), d1);
    // One byte per element (0xff where equal), then one bit per element.
    const __m128i equal = _mm_packs_epi16(_mm_cmpeq_epi16(d0, zero), _mm_cmpeq_epi16(d1, zero));
    m |= static_cast<std::uint64_t>(static_cast<std::uint16_t>(~_mm_movemask_epi8(equal))) << (16 * q);
  }
  return m;
#else
  std::uint64_t m = 0;
  for (std::size_t w = 0; w < 16; ++w) {
    std::uint64_t p, q;
    std::memcpy(&p, a + 8 * w, 8);
    std::memcpy(&q, b + 8 * w, 8);
    const std::uint64_t d = p ^ q;
    std::memcpy(x + 4 * w, &d, 8);
    m |= nonzero_lanes16(d) << (4 * w);
  }
  return m;
#endif
}

// The bitmap and the two byte planes of m two-byte elements (xor_planes' scan, the
// encoder's hot loop at the densities deltas are for): 64 elements at a time, the
// mask stored as 8 bytes of the bitmap and each changed element's XOR split into
// lo and hi. Returns how many changed. map holds (m + 7) / 8 bytes, lo and hi m.
std::size_t scan_planes2(const std::byte* a, const std::byte* b, std::size_t m, std::byte* map, std::byte* lo,
                         std::byte* hi) {
  std::size_t k = 0, i = 0;
  alignas(16) std::uint16_t x[64];
  for (; i + 64 <= m; i += 64) {
    std::uint64_t mask = changed64_2(a + 2 * i, b + 2 * i, x);
    std::memcpy(map + i / 8, &mask, 8);
    for (; mask != 0; mask &= mask - 1) {
      const std::uint16_t v = x[std::countr_zero(mask)];
      lo[k] = static_cast<std::byte>(v);
      hi[k] = static_cast<std::byte>(v >> 8);
      ++k;
    }
  }
  if (i < m) std::memset(map + i / 8, 0, (m + 7) / 8 - i / 8);
  for_each_changed(a + 2 * i, b + 2 * i, m - i, 2, [&](std::size_t j) {
    map[(i + j) / 8] |= static_cast<std::byte>(1u << ((i + j) % 8));
    lo[k] = a[2 * (i + j)] ^ b[2 * (i + j)];
    hi[k] = a[2 * (i + j) + 1] ^ b[2 * (i + j) + 1];
    ++k;
  });
  return k;
}

struct zstd_cctx_deleter {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct zstd_dctx_deleter {
  void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
};

void xor_into(std::byte* dst, const std::byte* a, const std::byte* b, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    x ^= y;
    std::memcpy(dst + i, &x, 8);
  }
  for (; i < n; ++i) dst[i] = a[i] ^ b[i];
}

// This thread's zstd context number `k` (compression or decompression: one per
// stream written or read at once), reset to its defaults: a bucket of many small
// pieces would otherwise create, and size, 1 + elem contexts per piece.
template <class Ctx, class Deleter, class Reset>
Ctx* thread_context(std::size_t k, Ctx* (*create)(), Reset reset, const char* what) {
  thread_local std::vector<std::unique_ptr<Ctx, Deleter>> pool;
  while (pool.size() <= k) {
    pool.emplace_back(create());
    if (!pool.back()) {
      pool.pop_back();
      throw_error(errc::resource_exhausted, std::string("delta: zstd could not allocate a ") + what + " context");
    }
  }
  reset(pool[k].get(), ZSTD_reset_session_and_parameters);
  return pool[k].get();
}
ZSTD_CCtx* thread_cctx(std::size_t k) {
  return thread_context<ZSTD_CCtx, zstd_cctx_deleter>(k, ZSTD_createCCtx, ZSTD_CCtx_reset, "compression");
}
ZSTD_DCtx* thread_dctx(std::size_t k) {
  return thread_context<ZSTD_DCtx, zstd_dctx_deleter>(k, ZSTD_createDCtx, ZSTD_DCtx_reset, "decompression");
}

// How a zstd stream is compressed: at `level`, or with the parameters tuned for
// xor_planes' streams.
struct zstd_setting {
  int level = 1;
  bool planes_tuned = false;
};

// One zstd frame, written piece by piece onto the end of `dst`; with `pledged`, its
// header carries the content size (which the pieces must add up to).
class zstd_writer {
 public:
  zstd_writer(std::vector<std::byte>& dst, zstd_setting setting, std::optional<std::size_t> pledged,
              std::size_t stream = 0)
      : dst_(&dst), cctx_(thread_cctx(stream)) {
    if (setting.planes_tuned) {
      // xor_planes' streams (a bitmap, XOR bytes of small moves) hold few long
      // matches: a fast level with a small hash table and long minimum matches
      // spends little on looking for them, and Huffman-coded literals keep the
      // size (level 1's or smaller on the measured streams: docs/delta.md).
      ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, -3);
      ZSTD_CCtx_setParameter(cctx_, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
      ZSTD_CCtx_setParameter(cctx_, ZSTD_c_minMatch, 7);
      ZSTD_CCtx_setParameter(cctx_, ZSTD_c_hashLog, 8);
    } else {
      ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, setting.level);
    }
    ZSTD_CCtx_setParameter(cctx_, ZSTD_c_contentSizeFlag, pledged ? 1 : 0);
    if (pledged) ZSTD_CCtx_setPledgedSrcSize(cctx_, *pledged);
  }
  // Compresses `in`; with `last`, ends the frame. (Through a buffer of its own:
  // growing dst to hand zstd room would zero that room on every call.)
  void write(std::span<const std::byte> in, bool last) {
    ZSTD_inBuffer ib{in.data(), in.size(), 0};
    if (room_.empty()) room_.resize(ZSTD_CStreamOutSize());
    for (;;) {
      ZSTD_outBuffer ob{room_.data(), room_.size(), 0};
      const std::size_t r = ZSTD_compressStream2(cctx_, &ob, &ib, last ? ZSTD_e_end : ZSTD_e_continue);
      if (ZSTD_isError(r))
        throw_error(errc::invalid_argument, std::string("delta: zstd compression failed: ") + ZSTD_getErrorName(r));
      dst_->insert(dst_->end(), room_.begin(), room_.begin() + static_cast<std::ptrdiff_t>(ob.pos));
      if (last ? r == 0 : ib.pos == ib.size) break;
    }
  }

 private:
  std::vector<std::byte>* dst_;
  ZSTD_CCtx* cctx_;
  std::vector<std::byte> room_;
};

// Reads one zstd frame that must hold exactly `expect` bytes, piece by piece;
// error(protocol_error) naming `what` for anything else. A frame whose header
// does not say its size (size_in_header false) is held to `expect` by reading.
class zstd_reader {
 public:
  zstd_reader(std::span<const std::byte> frame, std::uint64_t expect, std::string what, bool size_in_header = true,
              std::size_t stream = 0)
      : in_{frame.data(), frame.size(), 0}, dctx_(thread_dctx(stream)), what_(std::move(what)) {
    const unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
    if (size == ZSTD_CONTENTSIZE_ERROR || (size == ZSTD_CONTENTSIZE_UNKNOWN ? size_in_header : size != expect))
      throw_error(errc::protocol_error,
                  "delta: " + what_ + " frame does not say it holds " + std::to_string(expect) + " bytes");
  }
  // The frame's next dst.size() bytes.
  void read(std::span<std::byte> dst) {
    ZSTD_outBuffer ob{dst.data(), dst.size(), 0};
    while (ob.pos < ob.size) {
      const std::size_t in_before = in_.pos, out_before = ob.pos;
      step(ob);
      if (ob.pos == out_before && in_.pos == in_before)
        throw_error(errc::protocol_error, "delta: " + what_ + " frame ends early");
    }
  }
  // The frame ends here, and the payload with it.
  void finish() {
    std::byte extra{};
    while (left_ != 0) {
      ZSTD_outBuffer ob{&extra, 1, 0};
      const std::size_t in_before = in_.pos;
      step(ob);
      if (ob.pos != 0) throw_error(errc::protocol_error, "delta: " + what_ + " frame holds more bytes than it says");
      if (left_ != 0 && in_.pos == in_before)
        throw_error(errc::protocol_error, "delta: " + what_ + " frame is cut short");
    }
    if (in_.pos != in_.size) throw_error(errc::protocol_error, "delta: trailing bytes after the " + what_ + " frame");
  }

 private:
  void step(ZSTD_outBuffer& ob) {
    left_ = ZSTD_decompressStream(dctx_, &ob, &in_);
    if (ZSTD_isError(left_))
      throw_error(errc::protocol_error, "delta: " + what_ + " frame is corrupt: " + ZSTD_getErrorName(left_));
  }
  ZSTD_inBuffer in_;
  ZSTD_DCtx* dctx_;
  std::string what_;
  std::size_t left_ = 1;  // ZSTD_decompressStream's last hint (0: the frame ended)
};

// Appends zstd(base XOR next) to out, streaming through a scratch buffer.
std::size_t append_xor_zstd(std::span<const std::byte> base, std::span<const std::byte> next,
                            std::vector<std::byte>& out, int level) {
  const std::size_t start = out.size();
  zstd_writer frame(out, {.level = level}, base.size());
  std::vector<std::byte> scratch(std::min(scratch_bytes, std::max<std::size_t>(base.size(), 1)));
  std::size_t pos = 0;
  do {
    const std::size_t take = std::min(scratch.size(), base.size() - pos);
    xor_into(scratch.data(), base.data() + pos, next.data() + pos, take);
    pos += take;
    frame.write({scratch.data(), take}, pos == base.size());
  } while (pos < base.size());
  return out.size() - start;
}

// xor_planes works through blocks of this many elements (a multiple of 8, so the
// blocks' bitmaps concatenate into the whole one): scratch of 8 KiB of bitmap and
// 64 KiB per byte plane.
constexpr std::size_t planes_block = 1 << 16;

std::size_t planes_header_bytes(std::size_t elem) { return 8 * (2 + elem); }

// A pass that counts the changed elements and the exact size of their sparse form.
struct scan_counts {
  std::size_t changed = 0, sparse = 0;
};
scan_counts count_changes(const std::byte* a, const std::byte* b, std::size_t n, std::size_t elem) {
  scan_counts c;
  std::size_t prev = 0;  // the index after the previous changed element
  const auto count = [&](std::size_t i) {
    ++c.changed;
    c.sparse += leb128_size(i - prev) + elem;
    prev = i + 1;
  };
  std::size_t i = 0;
  if (elem == 2) {  // 64 at a time, as xor_planes' scan
    alignas(16) std::uint16_t x[64];
    for (; i + 64 <= n; i += 64)
      for (std::uint64_t m = changed64_2(a + 2 * i, b + 2 * i, x); m != 0; m &= m - 1)
        count(i + static_cast<std::size_t>(std::countr_zero(m)));
  }
  for_each_changed(a + i * elem, b + i * elem, n - i, elem, [&](std::size_t j) { count(i + j); });
  return c;
}

// Appends the xor_planes encoding to out, counting the changed elements as it goes
// (one pass: the planes need no count up front; the header says how many changed).
std::size_t append_xor_planes(std::span<const std::byte> base, std::span<const std::byte> next, std::size_t elem,
                              std::vector<std::byte>& out, zstd_setting setting, std::size_t& changed) {
  const std::size_t n = base.size() / elem;
  std::vector<std::vector<std::byte>> frames(1 + elem);
  std::vector<zstd_writer> streams;
  streams.reserve(1 + elem);
  streams.emplace_back(frames[0], setting, (n + 7) / 8, 0);
  for (std::size_t j = 0; j < elem; ++j) streams.emplace_back(frames[1 + j], setting, std::nullopt, 1 + j);
  // Scratch for one block (a small piece needs less than a whole one).
  const std::size_t block = std::min(planes_block, (n + 7) / 8 * 8);
  std::vector<std::byte> map(block / 8), planes(elem * block);
  std::size_t count = 0;  // changed elements so far
  for (std::size_t b0 = 0; b0 < n;) {
    const std::size_t m = std::min(planes_block, n - b0);
    std::size_t k = 0;
    const std::byte* a = base.data() + b0 * elem;
    const std::byte* b = next.data() + b0 * elem;
    if (elem == 2) {
      k = scan_planes2(a, b, m, map.data(), planes.data(), planes.data() + block);
    } else {
      std::fill(map.begin(), map.end(), std::byte{0});
      for_each_changed(a, b, m, elem, [&](std::size_t i) {
        map[i / 8] |= static_cast<std::byte>(1u << (i % 8));
        for (std::size_t j = 0; j < elem; ++j) planes[j * block + k] = a[i * elem + j] ^ b[i * elem + j];
        ++k;
      });
    }
    count += k;
    b0 += m;
    const bool last = b0 == n;
    streams[0].write({map.data(), (m + 7) / 8}, last);
    for (std::size_t j = 0; j < elem; ++j) streams[1 + j].write({planes.data() + j * block, k}, last);
  }
  const std::size_t start = out.size();
  std::size_t total = planes_header_bytes(elem);
  for (const auto& f : frames) total += f.size();
  out.reserve(start + total);
  const auto put_u64 = [&out](std::uint64_t v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof v);  // little-endian (wire format)
  };
  put_u64(count);
  changed = count;
  for (const auto& f : frames) put_u64(f.size());
  for (const auto& f : frames) out.insert(out.end(), f.begin(), f.end());
  return out.size() - start;
}

// Decodes an xor_planes payload into out (which holds the base's bytes by then).
void decode_xor_planes(std::span<const std::byte> payload, std::span<std::byte> out, std::size_t elem) {
  if (elem < 2)
    throw_error(errc::protocol_error, "delta: xor_planes for elements of " + std::to_string(elem) + " byte");
  const std::size_t n = out.size() / elem;
  const std::size_t header = planes_header_bytes(elem);
  if (payload.size() < header)
    throw_error(errc::protocol_error,
                "delta: xor_planes payload of " + std::to_string(payload.size()) + " bytes, shorter than its header");
  std::uint64_t changed = 0;
  std::memcpy(&changed, payload.data(), sizeof changed);
  if (changed > n)
    throw_error(errc::protocol_error,
                "delta: xor_planes says " + std::to_string(changed) + " of " + std::to_string(n) + " elements changed");
  std::vector<std::span<const std::byte>> frames;
  std::size_t at = header;
  for (std::size_t s = 0; s <= elem; ++s) {
    std::uint64_t size = 0;
    std::memcpy(&size, payload.data() + 8 * (1 + s), sizeof size);
    if (size > payload.size() - at)
      throw_error(errc::protocol_error, "delta: xor_planes frame " + std::to_string(s) + " claims " +
                                            std::to_string(size) + " bytes, " + std::to_string(payload.size() - at) +
                                            " are left");
    frames.push_back(payload.subspan(at, static_cast<std::size_t>(size)));
    at += static_cast<std::size_t>(size);
  }
  if (at != payload.size())
    throw_error(errc::protocol_error,
                "delta: " + std::to_string(payload.size() - at) + " bytes after the last xor_planes frame");
  // Every plane holds one byte per changed element.
  zstd_reader map_in(frames[0], (n + 7) / 8, "xor_planes bitmap", true, 0);
  std::vector<zstd_reader> plane_in;
  plane_in.reserve(elem);
  for (std::size_t j = 0; j < elem; ++j)
    plane_in.emplace_back(frames[1 + j], changed, "xor_planes plane " + std::to_string(j), false, 1 + j);
  const std::size_t block = std::min(planes_block, (n + 7) / 8 * 8);
  // The map's scratch is read 8 bytes at a time: zeros past a short block's end.
  std::vector<std::byte> map((block + 63) / 64 * 8), planes(elem * block);
  std::uint64_t seen = 0;
  for (std::size_t b0 = 0; b0 < n;) {
    const std::size_t m = std::min(planes_block, n - b0), map_bytes = (m + 7) / 8;
    map_in.read({map.data(), map_bytes});
    std::fill(map.begin() + static_cast<std::ptrdiff_t>(map_bytes), map.end(), std::byte{0});
    if (m % 8 != 0 && (static_cast<std::uint8_t>(map[map_bytes - 1]) >> (m % 8)) != 0)
      throw_error(errc::protocol_error, "delta: xor_planes bitmap marks elements past the end");
    const std::size_t words = (map_bytes + 7) / 8;
    std::size_t k = 0;
    for (std::size_t q = 0; q < words; ++q) {
      std::uint64_t w;
      std::memcpy(&w, map.data() + 8 * q, 8);
      k += static_cast<std::size_t>(std::popcount(w));
    }
    if (k > changed - seen)
      throw_error(errc::protocol_error, "delta: xor_planes bitmap marks more than the " + std::to_string(changed) +
                                            " changed elements its planes carry");
    seen += k;
    for (std::size_t j = 0; j < elem; ++j) plane_in[j].read({planes.data() + j * block, k});
    std::byte* o = out.data() + b0 * elem;
    const std::byte* lo = planes.data();
    const std::byte* hi = planes.data() + block;
    std::size_t t = 0;
    for (std::size_t q = 0; q < words; ++q) {
      std::uint64_t bits;
      std::memcpy(&bits, map.data() + 8 * q, 8);
      for (; bits != 0; bits &= bits - 1, ++t) {
        const std::size_t i = 64 * q + static_cast<std::size_t>(std::countr_zero(bits));
        if (elem == 2) {  // (bf16, fp16: what deltas are for)
          std::uint16_t v;
          std::memcpy(&v, o + 2 * i, 2);
          v ^= static_cast<std::uint16_t>(static_cast<unsigned>(lo[t]) | static_cast<unsigned>(hi[t]) << 8);
          std::memcpy(o + 2 * i, &v, 2);
        } else {
          for (std::size_t j = 0; j < elem; ++j) o[i * elem + j] ^= planes[j * block + t];
        }
      }
    }
    b0 += m;
  }
  if (seen != changed)
    throw_error(errc::protocol_error, "delta: xor_planes bitmap marks " + std::to_string(seen) +
                                          " elements, its planes carry " + std::to_string(changed));
  map_in.finish();
  for (auto& p : plane_in) p.finish();
}

}  // namespace

std::string_view name(encoding e) {
  switch (e) {
    case encoding::full:
      return "full";
    case encoding::sparse:
      return "sparse";
    case encoding::bitmap:
      return "bitmap";
    case encoding::xor_zstd:
      return "xor_zstd";
    case encoding::xor_planes:
      return "xor_planes";
  }
  return "unknown";
}

encoding encoding_from_wire(std::uint8_t v) {
  if (v > static_cast<std::uint8_t>(encoding::xor_planes))
    throw_error(errc::protocol_error, "delta: unknown encoding " + std::to_string(v));
  return static_cast<encoding>(v);
}

encode_result encode(std::span<const std::byte> base, std::span<const std::byte> next, std::size_t elem,
                     std::vector<std::byte>& out, const encode_options& options) {
  if (!valid_elem(elem)) throw_error(errc::invalid_argument, "delta: element size " + std::to_string(elem));
  if (base.size() != next.size() || base.size() % elem != 0)
    throw_error(errc::invalid_argument, "delta: base of " + std::to_string(base.size()) + " bytes, next of " +
                                            std::to_string(next.size()) + " bytes, elements of " +
                                            std::to_string(elem));
  const std::size_t n = base.size() / elem;
  const std::size_t full = base.size();
  encode_result r;
  const std::size_t start = out.size();
  // One pass: the xor_planes form where it may be used, counting the changed
  // elements on the way (it usually wins; else it is dropped and a second pass
  // writes the smaller form), or else the changed elements and the exact size of
  // the sparse form.
  std::size_t planes = 0, changed = 0, sparse = 0;
  if (options.allow_zstd && options.allow_planes && elem >= 2) {
    planes = append_xor_planes(base, next, elem, out, {options.zstd_level, options.fast_planes}, changed);
    // The sparse form takes at least 1 + elem bytes per changed element: counted
    // only where it could be no larger than xor_planes (few changes, a short pass).
    sparse =
        planes < changed * (1 + elem) ? changed * (1 + elem) : count_changes(base.data(), next.data(), n, elem).sparse;
  } else {
    const scan_counts c = count_changes(base.data(), next.data(), n, elem);
    changed = c.changed;
    sparse = c.sparse;
  }
  const std::size_t bitmap = (n + 7) / 8 + changed * elem;
  r.changed = changed;
  std::size_t best = std::min(sparse, bitmap);
  std::optional<encoding> kept;
  if (planes != 0 && changed != 0 && planes < best && planes < full) {
    kept = encoding::xor_planes;
    best = planes;
  } else {
    out.resize(start);
  }
  const bool try_zstd = options.allow_zstd && (planes == 0 || options.zstd_with_planes);
  if (try_zstd && changed != 0 && best > options.zstd_above_fraction * static_cast<double>(full)) {
    const std::size_t at = out.size();
    const std::size_t z = append_xor_zstd(base, next, out, options.zstd_level);
    if (z < best && z < full) {
      out.erase(out.begin() + static_cast<std::ptrdiff_t>(start), out.begin() + static_cast<std::ptrdiff_t>(at));
      kept = encoding::xor_zstd;
      best = z;
    } else {
      out.resize(at);
    }
  }
  if (kept) {
    r.kind = *kept;
    r.bytes = best;
    return r;
  }
  if (best >= full) {
    out.insert(out.end(), next.begin(), next.end());
    r.kind = encoding::full;
    r.bytes = full;
    return r;
  }
  out.reserve(start + best);
  if (sparse <= bitmap) {
    r.kind = encoding::sparse;
    std::size_t prev = 0;
    for_each_changed(base.data(), next.data(), n, elem, [&](std::size_t i) {
      put_leb128(out, i - prev);
      out.insert(out.end(), next.data() + i * elem, next.data() + (i + 1) * elem);
      prev = i + 1;
    });
  } else {
    r.kind = encoding::bitmap;
    const std::size_t map_at = out.size();
    out.resize(map_at + (n + 7) / 8, std::byte{0});
    std::size_t values_at = out.size();
    out.resize(values_at + changed * elem);
    for_each_changed(base.data(), next.data(), n, elem, [&](std::size_t i) {
      out[map_at + i / 8] |= static_cast<std::byte>(1u << (i % 8));
      std::memcpy(out.data() + values_at, next.data() + i * elem, elem);
      values_at += elem;
    });
  }
  r.bytes = out.size() - start;
  return r;
}

void decode(encoding kind, std::span<const std::byte> payload, std::span<const std::byte> base,
            std::span<std::byte> out, std::size_t elem) {
  if (!valid_elem(elem)) throw_error(errc::invalid_argument, "delta: element size " + std::to_string(elem));
  if (out.size() != base.size() || base.size() % elem != 0)
    throw_error(errc::invalid_argument, "delta: base of " + std::to_string(base.size()) + " bytes, out of " +
                                            std::to_string(out.size()) + " bytes, elements of " + std::to_string(elem));
  const std::size_t n = base.size() / elem;
  auto copy_base = [&] {
    if (out.data() != base.data() && !base.empty()) std::memcpy(out.data(), base.data(), base.size());
  };
  switch (kind) {
    case encoding::full:
      if (payload.size() != out.size())
        throw_error(errc::protocol_error, "delta: a full payload of " + std::to_string(payload.size()) + " bytes for " +
                                              std::to_string(out.size()) + " bytes");
      if (!out.empty()) std::memcpy(out.data(), payload.data(), out.size());  // (no null pointers to memcpy)
      return;
    case encoding::sparse: {
      // Validate before writing: a payload that fails leaves out untouched.
      for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) copy_base();
        std::size_t p = 0, next_index = 0;
        while (p < payload.size()) {
          std::uint64_t gap = 0;
          int shift = 0;
          for (;;) {
            if (p == payload.size()) throw_error(errc::protocol_error, "delta: sparse payload ends inside a gap");
            const auto b = static_cast<std::uint8_t>(payload[p++]);
            if (shift > 63 || (shift == 63 && (b & 0x7e) != 0))
              throw_error(errc::protocol_error, "delta: sparse gap overflows 64 bits");
            gap |= static_cast<std::uint64_t>(b & 0x7f) << shift;
            shift += 7;
            if ((b & 0x80) == 0) break;
          }
          if (gap >= n - std::min<std::uint64_t>(next_index, n) || next_index >= n)
            throw_error(errc::protocol_error,
                        "delta: sparse element past the end (" + std::to_string(n) + " elements)");
          const std::size_t i = next_index + gap;
          if (payload.size() - p < elem) throw_error(errc::protocol_error, "delta: sparse payload ends inside a value");
          if (pass == 1) std::memcpy(out.data() + i * elem, payload.data() + p, elem);
          p += elem;
          next_index = i + 1;
        }
      }
      return;
    }
    case encoding::bitmap: {
      const std::size_t map = (n + 7) / 8;
      if (payload.size() < map)
        throw_error(errc::protocol_error, "delta: bitmap payload of " + std::to_string(payload.size()) +
                                              " bytes, shorter than its map of " + std::to_string(map));
      std::size_t set = 0;
      for (std::size_t k = 0; k < map; ++k) set += std::popcount(static_cast<std::uint8_t>(payload[k]));
      if (n % 8 != 0 && (static_cast<std::uint8_t>(payload[map - 1]) >> (n % 8)) != 0)
        throw_error(errc::protocol_error, "delta: bitmap marks elements past the end");
      if (payload.size() - map != set * elem)
        throw_error(errc::protocol_error, "delta: bitmap marks " + std::to_string(set) + " elements but carries " +
                                              std::to_string(payload.size() - map) + " value bytes");
      copy_base();
      const std::byte* v = payload.data() + map;
      for (std::size_t k = 0; k < map; ++k) {
        auto bits = static_cast<std::uint8_t>(payload[k]);
        while (bits != 0) {
          const std::size_t i = k * 8 + static_cast<std::size_t>(std::countr_zero(bits));
          std::memcpy(out.data() + i * elem, v, elem);
          v += elem;
          bits &= static_cast<std::uint8_t>(bits - 1);
        }
      }
      return;
    }
    case encoding::xor_planes:
      copy_base();
      decode_xor_planes(payload, out, elem);
      return;
    case encoding::xor_zstd: {
      zstd_reader frame(payload, out.size(), "xor_zstd");
      std::vector<std::byte> scratch(std::min(scratch_bytes, std::max<std::size_t>(out.size(), 1)));
      for (std::size_t pos = 0; pos < out.size();) {
        const std::size_t take = std::min(scratch.size(), out.size() - pos);
        frame.read({scratch.data(), take});
        xor_into(out.data() + pos, base.data() + pos, scratch.data(), take);
        pos += take;
      }
      frame.finish();
      return;
    }
  }
  throw_error(errc::protocol_error, "delta: unknown encoding");
}

std::size_t piece_elem(std::size_t dtype_size, std::uint64_t tensor_offset, std::uint64_t bytes) {
  if (!valid_elem(dtype_size) || tensor_offset % dtype_size != 0 || bytes % dtype_size != 0) return 1;
  return dtype_size;
}

pieces_result encode_pieces(std::span<const piece_in> pieces, std::vector<std::byte>& out,
                            const encode_options& options) {
  pieces_result r;
  const std::size_t start = out.size();
  for (const auto& p : pieces) {
    if (p.next.empty() && p.base.empty()) continue;
    const std::size_t header_at = out.size();
    out.resize(header_at + piece_header_bytes);
    const encode_result e = encode(p.base, p.next, p.elem, out, options);
    out[header_at] = static_cast<std::byte>(e.kind);
    const std::uint64_t n = e.bytes;
    std::memcpy(out.data() + header_at + 1, &n, sizeof n);  // little-endian (wire format)
    r.changed += e.changed;
  }
  r.bytes = out.size() - start;
  return r;
}

void decode_pieces(std::span<const std::byte> payload, std::span<const piece_out> pieces) {
  std::size_t at = 0, k = 0;
  for (const auto& p : pieces) {
    if (p.out.empty() && p.base.empty()) continue;
    if (payload.size() - at < piece_header_bytes)
      throw_error(errc::protocol_error, "delta: the record of piece " + std::to_string(k) + " is missing (" +
                                            std::to_string(payload.size() - at) + " bytes left)");
    const encoding kind = encoding_from_wire(static_cast<std::uint8_t>(payload[at]));
    std::uint64_t n = 0;
    std::memcpy(&n, payload.data() + at + 1, sizeof n);
    at += piece_header_bytes;
    if (n > payload.size() - at)
      throw_error(errc::protocol_error, "delta: piece " + std::to_string(k) + " claims " + std::to_string(n) +
                                            " payload bytes, " + std::to_string(payload.size() - at) + " are left");
    decode(kind, payload.subspan(at, static_cast<std::size_t>(n)), p.base, p.out, p.elem);
    at += static_cast<std::size_t>(n);
    ++k;
  }
  if (at != payload.size())
    throw_error(errc::protocol_error,
                "delta: " + std::to_string(payload.size() - at) + " bytes left over after the last piece's record");
}

}  // namespace refit::backend::delta
