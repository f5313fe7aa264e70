// GPU benchmark of the pipeline's overlap: buckets "received" over a link throttled
// to --link GB/s (device copy + spin on the communication stream) while each earlier
// bucket is "post-processed" on the processing stream for an equal time (a spin).
// Ratios in one run: receive + processing against the larger of the two alone
// (target <= 1.15). Prints one JSON line; without a GPU, a skip line (exit 0).
#include <chrono>
#include <cstdio>

#include <asio/io_context.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/async/drain_scope.h>
#include <refit/cuda/device.h>
#include <refit/cuda/processing.h>
#include <refit/cuda/staging.h>
#include "tests/cuda/d2d_pipeline.h"
#include "tests/support/run.h"

namespace refit::cuda::testing {
namespace {

asio::awaitable<void> receive_all(receive_pipeline& p, const update_metadata& meta, bucket_transport& t,
                                  load_weights_fn load, async::drain_scope& scope) {
  update_stats stats;
  co_await p.receive(meta, t, std::move(load), scope, stats);
  co_await scope.join();
}

int run() {
  auto devices = device_count_or_reason();
  if (!devices) {
    std::printf("{\"bench\":\"gpu_pipeline\",\"skipped\":true,\"reason\":\"%s\"}\n", devices.reason.c_str());
    return 0;
  }
  const double link = 25e9;  // bytes/s: an InfiniBand-class link per GPU
  update_metadata meta;
  for (int i = 0; i < 64; ++i) meta.tensors.push_back({"w" + std::to_string(i), dtype::bfloat16, {4096, 4096}});
  std::vector<std::vector<std::byte>> data;
  std::vector<tensor_view> views;
  for (const auto& t : meta.tensors) {
    data.emplace_back(t.nbytes(), std::byte{1});
    views.emplace_back(t, data.back().data());
  }
  wire_params wire;
  wire.buffer_bytes = 64ull << 20;
  wire.num_buffers = 2;
  const bucket_plan plan = plan_buckets(meta, wire);
  std::vector<std::uint64_t> offsets;
  device_buffer packed = pack_on_device(meta, plan, views, offsets);
  stream processing;
  asio::io_context io;
  asio::thread_pool pool(2);
  receive_pipeline pipeline(io.get_executor(), pool.get_executor(), wire,
                            std::make_unique<device_staging>(wire.num_buffers, wire.buffer_bytes));
  auto spin_load = on_stream(
      [link](std::span<const tensor_view> v) {
        std::uint64_t bytes = 0;
        for (const auto& t : v) bytes += t.nbytes();
        spin(static_cast<std::uint64_t>(static_cast<double>(bytes) / link * 1e9), current_processing_stream());
      },
      processing);
  auto no_load = on_stream([](std::span<const tensor_view>) {}, processing);
  auto measure = [&](bool receive, bool process) {
    d2d_transport t(packed, offsets, receive ? link : 0, receive);
    double best = 1e30;
    for (int rep = 0; rep < 4; ++rep) {
      async::drain_scope scope(io.get_executor());
      const auto t0 = std::chrono::steady_clock::now();
      refit::testing::run_to_completion(io, receive_all(pipeline, meta, t, process ? spin_load : no_load, scope));
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double recv = measure(true, false), proc = measure(false, true), both = measure(true, true);
  std::printf(
      "{\"bench\":\"gpu_pipeline\",\"bytes\":%llu,\"buckets\":%zu,\"receive_s\":%.6f,\"process_s\":%.6f,"
      "\"both_s\":%.6f,\"overlap_ratio\":%.3f,\"target\":1.15}\n",
      static_cast<unsigned long long>(plan.payload_bytes), plan.buckets.size(), recv, proc, both,
      both / std::max(recv, proc));
  return 0;
}

}  // namespace
}  // namespace refit::cuda::testing

int main() {
  try {
    return refit::cuda::testing::run();
  } catch (const std::exception& e) {
    std::printf("{\"bench\":\"gpu_pipeline\",\"error\":\"%s\"}\n", e.what());
    return 1;
  }
}
