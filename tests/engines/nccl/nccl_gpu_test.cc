// NCCL behind the collective interface, on a real GPU (tag "gpu": skips with the
// reason without one). One GPU allows one rank per communicator (NCCL refuses two
// ranks on one device), so the engine's two-rank path runs with the host collective
// in nccl_test; here: a one-rank communicator, device staging and packing, and a
// communicator whose second rank never comes, which must be a timeout, not a hang.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engines/nccl/nccl_collective.h"
#include "lib/cuda/device.h"
#include "tests/support/run.h"

namespace refit::nccl {
namespace {

using namespace std::chrono_literals;

class nccl_gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    auto devices = cuda::device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  }
  asio::io_context io_;
};

asio::awaitable<void> one_rank_round_trip(collective_provider& p, staging_memory& staging, std::vector<std::byte>& out) {
  auto comm = co_await p.join(p.new_group_id(), 0, 1, co_await asio::this_coro::executor, 10s);
  std::vector<std::byte> host(staging.slot(0).size());
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<asio::const_buffer> pieces{asio::buffer(host.data(), 1000), asio::buffer(host.data() + 1000, host.size() - 1000)};
  co_await p.pack(pieces, staging.slot(0).data());
  co_await comm->broadcast(staging.slot(0).data(), host.size(), 10s);  // root: in place
  out.resize(host.size());
  if (cudaMemcpy(out.data(), staging.slot(0).data(), out.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
    throw_error(errc::io_error, "cudaMemcpy failed");
  if (std::memcmp(out.data(), host.data(), out.size()) != 0) throw_error(errc::integrity_error, "bytes differ");
}

TEST_F(nccl_gpu, a_one_rank_communicator_packs_and_broadcasts_device_staging) {
  auto p = nccl_collectives();
  auto staging = p->make_staging(2, 1 << 20);
  EXPECT_TRUE(staging->device().is_cuda());
  std::vector<std::byte> out;
  testing::run_to_completion(io_, one_rank_round_trip(*p, *staging, out));
  EXPECT_EQ(out.size(), 1u << 20);
}

asio::awaitable<void> join_alone(collective_provider& p) {
  co_await p.join(p.new_group_id(), 0, 2, co_await asio::this_coro::executor, 1500ms);
}

TEST_F(nccl_gpu, a_rank_that_never_joins_is_a_timeout_not_a_hang) {
  auto p = nccl_collectives();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    testing::run_to_completion(io_, join_alone(*p));
    ADD_FAILURE() << "a two-rank communicator formed with one rank";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::timeout) << e.message();
    EXPECT_NE(e.message().find("did not form"), std::string::npos) << e.message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

}  // namespace
}  // namespace refit::nccl
