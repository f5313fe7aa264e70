// A sharded transfer plan (lib/layout/transfer_plan.h) as grouped point-to-point sends and
// receives on a collective: the NCCL form of tcp_sharded. Communicator ranks are
// the trainer ranks 0 .. M-1, then the workers M .. M+N-1. Every pair's stream is
// cut into frames of at most frame_bytes (lib/backend/shard_io.h); frame k of every pair
// goes in one group (ncclGroupStart/End), so staging is one frame per peer: N
// frames on a trainer rank (packed from its shards by the provider: a device
// gather under NCCL), M on a worker (scattered into its tensors after each group).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>

#include <asio/awaitable.hpp>

#include <refit/backend/shard_io.h>
#include <refit/engines/nccl/collective.h>
#include <refit/layout/transfer_plan.h>

namespace refit::nccl {

/// The communicator rank of trainer rank `r` and of worker `w`.
inline int trainer_comm_rank(const transfer_plan&, int r) { return r; }
inline int worker_comm_rank(const transfer_plan& plan, int w) { return plan.ranks + w; }

/// How many grouped exchanges an update takes: the most frames any pair has.
std::uint64_t exchange_rounds(const transfer_plan& plan, std::uint64_t frame_bytes);

/// Trainer rank `rank`'s part of one update. `shards[i]` is where its local shard
/// of source tensor i lives (local shapes); `staging` has at least plan.workers
/// slots of at least frame_bytes in the provider's memory.
asio::awaitable<void> send_sharded(collective& comm, collective_provider& provider, staging_memory& staging,
                                   const transfer_plan& plan, int rank, std::span<const tensor_place> shards,
                                   std::uint64_t frame_bytes, std::chrono::milliseconds deadline);

/// Worker `worker`'s part. `dest[t]` is its destination tensor t (host memory: the
/// scatter is a host copy here); `staging` has at least plan.ranks slots.
asio::awaitable<void> receive_sharded(collective& comm, staging_memory& staging, const transfer_plan& plan, int worker,
                                      std::span<const tensor_place> dest, std::uint64_t frame_bytes,
                                      std::chrono::milliseconds deadline);

}  // namespace refit::nccl
