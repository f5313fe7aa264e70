// The receive pipeline with device staging (lib/cuda/staging.h) on a GPU: buckets
// arrive by device-to-device copy on a communication stream while load_weights
// copies earlier buckets into the model on the processing stream; every byte must
// land in the model. Needs a GPU; skips itself, with the reason, where there is none.
#include <gtest/gtest.h>

#include <asio/io_context.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/async/drain_scope.h>
#include <refit/cuda/device.h>
#include <refit/cuda/processing.h>
#include <refit/cuda/staging.h>
#include "tests/cuda/d2d_pipeline.h"
#include "tests/cuda/test_kernels.h"
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::cuda::testing {
namespace {

asio::awaitable<void> receive_all(receive_pipeline& p, const update_metadata& meta, bucket_transport& t,
                                  load_weights_fn load, async::drain_scope& scope, update_stats& stats) {
  co_await p.receive(meta, t, std::move(load), scope, stats);
  co_await scope.join();
}

TEST(pipeline_gpu, every_byte_lands_in_the_model_through_device_staging) {
  auto devices = device_count_or_reason();
  if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  refit::testing::tensor_set set;
  for (int i = 0; i < 40; ++i) set.add("w" + std::to_string(i), dtype::bfloat16, {97, 131 + i});
  set.add("embed", dtype::float32, {300000});  // larger than a buffer: split
  wire_params wire;
  wire.buffer_bytes = 256 << 10;
  wire.num_buffers = 3;
  const bucket_plan plan = plan_buckets(set.meta, wire);
  std::vector<std::uint64_t> offsets;
  auto views = set.views();
  device_buffer packed = pack_on_device(set.meta, plan, views, offsets);
  d2d_transport transport(packed, offsets);

  // The model: one device buffer per tensor.
  std::map<std::string, device_buffer> model;
  for (const auto& t : set.meta.tensors) model.emplace(t.name, device_buffer(std::max<std::size_t>(t.nbytes(), 1)));
  stream processing;
  auto load = on_stream(
      [&model](std::span<const tensor_view> views) {
        for (const auto& v : views) {
          EXPECT_TRUE(v.device.is_cuda());
          REFIT_CUDA_CHECK(cudaMemcpyAsync(model.at(std::string(v.name)).data(), v.data, v.nbytes(),
                                           cudaMemcpyDeviceToDevice, current_processing_stream()));
        }
      },
      processing);

  asio::io_context io;
  asio::thread_pool pool(2);
  receive_pipeline pipeline(io.get_executor(), pool.get_executor(), wire,
                            std::make_unique<device_staging>(wire.num_buffers, wire.buffer_bytes));
  async::drain_scope scope(io.get_executor());
  update_stats stats;
  refit::testing::run_to_completion(io, receive_all(pipeline, set.meta, transport, load, scope, stats));
  EXPECT_EQ(stats.buckets, plan.buckets.size());
  for (std::size_t i = 0; i < set.meta.tensors.size(); ++i) {
    std::vector<std::byte> back(set.data[i].size());
    REFIT_CUDA_CHECK(
        cudaMemcpy(back.data(), model.at(set.meta.tensors[i].name).data(), back.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(back, set.data[i]) << set.meta.tensors[i].name;
  }
}

// A load_weights that queues GPU work reading the slot and then throws: the wrapper
// must not return (and so the pipeline must not reuse the slot) before that work
// is done, and the error must still come out.
TEST(pipeline_gpu, a_load_that_throws_returns_only_after_the_work_it_queued) {
  auto devices = device_count_or_reason();
  if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  stream processing;
  auto load = on_stream(
      [](std::span<const tensor_view>) {
        testing::spin(200'000'000, current_processing_stream());  // 200 ms still reading the slot
        throw_error(errc::invalid_argument, "load_weights refused a tensor");
      },
      processing);
  try {
    load({});
    FAIL() << "the error of load_weights was lost";
  } catch (const refit::error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument) << e.what();
  }
  EXPECT_TRUE(processing.query()) << "on_stream returned while the kernel load_weights queued still runs: the "
                                     "pipeline would reuse the slot under it";
}

}  // namespace
}  // namespace refit::cuda::testing
