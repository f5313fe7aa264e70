// The CUDA IPC engine on CPU: side channel, hand-over protocol, handle cache,
// consumed-before-overwrite, pipeline and failures, with host memory standing in
// for CUDA IPC.
#include <refit/engines/cuda_ipc/cuda_ipc.h>

#include <asio/experimental/awaitable_operators.hpp>

#include <refit/session.h>
#include "tests/conformance/provider_harness.h"

namespace refit::testing {
namespace {

using ipc_harness_base = provider_harness<cuda_ipc::engine, cuda_ipc::sender>;
struct ipc_harness : ipc_harness_base {
  ipc_harness(asio::io_context& io, model_target* model, std::string secret = {})
      : ipc_harness_base(io, model, cuda_ipc::host_ipc(), "cuda_ipc", secret) {}
  cuda_ipc::engine& ipc_engine() { return typed_engine(); }
};

wire_params small_wire() {
  wire_params w;
  w.buffer_bytes = 16 << 10;
  w.num_buffers = 2;
  return w;
}

asio::awaitable<void> session_update(weight_update_session& s, cuda_ipc::engine& e, std::unique_ptr<update_info> info,
                                     load_weights_fn load, std::size_t* open_during) {
  s.start_weight_update();
  co_await s.update_weights(*info, std::move(load));
  co_await e.drain_pending();
  *open_during = e.handles().size();
  co_await s.finish_weight_update(1);
}

// Each exported buffer is mapped once however many buckets pass through it, and
// stays mapped for the next session (the trainer's buffers live as long as it).
TEST(cuda_ipc_host, handles_are_opened_once_and_kept_across_sessions) {
  asio::io_context io;
  ipc_harness h(io, nullptr);
  run_to_completion(io, h.connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 20; ++i) set.add("w" + std::to_string(i), dtype::float32, {3000});  // 20 buckets, 2 buffers
  weight_update_session session(h.engine());
  for (int round = 0; round < 2; ++round) {
    capture got;
    std::size_t open_during = 0;
    auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
    auto done =
        spawn(io, session_update(session, h.ipc_engine(), h.engine().parse_update_info(h.update_info_json(set.meta)),
                                 got.fn(), &open_during));
    ASSERT_TRUE(run_until(io, [&] { return sent->done && done->done; })) << "a hang";
    ASSERT_FALSE(sent->error) << sent->message();
    ASSERT_FALSE(done->error) << done->message();
    EXPECT_NO_THROW(got.check_equals(set));
    EXPECT_EQ(open_during, 2u) << "one mapping per exported buffer";
    EXPECT_EQ(h.ipc_engine().handles().opens(), 2u) << "round " << round << ": 20 buckets, 2 buffers: 2 opens";
    EXPECT_EQ(h.ipc_engine().handles().size(), 2u) << "kept after finish_weight_update";
  }
}

// A session that no longer uses a mapping (the trainer freed that memory) closes
// it when it finishes.
TEST(cuda_ipc_host, mappings_a_session_did_not_use_are_closed_at_its_end) {
  auto provider = cuda_ipc::host_ipc();
  auto memory = provider->make_exportable(3, 4096);
  cuda_ipc::handle_cache cache(provider);
  std::vector<cuda_ipc::handle_bytes> handles;
  for (std::size_t i = 0; i < 3; ++i) handles.push_back(provider->export_buffer(*memory, i).first);
  for (const auto& h : handles) EXPECT_NE(cache.get(h, {}), nullptr);
  cache.end_session();
  EXPECT_EQ(cache.size(), 3u);
  cache.get(handles[0], {});
  cache.get(handles[2], {});
  cache.end_session();
  EXPECT_EQ(cache.size(), 2u) << "buffer 1 was not used by the second session";
  EXPECT_EQ(cache.opens(), 3u);
  cache.get(handles[1], {});
  EXPECT_EQ(cache.opens(), 4u) << "reopened on demand";
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
}

TEST(cuda_ipc_host, bad_handles_are_refused_with_the_reason) {
  cuda_ipc::handle_cache cache(cuda_ipc::host_ipc());
  cuda_ipc::handle_bytes stale{};
  std::memcpy(stale.data(), "host-ipc", 8);
  stale[20] = std::byte{7};
  try {
    cache.get(stale, {});
    ADD_FAILURE() << "a stale handle was mapped";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_NE(e.message().find("stale"), std::string::npos) << e.message();
  }
  cuda_ipc::handle_bytes foreign{};
  foreign[0] = std::byte{0x42};
  cuda_ipc::gpu_uuid gpu{};
  gpu[3] = std::byte{1};
  for (auto [h, g] : {std::pair{foreign, cuda_ipc::gpu_uuid{}}, std::pair{stale, gpu}}) {
    try {
      cache.get(h, g);
      ADD_FAILURE() << "a foreign handle was mapped";
    } catch (const error& e) {
      EXPECT_EQ(e.kind(), errc::invalid_argument) << e.message();
    }
  }
  EXPECT_EQ(cache.size(), 0u);
}

asio::awaitable<void> receive_one(weight_transfer_engine& engine, std::unique_ptr<update_info> info,
                                  load_weights_fn load) {
  co_await engine.receive_weights(*info, std::move(load));
  co_await engine.drain_pending();
}

TEST(cuda_ipc_host, a_trainer_lost_mid_update_fails_the_worker_which_recovers) {
  asio::io_context io;
  auto h = std::make_unique<ipc_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 32; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000});
  std::atomic<int> loads{0};
  auto sent = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received = spawn(io, receive_one(h->engine(), h->engine().parse_update_info(h->update_info_json(set.meta)),
                                        [&](std::span<const tensor_view> v) { loads += static_cast<int>(v.size()); }));
  ASSERT_TRUE(run_until(io, [&] { return loads > 0 || received->done; }));
  h->sender().shutdown();
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_TRUE(received->error);
  EXPECT_EQ(received->kind(), static_cast<int>(errc::peer_lost)) << received->message();
  EXPECT_NE(received->message().find("cuda_ipc worker rank 1"), std::string::npos) << received->message();
  EXPECT_EQ(h->ipc_engine().handles().size(), 0u) << "mappings closed after the failure";

  h = std::make_unique<ipc_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  capture got;
  auto sent2 = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received2 =
      spawn(io, receive_one(h->engine(), h->engine().parse_update_info(h->update_info_json(set.meta)), got.fn()));
  ASSERT_TRUE(run_until(io, [&] { return sent2->done && received2->done; })) << "a hang";
  EXPECT_FALSE(received2->error) << received2->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(cuda_ipc, engine_conformance,
                         ::testing::Values(refit::testing::harness_factory{
                             "cuda_ipc_host",
                             [](asio::io_context& io, refit::model_target* model) {
                               return std::unique_ptr<refit::testing::engine_harness>(
                                   new refit::testing::ipc_harness(io, model));
                             }}),
                         [](const auto& info) { return info.param.name; });
