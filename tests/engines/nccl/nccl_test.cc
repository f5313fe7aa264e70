// The NCCL engine on CPU: the whole engine (side channel, update checks, pipeline,
// failure handling) with the in-process host collective in place of NCCL.
#include <refit/engines/nccl/nccl.h>

#include <algorithm>

#include <asio/experimental/awaitable_operators.hpp>
#include <asio/post.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

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
  auto received = spawn(io, receive_one(h->engine(), std::move(info),
                                        [&](std::span<const tensor_view> v) { loads += static_cast<int>(v.size()); }));
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
  auto received =
      spawn(io, receive_one(h.engine(), h.engine().parse_update_info(h.update_info_json(declared)), got.fn()));
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_TRUE(received->error);
  EXPECT_EQ(received->kind(), static_cast<int>(errc::protocol_error)) << received->message();
  EXPECT_NE(received->message().find("names, dtypes or shapes differ"), std::string::npos) << received->message();
  ASSERT_TRUE(sent->error);
  EXPECT_NE(sent->message().find("refused the update"), std::string::npos) << sent->message();
  EXPECT_EQ(got.calls(), 0u);
}

// A provider around the host collective that records when the trainer packs and
// broadcasts each bucket (both yield to the event loop, as real GPU work would).
class recording_provider final : public nccl::collective_provider {
 public:
  std::vector<std::string> log;

  std::string name() const override { return "recording"; }
  std::string new_group_id() override { return host_->new_group_id(); }
  asio::awaitable<std::unique_ptr<nccl::collective>> join(std::string id, int rank, int world_size,
                                                          asio::any_io_executor ex,
                                                          std::chrono::milliseconds deadline) override {
    auto inner = co_await host_->join(id, rank, world_size, ex, deadline);
    if (rank != 0) co_return inner;
    co_return std::make_unique<recording_collective>(std::move(inner), this);
  }
  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return host_->make_staging(count, bytes);
  }
  void order_after(const void* stream) override { log.push_back("order_after"); }
  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    const int k = packs_++;
    log.push_back("pack" + std::to_string(k) + " begin");
    co_await yield_a_little();
    co_await host_->pack(pieces, dst);
    log.push_back("pack" + std::to_string(k) + " end");
  }
  bool device_sources() const noexcept override { return false; }

  static asio::awaitable<void> yield_a_little() {
    auto ex = co_await asio::this_coro::executor;
    for (int i = 0; i < 3; ++i) co_await asio::post(ex, asio::use_awaitable);
  }

 private:
  class recording_collective final : public nccl::collective {
   public:
    recording_collective(std::unique_ptr<nccl::collective> inner, recording_provider* owner)
        : inner_(std::move(inner)), owner_(owner) {}
    asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds d) override {
      const int k = owner_->broadcasts_++;
      owner_->log.push_back("bcast" + std::to_string(k) + " begin");
      co_await yield_a_little();
      co_await inner_->broadcast(data, bytes, d);
      owner_->log.push_back("bcast" + std::to_string(k) + " end");
    }
    asio::awaitable<void> exchange(std::span<const nccl::p2p_op> ops, std::chrono::milliseconds d) override {
      co_await inner_->exchange(ops, d);
    }
    void abort() noexcept override { inner_->abort(); }

   private:
    std::unique_ptr<nccl::collective> inner_;
    recording_provider* owner_;
  };
  std::shared_ptr<nccl::collective_provider> host_ = nccl::host_collectives();
  int packs_ = 0;
  int broadcasts_ = 0;
};

std::size_t position(const std::vector<std::string>& log, const std::string& what) {
  return static_cast<std::size_t>(std::find(log.begin(), log.end(), what) - log.begin());
}

// With two or more buffers the trainer packs bucket k+1 while bucket k is being
// broadcast; with one it cannot, and the two take turns. Every byte arrives either way.
TEST(nccl_host, the_trainer_packs_the_next_bucket_while_broadcasting_this_one) {
  for (std::uint32_t buffers : {2u, 1u}) {
    asio::io_context io;
    auto provider = std::make_shared<recording_provider>();
    provider_harness<nccl::engine, nccl::sender> h(io, nullptr, provider, "nccl");
    wire_params wire = small_wire();
    wire.num_buffers = buffers;
    run_to_completion(io, h.connect(wire));
    tensor_set set;
    for (int i = 0; i < 8; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000});  // 8 buckets
    capture got;
    auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
    auto received =
        spawn(io, receive_one(h.engine(), h.engine().parse_update_info(h.update_info_json(set.meta)), got.fn()));
    ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
    ASSERT_FALSE(sent->error) << sent->message();
    ASSERT_FALSE(received->error) << received->message();
    EXPECT_NO_THROW(got.check_equals(set));
    const auto& log = provider->log;
    ASSERT_FALSE(log.empty());
    EXPECT_EQ(log.front(), "order_after") << "the trainer's stream is waited for before any pack";
    int overlapped = 0;
    for (int k = 0; k + 1 < 8; ++k) {
      ASSERT_LT(position(log, "pack" + std::to_string(k + 1) + " end"), log.size());
      EXPECT_LT(position(log, "pack" + std::to_string(k) + " end"),
                position(log, "bcast" + std::to_string(k) + " begin"))
          << "bucket " << k << " broadcast before it was packed";
      if (position(log, "pack" + std::to_string(k + 1) + " begin") <
          position(log, "bcast" + std::to_string(k) + " end"))
        ++overlapped;
    }
    if (buffers >= 2)
      EXPECT_EQ(overlapped, 7) << "every next bucket is packed during the broadcast";
    else
      EXPECT_EQ(overlapped, 0) << "one buffer: packing waits for the broadcast that reads it";
  }
}

// Host memory that says it is device memory, as a GPU provider's staging does.
class device_labelled_staging final : public staging_memory {
 public:
  explicit device_labelled_staging(std::unique_ptr<staging_memory> inner) : inner_(std::move(inner)) {}
  refit::device device() const noexcept override { return refit::device::cuda(0); }
  std::size_t slot_count() const noexcept override { return inner_->slot_count(); }
  std::span<std::byte> slot(std::size_t i) override { return inner_->slot(i); }
  std::span<std::byte> assembly(std::uint64_t bytes) override { return inner_->assembly(bytes); }
  std::uint64_t allocated_bytes() const noexcept override { return inner_->allocated_bytes(); }

 private:
  std::unique_ptr<staging_memory> inner_;
};

class device_staging_provider final : public nccl::collective_provider {
 public:
  std::string name() const override { return "device-labelled"; }
  std::string new_group_id() override { return host_->new_group_id(); }
  asio::awaitable<std::unique_ptr<nccl::collective>> join(std::string id, int rank, int world_size,
                                                          asio::any_io_executor ex,
                                                          std::chrono::milliseconds deadline) override {
    co_return co_await host_->join(id, rank, world_size, ex, deadline);
  }
  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<device_labelled_staging>(host_->make_staging(count, bytes));
  }
  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await host_->pack(pieces, dst);
  }
  bool device_sources() const noexcept override { return false; }

 private:
  std::shared_ptr<nccl::collective_provider> host_ = nccl::host_collectives();
};

// A staged commit needs host memory for the whole update; an engine whose buckets
// land in device memory says so at once, before any byte moves, and stays usable.
TEST(nccl_host, staged_commits_into_device_staging_are_refused_before_any_byte) {
  asio::io_context io;
  provider_harness<nccl::engine, nccl::sender> h(io, nullptr, std::make_shared<device_staging_provider>(), "nccl");
  run_to_completion(io, h.connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("w" + std::to_string(i), dtype::float32, {1000});
  json staged = h.update_info_json(set.meta);
  staged["commit"] = "staged";
  capture refused;
  try {
    run_to_completion(io, receive_one(h.engine(), h.engine().parse_update_info(staged), refused.fn()));
    ADD_FAILURE() << "a staged commit into device staging was accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported) << e.message();
    EXPECT_NE(e.message().find("staged commits are not supported"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("cuda:0"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("in_place"), std::string::npos) << e.message();
  }
  EXPECT_EQ(refused.calls(), 0u);
  EXPECT_FALSE(h.engine().weights_dirty());
  // The refusal closed the data path (the trainer learns of it at once): after a
  // re-init the same engine takes the update in place.
  run_to_completion(io, h.connect(small_wire()));
  capture got;
  auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
  auto received =
      spawn(io, receive_one(h.engine(), h.engine().parse_update_info(h.update_info_json(set.meta)), got.fn()));
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  EXPECT_FALSE(received->error) << received->message();
  EXPECT_NO_THROW(got.check_equals(set));
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
