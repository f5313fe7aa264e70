// The NCCL engine on CPU: the whole engine (side channel, update checks, pipeline,
// failure handling) with the in-process host collective in place of NCCL.
#include "engines/nccl/nccl.h"

#include <asio/experimental/awaitable_operators.hpp>

#include "tests/conformance/provider_harness.h"

namespace refit::testing {
namespace {

weight_transfer_config nccl_config(std::string secret = {}) {
  weight_transfer_config config;
  config.backend = "nccl";
  config.timeout = std::chrono::seconds(5);
  config.auth_secret = std::move(secret);
  return config;
}

using nccl_harness_base = provider_harness<nccl::engine, nccl::sender>;
struct nccl_harness : nccl_harness_base {
  nccl_harness(asio::io_context& io, model_target* model, std::string secret = {})
      : nccl_harness_base(io, model, nccl::host_collectives(), "nccl", secret) {}
};

asio::awaitable<void> receive_one(weight_transfer_engine& engine, std::unique_ptr<update_info> info,
                                  load_weights_fn load) {
  co_await engine.receive_weights(*info, std::move(load));
  co_await engine.drain_pending();
}

wire_params small_wire() {
  wire_params w;
  w.buffer_bytes = 16 << 10;
  w.num_buffers = 2;
  return w;
}

// The trainer goes away mid-update: the worker fails (no hang), and after a re-init
// the next update goes through.
TEST(nccl_host, a_trainer_lost_mid_update_fails_the_worker_which_recovers) {
  asio::io_context io;
  auto h = std::make_unique<nccl_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 32; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000});  // 32 buckets
  auto info = h->engine().parse_update_info(h->update_info_json(set.meta));
  std::atomic<int> loads{0};
  auto sent = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received = spawn(io, receive_one(h->engine(), std::move(info), [&](std::span<const tensor_view> v) {
    loads += static_cast<int>(v.size());
  }));
  ASSERT_TRUE(run_until(io, [&] { return loads > 0 || received->done; }));
  h->sender().shutdown();  // aborts the communicator and closes the side channel
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_TRUE(received->error) << "the worker did not notice";
  EXPECT_TRUE(received->kind() == static_cast<int>(errc::peer_lost) ||
              received->kind() == static_cast<int>(errc::cancelled))
      << received->message();
  EXPECT_NE(received->message().find("nccl worker rank 1"), std::string::npos) << received->message();
  EXPECT_TRUE(sent->error);

  // A new trainer; the worker re-inits.
  h = std::make_unique<nccl_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  capture got;
  auto info2 = h->engine().parse_update_info(h->update_info_json(set.meta));
  auto sent2 = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received2 = spawn(io, receive_one(h->engine(), std::move(info2), got.fn()));
  ASSERT_TRUE(run_until(io, [&] { return sent2->done && received2->done; })) << "a hang";
  EXPECT_FALSE(received2->error) << received2->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST(nccl_host, metadata_disagreeing_with_the_trainer_is_refused_before_any_broadcast) {
  asio::io_context io;
  nccl_harness h(io, nullptr);
  run_to_completion(io, h.connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("w" + std::to_string(i), dtype::float32, {1000});
  update_metadata declared = set.meta;
  declared.tensors[1].dtype = dtype::int32;
  capture got;
  auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
  auto received = spawn(io, receive_one(h.engine(), h.engine().parse_update_info(h.update_info_json(declared)),
                                        got.fn()));
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_TRUE(received->error);
  EXPECT_EQ(received->kind(), static_cast<int>(errc::protocol_error)) << received->message();
  EXPECT_NE(received->message().find("names, dtypes or shapes differ"), std::string::npos) << received->message();
  ASSERT_TRUE(sent->error);
  EXPECT_NE(sent->message().find("refused the update"), std::string::npos) << sent->message();
  EXPECT_EQ(got.calls(), 0u);
}

TEST(nccl_host, checksums_are_refused_with_the_reason) {
  asio::io_context io;
  nccl::sender s(nccl_config(), trainer_context{io.get_executor(), {}}, nccl::host_collectives());
  try {
    s.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}, {"checksums", true}});
    ADD_FAILURE() << "checksums accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_NE(e.message().find("no byte stream"), std::string::npos) << e.message();
  }
}

TEST(nccl_host, a_worker_with_another_secret_never_joins_the_communicator) {
  asio::io_context io;
  auto provider = nccl::host_collectives();
  auto config = nccl_config("right");
  config.timeout = std::chrono::milliseconds(600);
  nccl::sender s(config, trainer_context{io.get_executor(), {}}, provider);
  nccl::engine e(nccl_config("wrong"), engine_context{io.get_executor()}, provider);
  auto info = e.parse_init_info(s.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}}));
  auto t = spawn(io, s.connect_workers());
  auto w = spawn(io, e.init_transfer_engine(*info));
  ASSERT_TRUE(run_until(io, [&] { return t->done && w->done; })) << "a hang";
  ASSERT_TRUE(w->error);
  EXPECT_EQ(w->kind(), static_cast<int>(errc::auth_error)) << w->message();
  ASSERT_TRUE(t->error);
  EXPECT_EQ(t->kind(), static_cast<int>(errc::timeout)) << t->message();
}

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(
    nccl, engine_conformance,
    ::testing::Values(refit::testing::harness_factory{"nccl_host",
                                                      [](asio::io_context& io, refit::model_target* model) {
                                                        return std::unique_ptr<refit::testing::engine_harness>(
                                                            new refit::testing::nccl_harness(io, model));
                                                      }},
                      refit::testing::harness_factory{"nccl_host_auth",
                                                      [](asio::io_context& io, refit::model_target* model) {
                                                        return std::unique_ptr<refit::testing::engine_harness>(
                                                            new refit::testing::nccl_harness(io, model, "k"));
                                                      }}),
    [](const auto& info) { return info.param.name; });
