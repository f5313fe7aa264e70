// Per-update statistics every engine reports after receive_weights.
#pragma once

#include <cstdint>

#include <refit/json.h>

namespace refit {

/// What one update moved and where its time went. Times are seconds of wall clock.
struct update_stats {
  std::uint64_t bytes = 0;    ///< tensor bytes received (padding not counted)
  std::uint64_t tensors = 0;  ///< tensors handed to load_weights
  std::uint64_t buckets = 0;  ///< buckets received
  /// Payload bytes that crossed the wire to this worker (padding included): bucket
  /// payloads, or their encoded size where they came as deltas (docs/delta.md).
  /// A worker's figure; 0 in a sender's last_send_stats().
  std::uint64_t wire_bytes = 0;
  double wall_s = 0;     ///< from receive start to the end of processing
  double receive_s = 0;  ///< time spent waiting on the transport
  double process_s = 0;  ///< time spent in post-processing (load_weights)
  /// Fraction of the shorter of receive/process hidden under the other:
  /// (receive_s + process_s - wall_s) / min(receive_s, process_s), clamped to [0, 1].
  double overlap = 0;
  double gbps = 0;  ///< bytes / wall_s / 1e9

  /// Fills overlap and gbps from the other members.
  void finalize();
  json to_json() const;
};

}  // namespace refit
