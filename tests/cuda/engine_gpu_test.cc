// Needs a GPU; skips itself, with the reason, where there is none.
// refit's cuda_ipc engine end to end on one GPU, in two processes: this binary is
// the trainer and starts itself again as the worker (tests/cuda/engine_pair.h).
// Every byte of every tensor is checked through the worker's digest; the worker's
// mappings are opened once; tensors a trainer's kernels are still writing on its
// stream are read only after those kernels; bfloat16 converted on arrival matches
// the CPU reference. What needs two GPUs (nccl between two ranks, objects made on
// a device other than the current one) is tests/cuda/multi_gpu_test.
// With --bench it is the overlap benchmark instead (cuda_ipc_bench.cc).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/fill.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/error.h>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include "examples/torch_ipc/digest.h"
#include "tests/support/convert.h"

#include "tests/cuda/cuda_ipc_bench.h"
#include "tests/cuda/device_tensors.h"
#include "tests/cuda/engine_pair.h"
#include "tests/cuda/test_kernels.h"
#include "tests/support/run.h"

namespace refit::cuda::testing {
namespace {

using namespace std::chrono_literals;

class cuda_ipc_gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
    REFIT_CUDA_CHECK(cudaSetDevice(0));
  }
  asio::io_context io_;
};

asio::awaitable<void> two_updates(engine_pair& pair, device_tensors& model, json* digests1, json* digests2,
                                  json* stats1, json* stats2) {
  const json wire = {{"buffer_bytes", 16 << 20}, {"num_buffers", 2}};  // (GCC 12: no braced json in co_await)
  co_await pair.connect(wire);
  model.fill(1);
  co_await pair.update(model.meta, model.views(), 1);
  *digests1 = co_await pair.call("digest");
  *stats1 = co_await pair.call("ipc_stats");
  model.fill(2);
  co_await pair.update(model.meta, model.views(), 2);
  *digests2 = co_await pair.call("digest");
  *stats2 = co_await pair.call("ipc_stats");
}

TEST_F(cuda_ipc_gpu, every_byte_arrives_twice_and_buffers_are_mapped_once) {
  device_tensors model = mixed_model();
  engine_pair pair(io_);
  json d1, d2, s1, s2;
  refit::testing::run_to_completion(io_, two_updates(pair, model, &d1, &d2, &s1, &s2), 120s);
  model.fill(1);
  EXPECT_EQ(d1, model.expected_digests()) << "first update";
  model.fill(2);
  EXPECT_EQ(d2, model.expected_digests()) << "second update";
  EXPECT_EQ(s1["opens"], 2) << "one open per exported buffer: " << s1;
  EXPECT_EQ(s2["opens"], 2) << "the second update reuses the mappings: " << s2;
}

// The trainer's last kernels are still running on its stream when it sends: the
// sender (trainer_context::native_stream) orders its reads after them.
asio::awaitable<void> send_while_writing(engine_pair& pair, device_tensors& model, const stream& producer, json* got) {
  const json wire = {{"buffer_bytes", 4 << 20}, {"num_buffers", 2}};
  co_await pair.connect(wire, producer.get());
  testing::spin(100'000'000, producer.get());  // 100 ms of "optimizer step", then the write
  for (std::size_t i = 0; i < model.device.size(); ++i)
    fill_bytes(model.device[i].data(), 0x5a, model.host[i].size(), producer.get());
  co_await pair.update(model.meta, model.views(), 1);
  *got = co_await pair.call("digest");
}

TEST_F(cuda_ipc_gpu, tensors_are_read_after_the_kernels_that_write_them) {
  device_tensors model;
  for (int i = 0; i < 8; ++i) model.add("w" + std::to_string(i), dtype::bfloat16, {1 << 20});
  model.fill(3);  // stale values, then the producer overwrites them with 0x5a
  stream producer;
  engine_pair pair(io_);
  json got;
  refit::testing::run_to_completion(io_, send_while_writing(pair, model, producer, &got), 120s);
  for (auto& h : model.host) std::memset(h.data(), 0x5a, h.size());
  EXPECT_EQ(got, model.expected_digests()) << "the sender read the tensors before their producer wrote them";
}

asio::awaitable<void> converted_update(engine_pair& pair, device_tensors& model, json* got) {
  const json wire = {{"buffer_bytes", 4 << 20}, {"num_buffers", 3}};
  co_await pair.connect(wire);
  const json as = {{"dtype", "float32"}};
  co_await pair.call("set_store_as", as);
  co_await pair.update(model.meta, model.views(), 1);
  *got = co_await pair.call("digest");
}

TEST_F(cuda_ipc_gpu, bfloat16_converted_on_arrival_matches_the_cpu_reference) {
  device_tensors model;
  model.add("a", dtype::bfloat16, {3 << 20});
  model.add("b", dtype::bfloat16, {777});
  model.fill(4);
  engine_pair pair(io_);
  json got;
  refit::testing::run_to_completion(io_, converted_update(pair, model, &got), 120s);
  json expected = json::object();
  for (std::size_t i = 0; i < model.host.size(); ++i) {
    tensor_spec f32 = model.meta.tensors[i];
    f32.dtype = dtype::float32;
    std::vector<std::byte> out(f32.nbytes());
    convert::convert_tensor(tensor_view(model.meta.tensors[i], model.host[i].data()), tensor_view(f32, out.data()));
    auto [sum, weighted] = example::byte_digest(out);
    expected[f32.name] = {sum, weighted};
  }
  EXPECT_EQ(got, expected);
}

}  // namespace
}  // namespace refit::cuda::testing

// The worker role, the benchmark (--bench ...: cuda_ipc_bench.cc), or the tests.
int main(int argc, char** argv) {
  if (auto rc = refit::cuda::testing::run_engine_worker_if_asked(argc, argv)) return *rc;
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0)
    return refit::cuda::testing::cuda_ipc_bench_main(argc - 1, argv + 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
