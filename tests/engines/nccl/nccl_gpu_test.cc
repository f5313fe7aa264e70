// NCCL behind the collective interface, on a real GPU (tag "gpu": skips with the
// reason without one). One GPU allows one rank per communicator (NCCL refuses two
// ranks on one device), so the engine's two-rank path runs with the host collective
// in nccl_test; here: a one-rank communicator, device staging and packing (small
// pieces batched, host pieces, ordering after the stream that wrote the tensors),
// and a communicator whose second rank never comes, which must be a timeout, not a
// hang, whose abort does not stall the event loop.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/cuda/device.h>
#include <refit/cuda/fill.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/engines/nccl/nccl_collective.h>
#include "tests/cuda/test_kernels.h"
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

std::vector<std::byte> to_host(const std::byte* device, std::size_t n) {
  std::vector<std::byte> out(n);
  if (cudaMemcpy(out.data(), device, n, cudaMemcpyDeviceToHost) != cudaSuccess)
    throw_error(errc::io_error, "cudaMemcpy failed");
  return out;
}

asio::awaitable<void> one_rank_round_trip(collective_provider& p, staging_memory& staging,
                                          std::vector<std::byte>& out) {
  auto comm = co_await p.join(p.new_group_id(), 0, 1, co_await asio::this_coro::executor, 10s);
  std::vector<std::byte> host(staging.slot(0).size());
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<asio::const_buffer> pieces{asio::buffer(host.data(), 1000),
                                         asio::buffer(host.data() + 1000, host.size() - 1000)};
  co_await p.pack(pieces, staging.slot(0).data());
  co_await comm->broadcast(staging.slot(0).data(), host.size(), 10s);  // root: in place
  out = to_host(staging.slot(0).data(), host.size());
  if (std::memcmp(out.data(), host.data(), out.size()) != 0) throw_error(errc::integrity_error, "bytes differ");
}

TEST_F(nccl_gpu, a_one_rank_communicator_packs_and_broadcasts_device_staging) {
  auto p = nccl_collectives(0);
  auto staging = p->make_staging(2, 1 << 20);
  EXPECT_EQ(staging->device(), device::cuda(0));
  std::vector<std::byte> out;
  testing::run_to_completion(io_, one_rank_round_trip(*p, *staging, out));
  EXPECT_EQ(out.size(), 1u << 20);
}

// Thousands of small device pieces (one batched kernel), large ones (copy engine)
// and a host piece, back to back: every byte where it belongs.
asio::awaitable<void> pack_mixed(collective_provider& p, std::byte* dst, std::span<const asio::const_buffer> pieces) {
  co_await p.pack(pieces, dst);
}

TEST_F(nccl_gpu, packing_batches_small_device_pieces_and_keeps_every_byte) {
  auto p = nccl_collectives(0);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 3000; ++i) sizes.push_back(1 + (i * 37) % 700);
  sizes.push_back(3 << 20);
  sizes.push_back(5);
  std::size_t total = 0;
  for (auto s : sizes) total += s;
  std::vector<std::byte> expected(total);
  for (std::size_t i = 0; i < total; ++i) expected[i] = static_cast<std::byte>((i * 131) ^ (i >> 9));
  cuda::device_buffer source(total, 0);
  ASSERT_EQ(cudaMemcpy(source.data(), expected.data(), total, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<std::byte> host_piece(expected.end() - 5, expected.end());  // the last piece from host memory
  std::vector<asio::const_buffer> pieces;
  std::size_t at = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i + 1 == sizes.size())
      pieces.emplace_back(host_piece.data(), sizes[i]);
    else
      pieces.emplace_back(source.bytes() + at, sizes[i]);
    at += sizes[i];
  }
  auto staging = p->make_staging(1, total);
  testing::run_to_completion(io_, pack_mixed(*p, staging->slot(0).data(), pieces));
  EXPECT_TRUE(to_host(staging->slot(0).data(), total) == expected);
}

// The trainer's kernels still running on its stream when the send starts: the pack
// reads their result, not what was there before.
TEST_F(nccl_gpu, a_pack_waits_for_the_stream_that_wrote_the_tensors) {
  auto p = nccl_collectives(0);
  cuda::stream producer;
  constexpr std::size_t n = 4096;
  cuda::device_buffer tensor(n, 0);
  ASSERT_EQ(cudaMemset(tensor.data(), 0x11, n), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cuda::testing::spin(50'000'000, producer.get());  // 50 ms, then the write
  cuda::fill_bytes(tensor.data(), 0x77, n, producer.get());
  auto staging = p->make_staging(1, n);
  p->order_after(producer.get());
  std::vector<asio::const_buffer> pieces{asio::const_buffer(tensor.data(), n)};
  testing::run_to_completion(io_, pack_mixed(*p, staging->slot(0).data(), pieces));
  auto got = to_host(staging->slot(0).data(), n);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::byte b) { return b == std::byte{0x77}; }))
      << "the pack read the tensor before its producer wrote it (first byte " << int(got[0]) << ")";
}

asio::awaitable<void> join_alone(collective_provider& p) {
  co_await p.join(p.new_group_id(), 0, 2, co_await asio::this_coro::executor, 1500ms);
}

// Records how late a 1 ms timer fires while the loop is otherwise busy with `work`.
asio::awaitable<void> tick(asio::steady_timer& t, std::chrono::microseconds* worst, bool* stop) {
  while (!*stop) {
    const auto due = std::chrono::steady_clock::now() + 1ms;
    t.expires_at(due);
    co_await t.async_wait(asio::use_awaitable);
    *worst =
        std::max(*worst, std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - due));
  }
}

asio::awaitable<void> join_alone_then_stop(collective_provider& p, bool* stop, std::string* error, int* kind) {
  try {
    co_await join_alone(p);
  } catch (const refit::error& e) {
    *error = e.message();
    *kind = static_cast<int>(e.kind());
  }
  *stop = true;
}

TEST_F(nccl_gpu, a_rank_that_never_joins_is_a_timeout_and_its_abort_does_not_stall_the_loop) {
  auto p = nccl_collectives(0);
  const auto t0 = std::chrono::steady_clock::now();
  bool stop = false;
  std::string error;
  int kind = 0;
  std::chrono::microseconds worst{0};
  asio::steady_timer timer(io_);
  asio::co_spawn(io_, tick(timer, &worst, &stop), asio::detached);
  asio::co_spawn(io_, join_alone_then_stop(*p, &stop, &error, &kind), asio::detached);
  io_.run_for(30s);
  ASSERT_TRUE(stop) << "join never completed";
  EXPECT_EQ(kind, static_cast<int>(errc::timeout)) << error;
  EXPECT_NE(error.find("did not form"), std::string::npos) << error;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_LT(worst, 50ms) << "the event loop stalled for " << worst.count() << " us (ncclCommAbort on the loop?)";
}

}  // namespace
}  // namespace refit::nccl
