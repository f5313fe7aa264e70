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

enum class encoding : std::uint8_t { full = 0, sparse = 1, bitmap = 2, xor_zstd = 3 };

/// "full", "sparse", "bitmap", "xor_zstd".
std::string_view name(encoding e);
/// The encoding with that wire value; error(protocol_error) for any other.
encoding encoding_from_wire(std::uint8_t v);

struct encode_options {
  /// Whether to try xor_zstd (it costs a compression pass over the bucket).
  bool allow_zstd = true;
  int zstd_level = 1;
  /// xor_zstd is tried only when the best of sparse and bitmap exceeds this fraction
  /// of the full bytes: below it they are already small and cheaper to make.
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

}  // namespace refit::backend::delta
