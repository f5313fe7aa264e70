// The trainer's side of the bucket plan: walks the tensors a trainer iterates,
// checks each against what it declared, and yields each bucket's payload as a list
// of buffers pointing into the trainer's own tensors (gather writes: nothing is
// copied into a packing buffer).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include <asio/buffer.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/trainer.h>

namespace refit {

/// Not thread-safe; one per send.
class send_cursor {
 public:
  /// `declared`, `plan` and `source` must outlive the cursor. Tensors must be host
  /// memory unless `allow_device` (for engines that move device memory).
  send_cursor(const update_metadata& declared, const bucket_plan& plan, tensor_source& source,
              bool allow_device = false);

  /// Buffers that make up bucket `b`'s payload, in order, padding included. Pulls
  /// the tensors `b` needs from the source and checks them against the declaration
  /// (the first divergent parameter is named). Buckets must be asked in order; the
  /// returned list is valid until the next call.
  const std::vector<asio::const_buffer>& gather(const bucket& b);

  /// The source's tensor for index `i` (pulled already).
  const tensor_view& view(std::size_t i) const { return views_.at(i); }

  /// Call after the last bucket: throws invalid_argument when the source yields
  /// more tensors than were declared (or fewer, if no bucket asked for them).
  void finish();

 private:
  const tensor_view& pull(std::size_t index);
  void append(const void* data, std::size_t bytes);

  const update_metadata& declared_;
  const bucket_plan& plan_;
  tensor_source& source_;
  bool allow_device_;
  std::vector<tensor_view> views_;
  std::vector<asio::const_buffer> buffers_;
};

/// Copies `pieces` (a gather list, e.g. send_cursor::gather's) back to back into
/// host memory at `dst`; returns the bytes copied.
std::size_t pack_pieces(std::span<const asio::const_buffer> pieces, std::byte* dst);

}  // namespace refit
