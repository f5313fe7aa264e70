// The nccl engine on one real GPU (tag "gpu": skips with the reason without one).
// NCCL refuses two ranks on one device, so what one GPU can prove is proved here:
// - NCCL itself: a one-rank communicator (non-blocking set-up, a broadcast in
//   device staging), and a communicator whose second rank never comes, which must
//   be a timeout, not a hang, whose abort does not stall the event loop;
// - the provider's device memory: packing (small pieces batched in one kernel,
//   large ones by copy engine, host pieces), ordering after the stream that wrote
//   the tensors;
// - the whole engine, trainer and worker, with everything NCCL's provider gives it
//   (device staging, packing, the processing stream) and the host collective
//   moving the bytes between the two ranks' device buffers: every byte arrives,
//   CUDA post-processing of bucket k overlaps the receive of bucket k+1, a
//   trainer lost mid-update fails the worker within its deadline, and the next
//   update after a re-init arrives whole.
// The two-rank NCCL path (a worker on a second GPU) is tests/cuda/multi_gpu_test.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/fill.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/processing.h>
#include <refit/cuda/stream.h>
#include <refit/engines/nccl/nccl.h>
#include <refit/engines/nccl/nccl_collective.h>
#include "tests/conformance/provider_harness.h"
#include "tests/cuda/test_kernels.h"
#include "tests/support/run.h"
#include "tests/support/tensors.h"

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

// ---- the engine on one GPU: NCCL's provider for every byte of device memory, the
// host collective between the two ranks (through host copies of the device buffers)

// A rank of the host collective whose buffers are device memory. The copies run
// on a stream of their own, waited for before the bytes count as there (the
// engine's processing stream does not synchronise with the legacy default one).
class device_host_collective final : public collective {
 public:
  device_host_collective(std::unique_ptr<collective> inner, int rank, std::vector<double>* received_at)
      : inner_(std::move(inner)), rank_(rank), received_at_(received_at) {}
  asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds deadline) override {
    std::vector<std::byte> host(bytes);
    if (rank_ == 0) {
      REFIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), data, bytes, cudaMemcpyDeviceToHost, copies_.get()));
      copies_.synchronize();
    }
    co_await inner_->broadcast(host.data(), bytes, deadline);
    if (rank_ != 0) {
      REFIT_CUDA_CHECK(cudaMemcpyAsync(data, host.data(), bytes, cudaMemcpyHostToDevice, copies_.get()));
      copies_.synchronize();
      received_at_->push_back(seconds_now());
    }
  }
  asio::awaitable<void> exchange(std::span<const p2p_op>, std::chrono::milliseconds) override {
    throw_error(errc::unsupported, "device_host_collective: no exchange");
  }
  void abort() noexcept override { inner_->abort(); }
  asio::awaitable<void> aborted() override { co_await inner_->aborted(); }

  static double seconds_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 private:
  std::unique_ptr<collective> inner_;
  int rank_;
  std::vector<double>* received_at_;
  cuda::stream copies_ = cuda::stream::on(0);
};

// NCCL's provider for memory, packing and processing; the host collective for the
// ranks. Records when each bucket arrives at the worker and when its processing
// (load_weights and the GPU work it queued) ran.
class device_host_provider final : public collective_provider {
 public:
  std::vector<double> received_at;                   // event loop
  std::vector<std::pair<double, double>> processed;  // processing threads
  std::mutex mutex;

  std::string name() const override { return "nccl memory + host collective"; }
  std::string new_group_id() override { return host_->new_group_id(); }
  asio::awaitable<std::unique_ptr<collective>> join(std::string id, int rank, int world_size, asio::any_io_executor ex,
                                                    std::chrono::milliseconds deadline) override {
    auto inner = co_await host_->join(std::move(id), rank, world_size, std::move(ex), deadline);
    co_return std::make_unique<device_host_collective>(std::move(inner), rank, &received_at);
  }
  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return nccl_->make_staging(count, bytes);
  }
  void order_after(const void* stream) override { nccl_->order_after(stream); }
  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await nccl_->pack(pieces, dst);
  }
  bool device_sources() const noexcept override { return nccl_->device_sources(); }
  load_weights_fn processing(load_weights_fn load) override {
    return [this, inner = nccl_->processing(std::move(load))](std::span<const tensor_view> views) {
      const double t0 = device_host_collective::seconds_now();
      inner(views);  // returns once the GPU work it queued is done
      std::lock_guard lock(mutex);
      processed.emplace_back(t0, device_host_collective::seconds_now());
    };
  }

 private:
  std::shared_ptr<collective_provider> host_ = host_collectives();
  std::shared_ptr<collective_provider> nccl_ = nccl_collectives(0);
};

using device_harness = refit::testing::provider_harness<engine, sender>;

// The trainer's tensors in device memory, with the bytes each should hold.
struct device_model {
  refit::testing::tensor_set set;
  std::vector<cuda::device_buffer> memory;
  std::vector<tensor_view> views;
  void upload() {
    memory.clear();
    views.clear();
    for (std::size_t i = 0; i < set.meta.tensors.size(); ++i) {
      memory.emplace_back(std::max<std::size_t>(set.data[i].size(), 1), 0);
      REFIT_CUDA_CHECK(
          cudaMemcpy(memory.back().data(), set.data[i].data(), set.data[i].size(), cudaMemcpyHostToDevice));
      views.emplace_back(set.meta.tensors[i], memory.back().data(), device::cuda(0));
    }
  }
};

// The worker's model: a device buffer per tensor, written on the processing stream
// after `spin_ns` of GPU work per bucket (the post-processing).
struct worker_model {
  std::mutex mutex;
  std::map<std::string, cuda::device_buffer> tensors;
  std::uint64_t spin_ns = 0;
  bool saw_host_view = false;
  load_weights_fn fn() {
    return [this](std::span<const tensor_view> views) {
      const cudaStream_t s = cuda::current_processing_stream();
      if (spin_ns) cuda::testing::spin(spin_ns, s);
      std::lock_guard lock(mutex);
      for (const auto& v : views) {
        if (!v.device.is_cuda()) saw_host_view = true;
        auto it = tensors.find(std::string(v.name));
        if (it == tensors.end())
          it = tensors.emplace(std::string(v.name), cuda::device_buffer(std::max<std::size_t>(v.nbytes(), 1), 0)).first;
        REFIT_CUDA_CHECK(cudaMemcpyAsync(it->second.data(), v.data, v.nbytes(), cudaMemcpyDeviceToDevice, s));
      }
    };
  }
  std::vector<std::byte> bytes(const std::string& name, std::size_t n) { return to_host(tensors.at(name).bytes(), n); }
};

// 64 tensors of 64 KiB: 8 whole tensors to each 512 KiB bucket, one load_weights
// call per bucket.
device_model uniform() {
  device_model m;
  for (int i = 0; i < 64; ++i) m.set.add("w" + std::to_string(i), dtype::bfloat16, {32 << 10});
  m.upload();
  return m;
}

device_model many_small_and_one_split() {
  device_model m;
  for (int i = 0; i < 300; ++i) m.set.add("layers." + std::to_string(i) + ".w", dtype::bfloat16, {7 + i % 61, 33});
  m.set.add("embed", dtype::float32, {600000});  // 2.4 MB: split over 512 KiB buffers
  m.upload();
  return m;
}

wire_params device_wire() {
  wire_params w;
  w.buffer_bytes = 512 << 10;
  w.num_buffers = 2;
  return w;
}

TEST_F(nccl_gpu, the_engine_receives_into_device_staging_and_overlaps_processing_with_receives) {
  auto provider = std::make_shared<device_host_provider>();
  device_harness h(io_, nullptr, provider, "nccl");
  testing::run_to_completion(io_, h.connect(device_wire()), 30s);
  device_model m = uniform();
  worker_model got;
  got.spin_ns = 20'000'000;  // 20 ms of post-processing per bucket
  auto info = h.engine().parse_update_info(h.update_info_json(m.set.meta));
  auto sent = testing::spawn(io_, testing::send_views(h.sender(), m.set.meta, m.views));
  auto received = testing::spawn(io_, testing::receive_update(h.engine(), std::move(info), got.fn()));
  ASSERT_TRUE(testing::run_until(
      io_, [&] { return sent->done && received->done; }, 60s))
      << "a hang";
  ASSERT_FALSE(sent->error) << sent->message();
  ASSERT_FALSE(received->error) << received->message();
  EXPECT_FALSE(got.saw_host_view) << "load_weights got a view of host memory: the staging is not on the device";
  for (std::size_t i = 0; i < m.set.meta.tensors.size(); ++i)
    ASSERT_TRUE(got.bytes(m.set.meta.tensors[i].name, m.set.data[i].size()) == m.set.data[i])
        << m.set.meta.tensors[i].name;
  // Buckets arrived while earlier buckets' 20 ms of GPU post-processing still ran.
  std::lock_guard lock(provider->mutex);
  const std::size_t buckets = provider->received_at.size();
  ASSERT_GE(buckets, 8u);
  ASSERT_EQ(provider->processed.size(), buckets) << "one load_weights call per bucket of whole tensors";
  std::size_t overlapped = 0;
  for (double r : provider->received_at)
    if (std::any_of(provider->processed.begin(), provider->processed.end(),
                    [r](const auto& p) { return p.first < r && r < p.second; }))
      ++overlapped;
  EXPECT_GE(2 * overlapped, buckets) << "only " << overlapped << " of " << buckets
                                     << " receives completed while a bucket was being processed";
}

TEST_F(nccl_gpu, a_trainer_lost_mid_update_fails_the_worker_within_its_deadline_and_a_new_pair_gets_every_byte) {
  auto provider = std::make_shared<device_host_provider>();
  auto h = std::make_unique<device_harness>(io_, nullptr, provider, "nccl");
  testing::run_to_completion(io_, h->connect(device_wire()), 30s);
  device_model m = many_small_and_one_split();
  worker_model got;
  got.spin_ns = 50'000'000;  // 50 ms per bucket: the worker is busy on the GPU when the trainer goes
  auto info = h->engine().parse_update_info(h->update_info_json(m.set.meta));
  auto sent = testing::spawn(io_, testing::send_views(h->sender(), m.set.meta, m.views));
  auto received = testing::spawn(io_, testing::receive_update(h->engine(), std::move(info), got.fn()));
  ASSERT_TRUE(testing::run_until(
      io_, [&] { return !provider->received_at.empty() || received->done; }, 30s));
  const auto t0 = std::chrono::steady_clock::now();
  h->sender().shutdown();  // aborts the communicator and closes the side channel
  ASSERT_TRUE(testing::run_until(
      io_, [&] { return sent->done && received->done; }, 30s))
      << "a hang";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "past the 5 s deadline and then some";
  ASSERT_TRUE(received->error) << "the worker did not notice its trainer was gone";
  EXPECT_TRUE(received->kind() == static_cast<int>(errc::peer_lost) ||
              received->kind() == static_cast<int>(errc::cancelled) ||
              received->kind() == static_cast<int>(errc::timeout))
      << received->message();

  // A new trainer and worker on the same provider (staging, processing stream): whole.
  h = std::make_unique<device_harness>(io_, nullptr, provider, "nccl");
  testing::run_to_completion(io_, h->connect(device_wire()), 30s);
  worker_model got2;
  auto info2 = h->engine().parse_update_info(h->update_info_json(m.set.meta));
  auto sent2 = testing::spawn(io_, testing::send_views(h->sender(), m.set.meta, m.views));
  auto received2 = testing::spawn(io_, testing::receive_update(h->engine(), std::move(info2), got2.fn()));
  ASSERT_TRUE(testing::run_until(
      io_, [&] { return sent2->done && received2->done; }, 60s))
      << "a hang";
  ASSERT_FALSE(received2->error) << received2->message();
  for (std::size_t i = 0; i < m.set.meta.tensors.size(); ++i)
    ASSERT_TRUE(got2.bytes(m.set.meta.tensors[i].name, m.set.data[i].size()) == m.set.data[i])
        << m.set.meta.tensors[i].name;
}

}  // namespace
}  // namespace refit::nccl

// The conformance suite's cases read what arrives with host copies: they run on
// CPU (nccl_test); here only its harness is used.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(engine_conformance);
