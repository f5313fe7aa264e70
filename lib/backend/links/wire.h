// The side-channel protocol of group engines (tcp, nccl): one TCP connection per
// worker to the trainer. Fixed little-endian headers; every length is checked
// against what the receiver's own plan expects before a byte of payload is read,
// so a corrupt or mismatched stream is a typed error.
//
//   (authentication, lib/integrity/auth.h)
//   worker -> trainer   hello        {rank, wire params, relay port}
//   trainer -> worker   status       (ok with the welcome text, or why the worker is refused)
//   relay topologies (lib/backend/links/relay.h), once every worker has joined:
//   trainer -> worker   status       (its place: upstream and children, JSON)
//   worker -> upstream  (authentication, hello) on the upstream's relay port; the
//                       per-update messages below then flow trainer -> children ->
//                       their children, and statuses back up, each aggregating its
//                       subtree
//   per update:
//   trainer -> worker   update       {seq, metadata digest, tensors, buckets, bytes}
//                       tcp star with deltas on (flags: update_flag_delta): a
//                       delta_header {version, base version and fingerprint} follows
//   worker -> trainer   status       (ok, or why the metadata differ)
//   deltas on:
//   worker -> trainer   status       (ok: it holds that base, send deltas; invalid_state:
//                       it does not, send every bucket full; docs/delta.md)
//   the buckets         tcp: bucket header + payload on this connection;
//                       nccl: broadcasts on the communicator
//   worker -> trainer   status       (every byte arrived)
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace refit::links::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr std::uint32_t protocol_version = 1;
inline constexpr std::uint32_t hello_magic = 0x48544652;   // "RFTH"
inline constexpr std::uint32_t status_magic = 0x53544652;  // "RFTS"
inline constexpr std::uint32_t update_magic = 0x55544652;  // "RFTU"
inline constexpr std::uint32_t bucket_magic = 0x42544652;  // "RFTB"
inline constexpr std::uint32_t delta_magic = 0x44544652;   // "RFTD"
/// Longest status message accepted; longer is a protocol error, not an allocation.
inline constexpr std::uint32_t max_message = 4096;

/// hello.flags and bucket_header.flags: the payload carries a checksum.
inline constexpr std::uint32_t flag_checksum = 1;
/// bucket_header.flags: the payload is the bucket's pieces delta-encoded against the
/// base the update's delta_header names (delta::encode_pieces), fewer bytes than
/// the plan's; the checksum covers the decoded bytes.
inline constexpr std::uint32_t flag_delta = 2;
/// update.flags: a delta_header follows the update header.
inline constexpr std::uint32_t update_flag_delta = 1;
/// delta_header.flags: the trainer holds a base and offers deltas against it.
inline constexpr std::uint32_t delta_flag_has_base = 1;

struct hello {
  std::uint32_t magic = hello_magic;
  std::uint32_t version = protocol_version;
  std::uint32_t rank = 0;
  std::uint32_t num_buffers = 0;
  std::uint64_t buffer_bytes = 0;
  std::uint32_t flags = 0;
  std::uint32_t relay_port = 0;  ///< where downstream workers connect (relay topologies); 0: none
};

/// Followed by message_bytes of UTF-8 text.
struct status {
  std::uint32_t magic = status_magic;
  std::uint32_t code = 0;  ///< 0 or a refit::errc
  std::uint64_t seq = 0;   ///< the update this answers (0 for hello)
  std::uint32_t message_bytes = 0;
  std::uint32_t reserved = 0;
};

struct update {
  std::uint32_t magic = update_magic;
  std::uint32_t flags = 0;  ///< update_flag_delta or 0
  std::uint64_t seq = 0;
  std::uint64_t digest = 0;
  std::uint64_t tensors = 0;
  std::uint64_t buckets = 0;
  std::uint64_t payload_bytes = 0;
};

struct bucket_header {
  std::uint32_t magic = bucket_magic;
  std::uint32_t flags = 0;
  std::uint64_t index = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t checksum = 0;  ///< XXH3-64 of the payload when flags has flag_checksum
};

/// Follows an update header with update_flag_delta (engines/tcp, star): which
/// version this update makes and which base its deltas are against.
struct delta_header {
  std::uint32_t magic = delta_magic;
  std::uint32_t flags = 0;             ///< delta_flag_has_base or 0 (this update is sent full)
  std::uint64_t version = 0;           ///< the trainer's version of the bytes this update brings
  std::uint64_t base_version = 0;      ///< with has_base: the version the deltas are against
  std::uint64_t base_fingerprint = 0;  ///< with has_base: that version's fingerprint
};

// The structs have no padding, so their bytes are the wire bytes.
static_assert(sizeof(hello) == 32 && sizeof(status) == 24 && sizeof(update) == 48 && sizeof(bucket_header) == 32 &&
              sizeof(delta_header) == 32);

template <class T>
std::array<std::byte, sizeof(T)> encode(const T& v) {
  std::array<std::byte, sizeof(T)> out;
  std::memcpy(out.data(), &v, sizeof(T));
  return out;
}

template <class T>
T decode(const std::array<std::byte, sizeof(T)>& in) {
  T v;
  std::memcpy(&v, in.data(), sizeof(T));
  return v;
}

/// Checks a bucket header against what the receiver's plan expects: bucket
/// `expected_index` of `expected_bytes`, carrying a checksum exactly when `checksums`.
/// Returns "" when it matches, else what differs (the caller adds who and throws
/// protocol_error). The checksum value itself is checked after the payload.
inline std::string check_bucket_header(const bucket_header& h, std::uint64_t expected_index,
                                       std::uint64_t expected_bytes, bool checksums) {
  if (h.magic != bucket_magic) return "expected a bucket header, got magic " + std::to_string(h.magic);
  if (h.index != expected_index || h.payload_bytes != expected_bytes)
    return "expected bucket " + std::to_string(expected_index) + " of " + std::to_string(expected_bytes) +
           " bytes, trainer sent bucket " + std::to_string(h.index) + " of " + std::to_string(h.payload_bytes);
  if (((h.flags & flag_checksum) != 0) != checksums) return "checksum flag differs from the wire parameters";
  return {};
}

/// Checks a bucket header of an update that announced a delta_header: as
/// check_bucket_header, except that with flag_delta (allowed only when the worker
/// accepted the deltas, `delta_accepted`) the payload is fewer bytes than
/// `expected_bytes`. Unknown flags are refused.
inline std::string check_delta_bucket_header(const bucket_header& h, std::uint64_t expected_index,
                                             std::uint64_t expected_bytes, bool checksums, bool delta_accepted) {
  if (h.magic != bucket_magic) return "expected a bucket header, got magic " + std::to_string(h.magic);
  if ((h.flags & ~(flag_checksum | flag_delta)) != 0) return "unknown bucket flags " + std::to_string(h.flags);
  if (((h.flags & flag_checksum) != 0) != checksums) return "checksum flag differs from the wire parameters";
  if ((h.flags & flag_delta) == 0) return check_bucket_header(h, expected_index, expected_bytes, checksums);
  if (!delta_accepted) return "a delta bucket in an update this worker takes full";
  if (h.index != expected_index || h.payload_bytes >= expected_bytes)
    return "expected bucket " + std::to_string(expected_index) + " as a delta of fewer than " +
           std::to_string(expected_bytes) + " bytes, trainer sent bucket " + std::to_string(h.index) + " of " +
           std::to_string(h.payload_bytes);
  return {};
}

/// Checks a delta_header. Returns "" when it is well formed, else what is wrong.
inline std::string check_delta_header(const delta_header& d) {
  if (d.magic != delta_magic) return "expected a delta header, got magic " + std::to_string(d.magic);
  if ((d.flags & ~delta_flag_has_base) != 0) return "unknown delta header flags " + std::to_string(d.flags);
  if (d.version == 0) return "delta header names version 0";
  if ((d.flags & delta_flag_has_base) != 0 && (d.base_version == 0 || d.base_version >= d.version))
    return "delta header: base version " + std::to_string(d.base_version) + " is not before version " +
           std::to_string(d.version);
  if ((d.flags & delta_flag_has_base) == 0 && (d.base_version != 0 || d.base_fingerprint != 0))
    return "delta header names a base without offering deltas";
  return {};
}

/// What the receiver expects of an update header: its own view of the update.
struct update_expectation {
  std::uint64_t last_seq = 0;  ///< the last update accepted (0: none yet)
  std::uint64_t tensors = 0;
  std::uint64_t digest = 0;   ///< metadata_digest of its update info
  std::uint64_t buckets = 0;  ///< of its own bucket plan
  std::uint64_t payload_bytes = 0;
};

/// Checks an update header's magic. Returns "" when it is one, else what came. A
/// wrong magic means the stream is out of step: nothing is answered.
inline std::string check_update_magic(const update& u) {
  if (u.magic == update_magic) return {};
  return "expected an update header, got magic " + std::to_string(u.magic);
}

/// Checks an update header (magic already checked) against the receiver's
/// expectation. Returns "" when it matches, else the mismatch, which the receiver
/// sends back in its status before failing with protocol_error.
inline std::string check_update_header(const update& u, const update_expectation& e) {
  if (u.seq <= e.last_seq)
    return "update sequence " + std::to_string(u.seq) + " is not after " + std::to_string(e.last_seq);
  if (u.tensors != e.tensors)
    return "trainer sends " + std::to_string(u.tensors) + " tensors, this update_info declares " +
           std::to_string(e.tensors);
  if (u.digest != e.digest) return "tensor names, dtypes or shapes differ between the trainer and this update_info";
  if (u.buckets != e.buckets)
    return "bucket plans differ: the trainer cuts the update into " + std::to_string(u.buckets) +
           " buckets, this worker into " + std::to_string(e.buckets) + " (are both on the same refit version?)";
  if (u.payload_bytes != e.payload_bytes)
    return "bucket plans differ: the trainer's " + std::to_string(u.buckets) + " buckets carry " +
           std::to_string(u.payload_bytes) + " payload bytes, this worker's " + std::to_string(e.payload_bytes) +
           " (alignment or padding differ: are both on the same refit version?)";
  return {};
}

}  // namespace refit::links::wire
