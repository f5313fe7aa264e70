// The bytes of one (trainer rank, worker) pair of a transfer plan as the two sides
// see them: the trainer reads each item's box out of its local shards, the worker
// writes it into its destination tensors, both as lists of contiguous runs over the
// same byte sequence, cut into frames of at most a buffer each (a frame is what a
// checksum covers and a header announces).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <refit/layout/transfer_plan.h>

namespace refit {

/// A contiguous range of memory.
struct byte_run {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

/// Where an item's tensor lives on this side: its memory and its (local) shape.
struct tensor_place {
  std::byte* data = nullptr;
  std::span<const std::int64_t> shape;
  std::size_t element = 1;
};

/// Which box of an item this side walks.
enum class item_side { source, destination };

/// The runs of `items` in order on one side; `place(item)` says where that item's
/// tensor lives. Adjacent runs that touch are merged.
std::vector<byte_run> pair_runs(std::span<const transfer_item> items, item_side side,
                                const std::function<tensor_place(const transfer_item&)>& place);

/// One frame: its runs (the first and last possibly cut) and their total.
struct stream_frame {
  std::vector<byte_run> runs;
  std::uint64_t bytes = 0;
};

/// Cuts `runs` into frames of at most `frame_bytes` (the last smaller). No frames
/// for no bytes.
std::vector<stream_frame> cut_frames(std::span<const byte_run> runs, std::uint64_t frame_bytes);

/// How many frames cut_frames makes of `bytes` (what the other side expects).
inline std::uint64_t frame_count(std::uint64_t bytes, std::uint64_t frame_bytes) {
  return (bytes + frame_bytes - 1) / frame_bytes;
}

}  // namespace refit
