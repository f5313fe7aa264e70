// What the simulation charges besides the network, each from a measurement of this
// project (docs/bench/*.json) or calibrated on one row of the emulated-network runs
// and then checked on the others (docs/scale.md, "Calibration").
#pragma once

#include <string>
#include <vector>

namespace refit::sim {

/// The delta codec at one change fraction (tests/bench/delta_bench.cc, one core).
struct delta_rates {
  double fraction = 0;  ///< elements changed
  double encode_bytes_per_s = 0;
  double decode_bytes_per_s = 0;
  double wire_fraction = 0;  ///< encoded bytes / full bytes
};

struct costs {
  /// Goodput / line rate of one stream on an otherwise idle link, per engine
  /// (calibrated: star with one worker).
  double tcp_efficiency = 1;
  double ucx_efficiency = 1;
  /// The trainer copying a bucket into its staging slot (memcpy, one core).
  double pack_bytes_per_s = 10e9;
  /// XXH3-64 of a bucket, one core (trainer and every worker).
  double checksum_bytes_per_s = 10e9;
  /// A host's network stack per byte received (twice for a byte also forwarded):
  /// the kernel's copies, on the shared cores where processes share a machine.
  double stack_bytes_per_s = 1e18;
  /// A staged commit: the stage copied into the model, pages touched first.
  double commit_bytes_per_s = 2e9;
  /// The delta codec by change fraction, sorted by fraction.
  std::vector<delta_rates> delta;
  /// Where each number came from (printed with every prediction).
  std::vector<std::string> sources;

  /// The codec at `fraction`, linearly interpolated between measured fractions
  /// (clamped at the ends).
  delta_rates delta_at(double fraction) const;
};

}  // namespace refit::sim
