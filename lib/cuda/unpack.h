// Batched unpack: many small device-to-device copies (a bucket's tensors into their
// destinations) in one kernel launch, because per-tensor launch and copy overhead,
// not bandwidth, is what makes small tensors slow.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <refit/cuda/event.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/memory.h>

namespace refit::cuda {

/// How many descriptors prepare_unpack_descriptors writes for `pieces`: one per
/// `chunk_bytes` (or part of it) of each piece; empty pieces need none.
[[nodiscard]] std::size_t unpack_descriptor_count(std::span<const piece> pieces,
                                                  std::uint64_t chunk_bytes = unpack_chunk_bytes);

/// Writes the kernel's descriptors for `pieces` into `out`, in order: each piece
/// split into consecutive chunks of at most `chunk_bytes` (chunk_bytes > 0, a
/// multiple of 16 so that chunks keep their piece's alignment), empty pieces
/// skipped. Returns the number written; throws refit::error(invalid_argument) if
/// `out` is smaller than unpack_descriptor_count(pieces, chunk_bytes). Pure host code.
std::size_t prepare_unpack_descriptors(std::span<const piece> pieces, std::span<piece> out,
                                       std::uint64_t chunk_bytes = unpack_chunk_bytes);

/// The low-level batch: prepares the descriptors into `host_scratch` (pinned memory,
/// at least unpack_descriptor_count(pieces) entries), copies them to
/// `device_scratch` (as many entries) on `stream` and launches the kernel there. The
/// caller keeps host_scratch unchanged until the copy has completed and
/// device_scratch until the kernel has; unpacker does that bookkeeping.
void unpack(std::span<const piece> pieces, std::span<piece> host_scratch, piece* device_scratch, cudaStream_t stream);

/// Batched unpack with its own scratch memory, reused across calls: a ring of
/// `slots` (pinned staging + device descriptors + an event), so that one call need
/// not wait for the previous one's kernel. A call blocks the host only when the
/// slot it reuses still has its batch queued, i.e. with `slots` batches pending.
/// Scratch grows to the largest batch seen and is never shrunk. Not thread-safe.
///
/// Its events and device scratch belong to `device` (-1: the device current at
/// construction) and are made there whatever device is current when it is made or
/// called; streams given to unpack() must be streams of that device.
class unpacker {
 public:
  explicit unpacker(std::size_t slots = 4, int device = -1);

  [[nodiscard]] int device() const noexcept { return device_; }

  /// Enqueues the copies of `pieces` on `stream` in one launch (plus one small
  /// host-to-device copy of the descriptors); `pieces` itself may be reused as soon
  /// as this returns. Source and destination memory must stay valid until the
  /// stream passes this point. Throws cuda_error.
  void unpack(std::span<const piece> pieces, cudaStream_t stream);

 private:
  struct slot {
    pinned_buffer host;
    device_buffer device;
    std::size_t capacity = 0;  // descriptors
    event done;                // recorded after the kernel
    bool used = false;
  };
  int device_;
  std::vector<slot> slots_;
  std::size_t next_ = 0;
};

}  // namespace refit::cuda
