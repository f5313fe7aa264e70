// A sharded update (tcp_sharded, ucx_sharded: M trainer ranks to N workers) played
// on SimGrid: refit's own planner (plan_transfer over the trainer's DTensor layout
// and each worker's tensor- and expert-parallel layout) says which bytes go from
// which rank to which worker; SimGrid moves them on a cluster of GPUs with one NIC
// each.
//
// The model: every trainer rank streams each of its pairs' bytes to that worker
// in buckets of buffer_bytes, packing the next round's buckets (a device copy)
// while the current round moves; every worker unpacks each round's buckets (a
// device copy) as they land; with checksums every bucket is hashed on both sides
// (XXH3 on the codec's cores), and a staged update is committed at the end. A
// round is one bucket of every pair that still has
// bytes, so ranks and workers proceed in step per round: at most two rounds are
// in flight, as two staging slots allow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <refit/backend/bucket_plan.h>
#include <refit/layout/layout.h>
#include <refit/metadata.h>
#include "tools/simulate/costs.h"
#include "tools/simulate/report.h"

namespace refit::sim {

/// GPUs with one NIC each (`nic_bits_per_s` each way) on a fat tree, non-blocking
/// by default (each NIC is its own limit); trainer and inference GPUs on different
/// nodes, so every byte crosses two NICs (and, oversubscribed, two node uplinks).
struct cluster_platform {
  double nic_bits_per_s = 400e9;
  double latency_s = 5e-6;
  /// A device copy (packing a bucket from shards, unpacking it into the model).
  double device_copy_bytes_per_s = 1e12;
  /// Nodes of `gpus_per_node` GPUs (trainer ranks and workers each numbered into
  /// nodes in order); with `oversubscription` > 1 each node's traffic also crosses
  /// its uplink to the fat tree, of gpus_per_node * NIC / oversubscription.
  int gpus_per_node = 8;
  double oversubscription = 1;
  /// A SimGrid platform file (XML, or a .so SimGrid loads) in place of the fabric
  /// above: it must have hosts trainer0 .. trainer<M-1> and worker0 ..
  /// worker<N-1>; nic_bits_per_s is then only what the limit is computed with.
  std::string file;
};

/// The trainer's DTensor placements over its mesh: FSDP is {M} with {shard(0)},
/// HSDP {R, S} with {replicate, shard(0)}.
struct trainer_layout {
  std::vector<std::int64_t> mesh{1};
  std::vector<placement> placements{placement::shard(0)};
};

/// The inference side: `replicas` copies of the model, each over `tp` workers
/// (vLLM's tensor parallelism for dense weights; routed experts split whole over
/// the same `tp` ranks, expert-parallel, expert e on rank e % tp).
struct worker_layout {
  int replicas = 1;
  int tp = 1;
};

struct sharded_options {
  std::string engine = "ucx_sharded";  ///< or tcp_sharded (the efficiency differs)
  wire_params wire;
  /// > 0: a delta update changing this fraction of the elements: each rank
  /// encodes what it sends (costs.h's codec at this fraction, on `codec_cores`
  /// cores of its own), each worker decodes and hashes what it gets.
  double delta_fraction = 0;
  int codec_cores = 1;
  /// commit=staged: each worker's stage is copied into its model at the end (a
  /// device copy of everything it received).
  bool staged = false;
};

/// Each worker's layout for `global` (see worker_layout).
std::vector<dest_layout> worker_layouts(const update_metadata& global, const worker_layout& workers);

prediction simulate_sharded(const update_metadata& global, const trainer_layout& trainer, const worker_layout& workers,
                            const sharded_options& options, const cluster_platform& platform, const costs& costs);

}  // namespace refit::sim
