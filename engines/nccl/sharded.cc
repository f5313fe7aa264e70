#include <refit/engines/nccl/sharded.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <refit/error.h>

namespace refit::nccl {

namespace {

std::vector<stream_frame> frames_of(const transfer_plan& plan, int rank, int worker, item_side side,
                                    std::span<const tensor_place> places, std::uint64_t frame_bytes) {
  const auto& items = plan.pair(rank, worker).items;
  const auto runs = pair_runs(
      items, side, [&](const transfer_item& it) { return places[side == item_side::source ? it.source : it.dest]; });
  return cut_frames(runs, frame_bytes);
}

void check_staging(staging_memory& staging, int slots, std::uint64_t frame_bytes, const char* who) {
  if (static_cast<int>(staging.slot_count()) < slots || (slots > 0 && staging.slot(0).size() < frame_bytes))
    throw_error(errc::invalid_argument, std::string(who) + ": staging has " + std::to_string(staging.slot_count()) +
                                            " slots, the exchange needs " + std::to_string(slots) + " of " +
                                            std::to_string(frame_bytes) + " bytes");
}

}  // namespace

std::uint64_t exchange_rounds(const transfer_plan& plan, std::uint64_t frame_bytes) {
  std::uint64_t n = 0;
  for (const auto& p : plan.pairs) n = std::max(n, frame_count(p.bytes, frame_bytes));
  return n;
}

asio::awaitable<void> send_sharded(collective& comm, collective_provider& provider, staging_memory& staging,
                                   const transfer_plan& plan, int rank, std::span<const tensor_place> shards,
                                   std::uint64_t frame_bytes, std::chrono::milliseconds deadline) {
  check_staging(staging, plan.workers, frame_bytes, "nccl sharded send");
  std::vector<std::vector<stream_frame>> frames(plan.workers);
  for (int w = 0; w < plan.workers; ++w) frames[w] = frames_of(plan, rank, w, item_side::source, shards, frame_bytes);
  const auto rounds = exchange_rounds(plan, frame_bytes);
  std::vector<p2p_op> ops;
  std::vector<asio::const_buffer> pieces;
  for (std::uint64_t k = 0; k < rounds; ++k) {
    ops.clear();
    for (int w = 0; w < plan.workers; ++w) {
      if (k >= frames[w].size()) continue;
      const auto& f = frames[w][k];
      pieces.clear();
      for (const auto& r : f.runs) pieces.emplace_back(r.data, r.bytes);
      std::byte* slot = staging.slot(w).data();
      co_await provider.pack(pieces, slot);
      ops.push_back({p2p_op::kind::send, worker_comm_rank(plan, w), slot, f.bytes});
    }
    co_await comm.exchange(ops, deadline);
  }
}

asio::awaitable<void> receive_sharded(collective& comm, staging_memory& staging, const transfer_plan& plan, int worker,
                                      std::span<const tensor_place> dest, std::uint64_t frame_bytes,
                                      std::chrono::milliseconds deadline) {
  check_staging(staging, plan.ranks, frame_bytes, "nccl sharded receive");
  if (staging.device() != device::cpu())
    throw_error(errc::unsupported,
                "nccl sharded receive: the scatter into the worker's tensors is a host copy; "
                "device staging is not supported yet");
  std::vector<std::vector<stream_frame>> frames(plan.ranks);
  for (int r = 0; r < plan.ranks; ++r)
    frames[r] = frames_of(plan, r, worker, item_side::destination, dest, frame_bytes);
  const auto rounds = exchange_rounds(plan, frame_bytes);
  std::vector<p2p_op> ops;
  for (std::uint64_t k = 0; k < rounds; ++k) {
    ops.clear();
    for (int r = 0; r < plan.ranks; ++r)
      if (k < frames[r].size())
        ops.push_back({p2p_op::kind::recv, trainer_comm_rank(plan, r), staging.slot(r).data(), frames[r][k].bytes});
    co_await comm.exchange(ops, deadline);
    for (int r = 0; r < plan.ranks; ++r) {
      if (k >= frames[r].size()) continue;
      const std::byte* from = staging.slot(r).data();
      for (const auto& run : frames[r][k].runs) {
        std::memcpy(run.data, from, run.bytes);
        from += run.bytes;
      }
    }
  }
}

}  // namespace refit::nccl
