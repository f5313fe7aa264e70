// The plan of a sharded transfer: from the trainer's placements and every worker's
// destination layout (lib/layout/layout.h), for each (trainer rank, worker) pair the
// ordered list of boxes that rank sends that worker. Each destination byte a piece
// covers comes exactly once, from one rank that holds it; a box several ranks hold
// (replicated) is sent by the one with the least egress so far (up to 16 holders;
// beyond, by the next holder in turn for that block position), so replicated
// tensors spread over their holders.
//
// Deterministic: it depends only on its inputs, so the trainer ranks and the
// workers each compute it and compare digests before any byte moves. Linear in
// the number of pieces (times the shards each piece touches), so it is computed
// once per layout and cached (plan_cache), not per update.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include <refit/layout/layout.h>

namespace refit {

/// One box moved from a trainer rank to a worker: box `src` of the rank's local
/// shard of source tensor `source` (local coordinates) lands at `dst_at` of the
/// worker's destination tensor `dest` (same extents). On the wire it is the box's
/// bytes in row-major order, so either side cuts it into its own contiguous runs.
struct transfer_item {
  std::uint32_t source = 0;  ///< index into source_layout::tensors
  std::uint32_t dest = 0;    ///< index into the worker's dest_layout::tensors
  box src;
  std::vector<std::int64_t> dst_at;
  std::uint64_t bytes = 0;
};

/// Everything one rank sends one worker, in order.
struct pair_plan {
  std::vector<transfer_item> items;
  std::uint64_t bytes = 0;
};

struct transfer_plan {
  int ranks = 0, workers = 0;
  /// pairs[rank * workers + worker].
  std::vector<pair_plan> pairs;
  std::vector<std::uint64_t> egress;   ///< bytes each rank sends
  std::vector<std::uint64_t> ingress;  ///< bytes each worker receives
  /// Digest of the inputs (placements, shapes, dtypes, every destination layout):
  /// equal digests mean equal plans.
  std::uint64_t digest = 0;

  const pair_plan& pair(int rank, int worker) const {
    return pairs.at(static_cast<std::size_t>(rank) * workers + worker);
  }
  std::uint64_t total_bytes() const;
};

/// Most boxes one plan may hold: layouts come from peers and users, and a mesh
/// that cuts every tensor into 2^20 blocks is an error, not gigabytes of plan.
inline constexpr std::uint64_t max_plan_items = 1ull << 24;

/// Digest of a plan's inputs (what transfer_plan::digest holds), without planning.
std::uint64_t layout_digest(const source_layout& source, std::span<const dest_layout> workers);

/// Plans the transfer. Validates both layouts first (invalid_argument naming the
/// worker, tensor and piece).
transfer_plan plan_transfer(const source_layout& source, std::span<const dest_layout> workers);

/// The last plan, reused while the layouts' digest is unchanged (thread-safe).
class plan_cache {
 public:
  /// The plan for these layouts: the cached one when their digest matches.
  std::shared_ptr<const transfer_plan> get(const source_layout& source, std::span<const dest_layout> workers);
  /// How many plans were computed (tests).
  std::uint64_t computed() const noexcept { return computed_; }

 private:
  std::mutex mutex_;
  std::shared_ptr<const transfer_plan> last_;
  std::uint64_t computed_ = 0;
};

}  // namespace refit
