// A stream engine's update (tcp, ucx: one trainer, N workers, a relay topology)
// played on SimGrid: refit's own bucket plan (plan_buckets) and relay topology
// (links::topology) drive SimGrid communications and computations, and the costs
// that are not the network's (packing, checksums, the delta codec, staged commits)
// come from this project's measured benchmarks (costs.h).
//
// The model, one actor per role:
//   - the trainer packs each bucket (and hashes it, with checksums; encodes it,
//     with deltas) into one of num_buffers staging slots, ahead of the stream;
//   - one sender per edge of the topology (parent -> child) writes the stream's
//     pieces in order, one SimGrid communication each: a relay edge forwards each
//     piece as soon as its parent has it (tcp: cut-through, net::loop_bytes_per_call
//     pieces) or each bucket once whole (ucx: store and forward);
//   - one receiver per worker takes its pieces in order; a processor per worker
//     verifies, copies or decodes each bucket once whole, then commits a staged
//     update.
// The update ends when every worker has processed (and committed) everything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/relay.h>
#include <refit/metadata.h>

#include "tools/simulate/costs.h"
#include "tools/simulate/report.h"

namespace refit::sim {

/// Hosts with one NIC each (a rate each way) joined by one switch: the emulated
/// network of tests/bench/netns_scale.sh, and the first approximation of one rail
/// of a cluster. `cores` > 0: every process shares that many cores (netns_scale
/// runs all of them on one machine); 0: each host has cores of its own.
struct switch_platform {
  double nic_bits_per_s = 1e9;
  double latency_s = 0;
  int cores = 0;
};

struct stream_options {
  std::string engine = "tcp";  ///< "tcp" (cut-through relay) or "ucx" (store and forward)
  links::topology topology;    ///< star, chain or tree:K (refit's own parent/children)
  wire_params wire;            ///< buffer_bytes, num_buffers, checksums
  bool staged = false;         ///< commit=staged: the stage is copied into the model at the end
  bool direct_receive = true;  ///< the payload lands in the model (no copy per bucket)
  double delta_fraction = 0;   ///< > 0: a delta update changing this fraction of the elements
};

/// One update of `meta` to `workers` workers; throws invalid_argument on options
/// it cannot model. Runs SimGrid in this process: one simulation per process
/// (SimGrid's engine cannot be made twice); run_isolated() runs one in a child.
prediction simulate_stream(const update_metadata& meta, int workers, const stream_options& options,
                           const switch_platform& platform, const costs& costs);

}  // namespace refit::sim
