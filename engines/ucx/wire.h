// The ucx engine's own side-channel messages (after links' authentication and
// hello; see ucx.h for the order). Little-endian, fixed headers; every length is
// bounded before anything is allocated.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <refit/backend/links/wire.h>

namespace refit::ucx::wire {

inline constexpr std::uint32_t offer_magic = 0x4f435552;  // "RUCO"
inline constexpr std::uint32_t grant_magic = 0x47435552;  // "RUCG"
inline constexpr std::uint32_t done_magic = 0x44435552;   // "RUCD"
inline constexpr std::uint32_t form_magic = 0x46435552;   // "RUCF"
/// Largest offer accepted: a UCX address and a few dozen packed keys are far less.
inline constexpr std::uint32_t max_offer = 1u << 20;
/// Largest packed remote key accepted in a grant.
inline constexpr std::uint32_t max_rkey = 1u << 16;

/// Followed by `bytes` of body: the address, then per region {base u64, bytes u64,
/// rkey_bytes u32} and the key.
struct offer_header {
  std::uint32_t magic = offer_magic;
  std::uint32_t bytes = 0;
  std::uint32_t address_bytes = 0;
  std::uint32_t regions = 0;
};

inline constexpr std::uint32_t mode_put = 1;
inline constexpr std::uint32_t mode_tag = 2;
/// Puts into several ranges (the model's memory, a stage): the grant's `region` is
/// the number of put_piece records that follow it, `rkey_bytes` their bytes with
/// their keys.
inline constexpr std::uint32_t mode_put_pieces = 3;
/// Most pieces in one such grant, and most bytes of their records.
inline constexpr std::uint32_t max_pieces = 1u << 16;
inline constexpr std::uint32_t max_pieces_bytes = 16u << 20;
/// Region ids from here on are registered for one update only (the model's memory,
/// the stage); a sender forgets their keys when the next update starts.
inline constexpr std::uint32_t first_update_region = 1u << 24;

/// Where bucket `index` may land. Put: at `remote` in region `region` (whose key
/// follows, rkey_bytes long, when the trainer has not seen that region yet). Tag: a
/// receive with `tag` is posted.
struct grant {
  std::uint32_t magic = grant_magic;
  std::uint32_t mode = 0;
  std::uint64_t index = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t remote = 0;
  std::uint64_t tag = 0;
  std::uint32_t region = 0;
  std::uint32_t rkey_bytes = 0;
  std::uint64_t region_base = 0;  ///< with a key: the region's extent
  std::uint64_t region_bytes = 0;
};

inline constexpr std::uint32_t done_checksum = 1;  ///< done::flags: `checksum` is set

/// The bucket's bytes are in the worker's memory (puts flushed, or the send done).
/// With checksums (wire params), `checksum` is the trainer's XXH3-64 of the
/// bucket's payload (backend/checksum.h), passed on unchanged by every relay.
struct done {
  std::uint32_t magic = done_magic;
  std::uint32_t flags = 0;
  std::uint64_t index = 0;
  std::uint64_t checksum = 0;
};

/// Delta updates a worker took (docs/delta.md): before bucket `index`'s grant, the
/// trainer says in what form it comes: `encoded_bytes` of delta records (fewer
/// than the bucket's payload bytes), or 0: the bucket's bytes themselves.
struct form {
  std::uint32_t magic = form_magic;
  std::uint32_t reserved = 0;
  std::uint64_t index = 0;
  std::uint64_t encoded_bytes = 0;
};

/// One range of a mode_put_pieces grant: `bytes` at `remote` in region `region`,
/// whose key follows (rkey_bytes long) when the sender has not seen that region.
struct put_piece {
  std::uint64_t remote = 0;
  std::uint64_t bytes = 0;
  std::uint32_t region = 0;
  std::uint32_t rkey_bytes = 0;
  std::uint64_t region_base = 0;  ///< with a key: the region's extent
  std::uint64_t region_bytes = 0;
};

static_assert(sizeof(offer_header) == 16 && sizeof(grant) == 64 && sizeof(done) == 24 && sizeof(form) == 24 &&
              sizeof(put_piece) == 40);

// The bytes of a header struct: the links' encoder (the structs have no padding).
using links::wire::encode;

/// A header struct from the front of `in` (at least sizeof(T) bytes).
template <class T>
T decode(std::span<const std::byte> in) {
  T v;
  std::memcpy(&v, in.data(), sizeof(T));
  return v;
}

/// Appends and reads the offer's body.
struct writer {
  std::vector<std::byte> out;
  template <class T>
  void put(const T& v) {
    auto b = encode(v);
    out.insert(out.end(), b.begin(), b.end());
  }
  void bytes(std::span<const std::byte> b) { out.insert(out.end(), b.begin(), b.end()); }
};

struct reader {
  std::span<const std::byte> in;
  std::size_t at = 0;
  bool ok = true;
  template <class T>
  T get() {
    if (in.size() - at < sizeof(T)) {
      ok = false;
      return T{};
    }
    T v = decode<T>(in.subspan(at, sizeof(T)));
    at += sizeof(T);
    return v;
  }
  std::span<const std::byte> bytes(std::size_t n) {
    if (in.size() - at < n) {
      ok = false;
      return {};
    }
    auto s = in.subspan(at, n);
    at += n;
    return s;
  }
};

}  // namespace refit::ucx::wire
