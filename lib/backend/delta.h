// Delta encodings of one bucket's bytes against a base the receiver already holds.
//
// An RL step changes few bf16 elements of a policy (docs/delta.md has the measured
// fractions), so an update can be sent as what changed since a base version. Per
// bucket (or per planned box), encode() picks the smallest of:
//
//   full      the bytes themselves (nothing smaller was found)
//   sparse    per changed element: the gap to the previous changed element (LEB128,
//             0 for the next one) and its new value (elem bytes)
//   bitmap    one bit per element (LSB first), then the changed elements' new values
//             in order
//   xor_zstd  (next XOR base) compressed by zstd (level 1 by default) in one frame
//             whose header carries the content size
//   xor_planes  the changed elements' bitmap and, for each byte j of an element,
//             the plane of byte j of (next XOR base) over the changed elements only,
//             each stream one zstd frame (elements of 2 bytes or more). An
//             optimizer's small moves leave the high planes nearly all zeros and the
//             bitmap and low plane short: smaller than xor_zstd on measured
//             trajectories (docs/delta.md) and several times faster, since zstd
//             sees a fraction of the bytes. Layout (u64s little-endian): the
//             number of changed elements, the frame bytes of the bitmap, then of
//             each plane, then the frames in that order. It is made in the same
//             pass that counts the changes (and dropped when another form is
//             smaller).
//
// Elements are `elem` bytes (2 for bf16/fp16, 4 for fp32, ...); a changed element
// is one whose bytes differ. Both sides work in bounded memory: xor_zstd streams
// through a 256 KiB scratch buffer, never a second copy of the bucket. Decoding
// checks everything a corrupt or hostile payload could get wrong (a gap past the
// end, values missing or left over, a frame of the wrong size) and throws
// error(protocol_error) before or instead of writing past `out`; `out` may be the
// base itself (decode in place), and a payload that fails to decode may leave `out`
// partly written (callers decode into a stage, or mark the target dirty).
//
// Rates on this project's machine: tests/bench/delta_bench.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace refit::backend::delta {

enum class encoding : std::uint8_t { full = 0, sparse = 1, bitmap = 2, xor_zstd = 3, xor_planes = 4 };

/// "full", "sparse", "bitmap", "xor_zstd", "xor_planes".
std::string_view name(encoding e);
/// The encoding with that wire value; error(protocol_error) for any other.
encoding encoding_from_wire(std::uint8_t v);

struct encode_options {
  /// Whether to try the compressed encodings (xor_planes for elements of 2 bytes
  /// or more, else xor_zstd); each costs a compression pass.
  bool allow_zstd = true;
  /// Whether xor_planes may be used (else xor_zstd is tried in its place).
  bool allow_planes = true;
  /// Also try xor_zstd where xor_planes applies (the smaller wins; slower).
  bool zstd_with_planes = false;
  /// Compress xor_planes' streams with parameters tuned for them (zstd level -3,
  /// Huffman-coded literals, minimum match 7, hash log 8: faster than level 1 and
  /// no larger on measured streams, docs/delta.md); false: at zstd_level.
  bool fast_planes = true;
  /// zstd's level for xor_zstd (and for xor_planes without fast_planes).
  int zstd_level = 1;
  /// xor_zstd is tried only when the best of sparse, bitmap and xor_planes
  /// exceeds this fraction of the full bytes: below it they are already small and
  /// cheaper to make. (xor_planes costs no pass of its own: always tried.)
  double zstd_above_fraction = 0.02;
};

struct encode_result {
  encoding kind = encoding::full;
  /// Bytes appended to `out`.
  std::size_t bytes = 0;
  /// Elements whose bytes differ between base and next.
  std::size_t changed = 0;
};

/// Appends the smallest encoding of `next` against `base` to `out`. base and next
/// have the same size, a multiple of elem (1, 2, 4 or 8); error(invalid_argument)
/// otherwise.
encode_result encode(std::span<const std::byte> base, std::span<const std::byte> next, std::size_t elem,
                     std::vector<std::byte>& out, const encode_options& options = {});

/// Writes the bytes `payload` encodes against `base` into `out` (out.size() ==
/// base.size(); out may be base's memory). error(protocol_error) on a payload that
/// does not decode to exactly out.size() bytes.
void decode(encoding kind, std::span<const std::byte> payload, std::span<const std::byte> base,
            std::span<std::byte> out, std::size_t elem);

// ---- A bucket of pieces (engines/tcp's delta updates, docs/delta.md)
//
// A bucket holds pieces of several tensors, each in its own memory on the worker
// (the model's tensors, or the stage), so a delta bucket is encoded piece by
// piece: for each piece of non-zero size, in order, one record
//
//   u8 encoding | u64 payload bytes (little-endian) | payload (encode()'s output)
//
// and nothing else (the padding between pieces is zeros on both sides, not sent).

/// Bytes of one record's header.
inline constexpr std::size_t piece_header_bytes = 9;

/// The element size to encode a piece of a tensor with: the dtype's size when the
/// piece starts and ends on element boundaries (always, for the planner's pieces),
/// else 1.
std::size_t piece_elem(std::size_t dtype_size, std::uint64_t tensor_offset, std::uint64_t bytes);

struct piece_in {
  std::span<const std::byte> base;  ///< what the worker holds
  std::span<const std::byte> next;  ///< what it should hold; same size
  std::size_t elem = 1;
};
struct pieces_result {
  std::size_t bytes = 0;    ///< appended to `out`
  std::size_t changed = 0;  ///< elements that differ, over all pieces
};
/// Appends one record per non-empty piece to `out`.
pieces_result encode_pieces(std::span<const piece_in> pieces, std::vector<std::byte>& out,
                            const encode_options& options = {});

struct piece_out {
  std::span<const std::byte> base;  ///< the piece's current bytes (may be `out` itself)
  std::span<std::byte> out;         ///< where its new bytes go; same size
  std::size_t elem = 1;
};
/// Decodes what encode_pieces wrote for pieces of these sizes, piece by piece in
/// order. error(protocol_error) when a record is cut short, names an unknown
/// encoding, does not decode to its piece's size, or when records are missing or
/// left over; the pieces before the bad record are written by then.
void decode_pieces(std::span<const std::byte> payload, std::span<const piece_out> pieces);

}  // namespace refit::backend::delta
