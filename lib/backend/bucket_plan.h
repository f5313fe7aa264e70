// How an update's tensors are cut into buckets. The trainer and every worker run
// the same function on the same inputs (the update's metadata and the wire
// parameters fixed at init), so both sides agree on every byte's place without
// sending a per-bucket table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <refit/json_reader.h>
#include <refit/metadata.h>

namespace refit {

/// Wire parameters, chosen by the trainer and shipped once at init.
struct wire_params {
  /// Bytes per staging buffer, and so the largest bucket payload.
  std::uint64_t buffer_bytes = 64ull << 20;
  /// Staging buffers per worker: how many buckets may be in flight or processing.
  std::uint32_t num_buffers = 2;
  /// Per-bucket checksums (XXH3-64 of the payload), verified by every receiver.
  bool checksums = false;

  /// Tensor offsets inside a packed bucket are aligned to this, so views handed to
  /// load_weights are aligned for any dtype and for vector loads.
  static constexpr std::uint64_t alignment = 64;

  /// Throws invalid_argument unless 4 KiB <= buffer_bytes <= 16 GiB and
  /// 1 <= num_buffers <= 64.
  void validate() const;
  /// Reads optional members "buffer_bytes", "num_buffers" and "checksums"
  /// (defaults above).
  static wire_params read(json_reader& reader);
  void write(json& out) const;
  friend bool operator==(const wire_params&, const wire_params&) = default;
};

/// One contiguous byte range of one tensor inside a bucket.
struct bucket_piece {
  std::uint32_t tensor = 0;         ///< index into update_metadata::tensors
  std::uint64_t tensor_offset = 0;  ///< first byte of the tensor this piece carries
  std::uint64_t bucket_offset = 0;  ///< where the piece starts in the bucket payload
  std::uint64_t bytes = 0;
};

/// A unit of transfer. A packed bucket carries whole tensors at aligned offsets (the
/// payload is the staging slot's image, padding included); a split bucket carries
/// one chunk of a tensor larger than a buffer.
struct bucket {
  std::uint64_t index = 0;
  std::uint64_t payload_bytes = 0;  ///< bytes on the wire for this bucket
  std::uint32_t first_piece = 0, piece_count = 0;
  bool split = false;       ///< a chunk of an oversized tensor
  bool last_chunk = false;  ///< split only: this chunk completes its tensor
};

/// The buckets of one update.
struct bucket_plan {
  std::vector<bucket> buckets;
  std::vector<bucket_piece> pieces;
  std::uint64_t tensor_bytes = 0;   ///< sum of tensor sizes
  std::uint64_t payload_bytes = 0;  ///< sum of bucket payloads (with padding)
  /// Size of the largest tensor that had to be split (0 if none): the receiver's
  /// assembly buffer.
  std::uint64_t largest_split_tensor = 0;

  std::span<const bucket_piece> pieces_of(const bucket& b) const {
    return {pieces.data() + b.first_piece, b.piece_count};
  }
};

/// Most buckets one update may be cut into. Sizes come from metadata a peer
/// declares: a 1 TiB tensor in 4 KiB buckets is an error, not 2^28 bucket records
/// (10 GiB of plan). 2^22 buckets of the default 64 MiB carry 256 TiB.
inline constexpr std::uint64_t max_buckets = 1ull << 22;

/// Cuts `meta` into buckets of at most params.buffer_bytes. Deterministic: depends
/// only on its arguments. Zero-byte tensors ride in packed buckets. More than
/// max_buckets buckets is invalid_argument, thrown before they are allocated.
bucket_plan plan_buckets(const update_metadata& meta, const wire_params& params);

}  // namespace refit
