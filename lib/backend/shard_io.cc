#include <refit/backend/shard_io.h>

#include <algorithm>

#include <refit/error.h>

namespace refit {

std::vector<byte_run> pair_runs(std::span<const transfer_item> items, item_side side,
                                const std::function<tensor_place(const transfer_item&)>& place) {
  std::vector<byte_run> runs;
  for (const auto& item : items) {
    const tensor_place p = place(item);
    const box b = side == item_side::source ? item.src : box{item.dst_at, item.src.extent};
    for_each_run(p.shape, b, p.element, [&](std::uint64_t offset, std::uint64_t bytes) {
      std::byte* at = p.data + offset;
      if (!runs.empty() && runs.back().data + runs.back().bytes == at)
        runs.back().bytes += bytes;
      else
        runs.push_back({at, bytes});
    });
  }
  return runs;
}

std::vector<stream_frame> cut_frames(std::span<const byte_run> runs, std::uint64_t frame_bytes) {
  if (frame_bytes == 0) throw_error(errc::invalid_argument, "cut_frames: frames of 0 bytes");
  std::vector<stream_frame> frames;
  stream_frame current;
  for (auto run : runs) {
    while (run.bytes > 0) {
      const auto take = std::min(run.bytes, frame_bytes - current.bytes);
      current.runs.push_back({run.data, take});
      current.bytes += take;
      run.data += take;
      run.bytes -= take;
      if (current.bytes == frame_bytes) {
        frames.push_back(std::move(current));
        current = {};
      }
    }
  }
  if (current.bytes > 0) frames.push_back(std::move(current));
  return frames;
}

}  // namespace refit
