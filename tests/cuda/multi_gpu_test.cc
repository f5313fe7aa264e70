// What only a machine with two GPUs can show; on one GPU every test skips with
// the reason "needs 2 GPUs", which the GPU check reports as such (neither a pass
// nor a failure), and without a GPU with "no CUDA device".
// - The nccl engine between two ranks: the trainer on cuda:0 and the worker, a
//   second process (tests/cuda/engine_pair.h), on cuda:1 (NCCL refuses two ranks
//   on one device): every byte arrives, and a worker killed mid-update fails the
//   trainer within its deadline.
// - CUDA objects made for cuda:1 while cuda:0 is current (a server whose model is
//   on another GPU than its thread's): the piece copier's batched unpack, the
//   providers of both GPU engines and the processing wrapper work there, and leave
//   the caller's current device as it was.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/processing.h>
#include <refit/cuda/staging.h>
#include <refit/cuda/stream.h>
#include <refit/engines/cuda_ipc/cuda_ipc_provider.h>
#include <refit/engines/nccl/nccl_collective.h>
#include <refit/error.h>
#include "tests/cuda/device_tensors.h"
#include "tests/cuda/engine_pair.h"
#include "tests/cuda/test_kernels.h"
#include "tests/support/run.h"

namespace refit::cuda::testing {
namespace {

using namespace std::chrono_literals;

class two_gpus : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
    if (devices.count < 2)
      GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks on one device; objects for a second device need one); "
                      "this machine has "
                   << devices.count;
    REFIT_CUDA_CHECK(cudaSetDevice(0));
  }
  asio::io_context io_;
};

// ---- CUDA objects on the device they belong to

class device_scope_two_gpus : public two_gpus {};

// Small device pieces on cuda:1 (the batched unpack kernel, its events and scratch),
// copied by a copier made and called while cuda:0 is current.
asio::awaitable<void> copy_small_pieces(piece_copier& copier, std::span<const piece> pieces) {
  co_await copier.copy(pieces, true);
}

TEST_F(device_scope_two_gpus, a_copier_for_cuda1_made_and_used_from_cuda0_batches_small_pieces) {
  constexpr std::size_t n = 64, size = 1000;
  device_buffer src(n * size, 1), dst(n * size, 1);
  std::vector<std::byte> expected(n * size);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::byte>(i * 13 + 1);
  REFIT_CUDA_CHECK(cudaMemcpy(src.data(), expected.data(), expected.size(), cudaMemcpyHostToDevice));
  piece_copier copier(1);
  EXPECT_EQ(current_device(), 0);
  std::vector<piece> pieces;
  for (std::size_t i = 0; i < n; ++i) pieces.push_back({src.bytes() + i * size, dst.bytes() + i * size, size});
  refit::testing::run_to_completion(io_, copy_small_pieces(copier, pieces), 30s);
  EXPECT_EQ(current_device(), 0) << "the copier left another device current";
  std::vector<std::byte> back(expected.size());
  REFIT_CUDA_CHECK(cudaMemcpy(back.data(), dst.data(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == expected);
}

asio::awaitable<void> pack_on(nccl::collective_provider& p, std::span<const asio::const_buffer> pieces,
                              std::byte* dst) {
  co_await p.pack(pieces, dst);
}

TEST_F(device_scope_two_gpus, the_gpu_engines_providers_for_cuda1_work_from_cuda0) {
  auto nccl = nccl::nccl_collectives(1);
  auto ipc = cuda_ipc::cuda_ipcs(1);
  EXPECT_EQ(current_device(), 0);
  auto staging = nccl->make_staging(2, 1 << 20);
  EXPECT_EQ(staging->device(), device::cuda(1));
  EXPECT_EQ(ipc->make_staging(1, 4096)->device(), device::cuda(1));
  // Many small pieces from cuda:1 memory: the provider's batched unpack on cuda:1.
  std::vector<std::byte> expected(300 * 100);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::byte>(i ^ (i >> 7));
  device_buffer src(expected.size(), 1);
  REFIT_CUDA_CHECK(cudaMemcpy(src.data(), expected.data(), expected.size(), cudaMemcpyHostToDevice));
  std::vector<asio::const_buffer> pieces;
  for (std::size_t i = 0; i < 300; ++i) pieces.emplace_back(src.bytes() + i * 100, 100);
  refit::testing::run_to_completion(io_, pack_on(*nccl, pieces, staging->slot(0).data()), 30s);
  std::vector<std::byte> back(expected.size());
  REFIT_CUDA_CHECK(cudaMemcpy(back.data(), staging->slot(0).data(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == expected);
  // The processing wrapper: load_weights runs with cuda:1 current and its stream.
  int seen = -1;
  auto load = nccl->processing([&seen](std::span<const tensor_view>) {
    seen = current_device();
    testing::spin(1'000'000, current_processing_stream());
  });
  load({});
  EXPECT_EQ(seen, 1);
  EXPECT_EQ(current_device(), 0) << "the processing wrapper left another device current";
}

// ---- nccl: trainer on cuda:0, worker on cuda:1

class nccl_two_gpus : public two_gpus {};

asio::awaitable<void> nccl_updates(engine_pair& pair, device_tensors& model, json* d1, json* d2) {
  const json wire = {{"buffer_bytes", 16 << 20}, {"num_buffers", 2}};
  co_await pair.connect(wire);
  model.fill(5);
  co_await pair.update(model.meta, model.views(), 1);
  *d1 = co_await pair.call("digest");
  model.fill(6);
  co_await pair.update(model.meta, model.views(), 2);
  *d2 = co_await pair.call("digest");
}

TEST_F(nccl_two_gpus, every_byte_arrives_on_the_workers_gpu) {
  device_tensors model = mixed_model();
  engine_pair pair(io_, "nccl", 0, 1);
  json d1, d2;
  refit::testing::run_to_completion(io_, nccl_updates(pair, model, &d1, &d2), 120s);
  model.fill(5);
  EXPECT_EQ(d1, model.expected_digests());
  model.fill(6);
  EXPECT_EQ(d2, model.expected_digests());
}

asio::awaitable<void> kill_during_update(engine_pair& pair, device_tensors& model, std::string* error, int* kind,
                                         double* seconds) {
  const json wire = {{"buffer_bytes", 8 << 20}, {"num_buffers", 2}, {"timeout_ms", 5000}};
  co_await pair.connect(wire);
  asio::steady_timer t(co_await asio::this_coro::executor);
  t.expires_after(20ms);
  t.async_wait([&pair](std::error_code) { pair.kill_worker(); });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    co_await pair.update(model.meta, model.views(), 1);
  } catch (const refit::error& e) {
    *error = e.message();
    *kind = static_cast<int>(e.kind());
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST_F(nccl_two_gpus, a_worker_killed_mid_update_fails_the_trainer_within_its_deadline) {
  device_tensors model;
  // 8 GiB: longer than 20 ms even over NVLink, so the kill lands mid-broadcast.
  for (int i = 0; i < 64; ++i) model.add("w" + std::to_string(i), dtype::bfloat16, {64 << 20}, false);
  engine_pair pair(io_, "nccl", 0, 1);
  std::string error;
  int kind = 0;
  double seconds = 0;
  refit::testing::run_to_completion(io_, kill_during_update(pair, model, &error, &kind, &seconds), 120s);
  EXPECT_FALSE(error.empty()) << "the update succeeded with its worker killed";
  EXPECT_TRUE(kind == static_cast<int>(errc::peer_lost) || kind == static_cast<int>(errc::timeout)) << error;
  EXPECT_LT(seconds, 15.0) << "beyond the 5 s deadline plus slack: " << error;
}

}  // namespace
}  // namespace refit::cuda::testing

// The worker role (engine_pair starts this binary again), or the tests.
int main(int argc, char** argv) {
  if (auto rc = refit::cuda::testing::run_engine_worker_if_asked(argc, argv)) return *rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
