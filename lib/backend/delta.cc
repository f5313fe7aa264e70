#include <refit/backend/delta.h>
#include <refit/error.h>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>

namespace refit::backend::delta {
namespace {

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

// Calls f(index) for every element whose bytes differ, in order. Compares 8 bytes
// at a time: at the densities deltas are for, most words are equal.
template <class F>
void for_each_changed(const std::byte* a, const std::byte* b, std::size_t n, std::size_t elem, F&& f) {
  const std::size_t per_word = 8 / elem;
  std::size_t i = 0;
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

// Appends zstd(base XOR next) to out, streaming through a scratch buffer.
std::size_t append_xor_zstd(std::span<const std::byte> base, std::span<const std::byte> next,
                            std::vector<std::byte>& out, int level) {
  std::unique_ptr<ZSTD_CCtx, zstd_cctx_deleter> cctx(ZSTD_createCCtx());
  if (!cctx) throw_error(errc::resource_exhausted, "delta: zstd could not allocate a compression context");
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_contentSizeFlag, 1);
  ZSTD_CCtx_setPledgedSrcSize(cctx.get(), base.size());
  std::vector<std::byte> scratch(std::min(scratch_bytes, std::max<std::size_t>(base.size(), 1)));
  const std::size_t start = out.size();
  std::size_t pos = 0;
  bool done = false;
  while (!done) {
    const std::size_t take = std::min(scratch.size(), base.size() - pos);
    xor_into(scratch.data(), base.data() + pos, next.data() + pos, take);
    pos += take;
    const bool last = pos == base.size();
    ZSTD_inBuffer in{scratch.data(), take, 0};
    for (;;) {
      if (out.capacity() - out.size() < ZSTD_CStreamOutSize()) out.reserve(out.size() + 2 * ZSTD_CStreamOutSize());
      const std::size_t have = out.size();
      out.resize(out.capacity());
      ZSTD_outBuffer ob{out.data() + have, out.size() - have, 0};
      const std::size_t r = ZSTD_compressStream2(cctx.get(), &ob, &in, last ? ZSTD_e_end : ZSTD_e_continue);
      out.resize(have + ob.pos);
      if (ZSTD_isError(r))
        throw_error(errc::invalid_argument, std::string("delta: zstd compression failed: ") + ZSTD_getErrorName(r));
      if (last ? r == 0 : in.pos == in.size) break;
    }
    done = last;
  }
  return out.size() - start;
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
  }
  return "unknown";
}

encoding encoding_from_wire(std::uint8_t v) {
  if (v > static_cast<std::uint8_t>(encoding::xor_zstd))
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
  // One pass: how many changed, and the exact size of the sparse form.
  std::size_t changed = 0, sparse = 0;
  std::size_t prev = 0;  // index after the previous changed element
  for_each_changed(base.data(), next.data(), n, elem, [&](std::size_t i) {
    ++changed;
    sparse += leb128_size(i - prev) + elem;
    prev = i + 1;
  });
  const std::size_t bitmap = (n + 7) / 8 + changed * elem;
  encode_result r;
  r.changed = changed;
  const std::size_t start = out.size();
  std::size_t best = std::min(sparse, bitmap);
  if (options.allow_zstd && changed != 0 && best > options.zstd_above_fraction * static_cast<double>(full)) {
    const std::size_t z = append_xor_zstd(base, next, out, options.zstd_level);
    if (z < best && z < full) {
      r.kind = encoding::xor_zstd;
      r.bytes = z;
      return r;
    }
    out.resize(start);
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
    prev = 0;
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
    if (out.data() != base.data()) std::memcpy(out.data(), base.data(), base.size());
  };
  switch (kind) {
    case encoding::full:
      if (payload.size() != out.size())
        throw_error(errc::protocol_error, "delta: a full payload of " + std::to_string(payload.size()) + " bytes for " +
                                              std::to_string(out.size()) + " bytes");
      std::memcpy(out.data(), payload.data(), out.size());
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
    case encoding::xor_zstd: {
      const unsigned long long size = ZSTD_getFrameContentSize(payload.data(), payload.size());
      if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN || size != out.size())
        throw_error(errc::protocol_error,
                    "delta: xor_zstd frame does not say it holds " + std::to_string(out.size()) + " bytes");
      std::unique_ptr<ZSTD_DCtx, zstd_dctx_deleter> dctx(ZSTD_createDCtx());
      if (!dctx) throw_error(errc::resource_exhausted, "delta: zstd could not allocate a decompression context");
      std::vector<std::byte> scratch(std::min(scratch_bytes, std::max<std::size_t>(out.size(), 1)));
      ZSTD_inBuffer in{payload.data(), payload.size(), 0};
      std::size_t pos = 0;
      std::size_t r = 1;
      while (pos < out.size()) {
        ZSTD_outBuffer ob{scratch.data(), std::min(scratch.size(), out.size() - pos), 0};
        r = ZSTD_decompressStream(dctx.get(), &ob, &in);
        if (ZSTD_isError(r))
          throw_error(errc::protocol_error, std::string("delta: xor_zstd frame is corrupt: ") + ZSTD_getErrorName(r));
        if (ob.pos == 0 && in.pos == in.size) break;
        xor_into(out.data() + pos, base.data() + pos, scratch.data(), ob.pos);
        pos += ob.pos;
      }
      if (pos != out.size() || r != 0 || in.pos != in.size)
        throw_error(errc::protocol_error, "delta: xor_zstd frame decodes to " + std::to_string(pos) + " of " +
                                              std::to_string(out.size()) + " bytes, or carries trailing bytes");
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
