#include <refit/engines/tcp/tcp.h>

#include <filesystem>
#include <thread>

#include <asio/experimental/awaitable_operators.hpp>
#include <asio/redirect_error.hpp>
#include <asio/write.hpp>

#include <refit/backend/net.h>

#include "tests/conformance/conformance.h"
#include "tests/support/wait.h"

namespace refit::testing {
namespace {

weight_transfer_config tcp_config(std::string secret = {}) {
  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = std::chrono::seconds(5);
  config.auth_secret = std::move(secret);
  return config;
}

class tcp_harness final : public engine_harness {
 public:
  tcp_harness(asio::io_context& io, model_target* model, bool checksums, std::string secret = {})
      : checksums_(checksums) {
    sender_ = std::make_unique<tcp::sender>(tcp_config(secret), trainer_context{io.get_executor(), {}});
    engine_ = std::make_unique<tcp::engine>(tcp_config(secret), engine_context{io.get_executor(), {}, {}, model});
  }
  asio::awaitable<void> connect(const wire_params& wire) override {
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
    wire_params w = wire;
    w.checksums = checksums_;
    w.write(args);
    auto info = engine_->parse_init_info(sender_->prepare(args));
    using namespace asio::experimental::awaitable_operators;
    co_await (sender_->connect_workers() && engine_->init_transfer_engine(*info));
  }
  weight_transfer_engine& engine() override { return *engine_; }
  weight_sender& sender() override { return *sender_; }

 private:
  bool checksums_;
  std::unique_ptr<tcp::sender> sender_;
  std::unique_ptr<tcp::engine> engine_;
};

// Forwards bytes between a worker and the trainer, flipping one byte of the
// trainer's stream at `flip_at` (a corrupt network path).
class corrupting_proxy {
 public:
  corrupting_proxy(asio::io_context& io, std::uint16_t trainer_port, std::uint64_t flip_at)
      : acceptor_(net::listen(io.get_executor(), "127.0.0.1", 0)), trainer_port_(trainer_port), flip_at_(flip_at) {}
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  asio::awaitable<void> run() {
    auto worker = std::make_shared<asio::ip::tcp::socket>(co_await acceptor_.async_accept(asio::use_awaitable));
    auto trainer = std::make_shared<asio::ip::tcp::socket>(
        co_await net::connect_with_retry("127.0.0.1", trainer_port_, std::chrono::seconds(5), "proxy"));
    using namespace asio::experimental::awaitable_operators;
    co_await (pump(worker, trainer, false) && pump(trainer, worker, true));
  }

 private:
  asio::awaitable<void> pump(std::shared_ptr<asio::ip::tcp::socket> from, std::shared_ptr<asio::ip::tcp::socket> to,
                             bool corrupt) {
    std::vector<std::byte> buf(65536);
    std::uint64_t seen = 0;
    std::error_code ec;
    for (;;) {
      std::size_t n = co_await from->async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
      if (corrupt && flip_at_ >= seen && flip_at_ < seen + n) buf[flip_at_ - seen] ^= std::byte{0x5a};
      seen += n;
      co_await asio::async_write(*to, asio::buffer(buf.data(), n), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
    }
    to->shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  }

  asio::ip::tcp::acceptor acceptor_;
  std::uint16_t trainer_port_;
  std::uint64_t flip_at_;
};

asio::awaitable<void> init_through(tcp::sender& sender, tcp::engine& engine, json init) {
  using namespace asio::experimental::awaitable_operators;
  co_await (sender.connect_workers() && engine.init_transfer_engine(*engine.parse_init_info(init)));
}

// A checksummed transfer corrupted inside bucket 1: the update fails there. What
// the model holds afterwards depends on the commit mode.
struct corrupted_update {
  std::shared_ptr<outcome> sent, received;
  std::size_t loads = 0;
  bool dirty = false;
  std::string dirty_reason;
};

corrupted_update corrupt_bucket_1(const char* commit) {
  asio::io_context io;
  tcp::sender sender(tcp_config(), trainer_context{io.get_executor(), {}});
  tcp::engine engine(tcp_config(), engine_context{io.get_executor()});
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2},
               {"buffer_bytes", 16384},         {"num_buffers", 2}, {"checksums", true}};
  json init = sender.prepare(args);
  corrupting_proxy proxy(io, init["master_port"].get<std::uint16_t>(), 24 + 48 + 2 * 32 + 16384 + 100);
  spawn(io, proxy.run());
  init["master_port"] = proxy.port();
  run_to_completion(io, init_through(sender, engine, init));
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("t" + std::to_string(i), dtype::float32, {4000});
  json info_json = json::object();
  write_update_metadata(set.meta, info_json);
  info_json["commit"] = commit;
  auto info = engine.parse_update_info(info_json);
  corrupted_update r;
  std::atomic<std::size_t> loads{0};
  auto load = [&loads](std::span<const tensor_view> v) { loads += v.size(); };
  r.sent = spawn(io, send_views(sender, set.meta, set.views()));
  r.received = spawn(io, receive_update(engine, std::move(info), load, true));
  EXPECT_TRUE(run_until(io, [&] { return r.sent->done && r.received->done; })) << "a hang";
  r.loads = loads;
  r.dirty = engine.weights_dirty();
  r.dirty_reason = engine.dirty_reason();
  sender.shutdown();
  return r;
}

TEST(tcp_integrity, a_corrupted_payload_byte_is_an_integrity_error_naming_the_bucket) {
  auto r = corrupt_bucket_1("in_place");
  ASSERT_TRUE(r.received->error) << "corruption went unnoticed";
  EXPECT_EQ(r.received->kind(), static_cast<int>(errc::integrity_error)) << r.received->message();
  EXPECT_NE(r.received->message().find("bucket 1"), std::string::npos) << r.received->message();
  EXPECT_TRUE(r.sent->error) << "the trainer learns the update failed";
  EXPECT_NE(r.sent->message().find("rank 1"), std::string::npos) << r.sent->message();
}

TEST(tcp_commit, staged_update_cut_short_never_reaches_the_model) {
  auto r = corrupt_bucket_1("staged");
  ASSERT_TRUE(r.received->error);
  EXPECT_EQ(r.received->kind(), static_cast<int>(errc::integrity_error)) << r.received->message();
  EXPECT_EQ(r.loads, 0u) << "load_weights saw part of a failed staged update";
  EXPECT_FALSE(r.dirty) << r.dirty_reason;
}

TEST(tcp_commit, in_place_update_cut_short_marks_the_weights_dirty) {
  auto r = corrupt_bucket_1("in_place");
  ASSERT_TRUE(r.received->error);
  EXPECT_EQ(r.received->kind(), static_cast<int>(errc::integrity_error)) << r.received->message();
  EXPECT_GT(r.loads, 0u) << "bucket 0 was loaded before bucket 1 failed";
  EXPECT_TRUE(r.dirty);
  EXPECT_NE(r.dirty_reason.find("integrity_error"), std::string::npos) << r.dirty_reason;
}

int open_descriptors() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) n += e.exists() ? 1 : 0;
  return n;
}
int live_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(tcp_leaks, failed_updates_leave_no_descriptors_threads_or_stage_behind) {
  corrupt_bucket_1("staged");  // first use: thread pools and lazily built state
  const int fds = open_descriptors(), threads = live_threads();
  for (int i = 0; i < 5; ++i) {
    auto r = corrupt_bucket_1(i % 2 ? "staged" : "in_place");
    ASSERT_TRUE(r.received->error);
  }
  EXPECT_EQ(open_descriptors(), fds) << "sockets leaked across failed updates";
  // Pools are joined when their engines and senders go; allow for the exiting ones.
  // The kernel's thread list has no event to wait on: poll it, up to 1 s.
  poll_until([&] { return live_threads() <= threads; }, std::chrono::seconds(1));
  EXPECT_LE(live_threads(), threads) << "threads leaked across failed updates";
}

// A trainer and a worker with the given secrets try to connect.
struct auth_attempt {
  std::shared_ptr<outcome> trainer, worker;
  bool worker_initialized = true;
};

auth_attempt connect_with(const std::string& trainer_secret, const std::string& worker_secret) {
  asio::io_context io;
  auto config = tcp_config(trainer_secret);
  config.timeout = std::chrono::milliseconds(800);
  tcp::sender sender(config, trainer_context{io.get_executor(), {}});
  tcp::engine engine(tcp_config(worker_secret), engine_context{io.get_executor()});
  json init = sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
  auto info = engine.parse_init_info(init);
  auth_attempt r;
  r.trainer = spawn(io, sender.connect_workers());
  r.worker = spawn(io, engine.init_transfer_engine(*info));
  EXPECT_TRUE(run_until(io, [&] { return r.worker->done && r.trainer->done; })) << "a hang";
  r.worker_initialized = engine.initialized();
  sender.shutdown();
  return r;
}

TEST(tcp_auth, a_worker_with_another_secret_is_refused_before_any_weight_byte) {
  auto r = connect_with("trainer-secret", "guess");
  ASSERT_TRUE(r.worker->error);
  EXPECT_EQ(r.worker->kind(), static_cast<int>(errc::auth_error)) << r.worker->message();
  EXPECT_FALSE(r.worker_initialized);
  ASSERT_TRUE(r.trainer->error);
  EXPECT_EQ(r.trainer->kind(), static_cast<int>(errc::timeout)) << r.trainer->message();
  EXPECT_NE(r.trainer->message().find("0 of 1 workers"), std::string::npos) << r.trainer->message();
  EXPECT_NE(r.trainer->message().find("auth_error"), std::string::npos) << "names why: " << r.trainer->message();
}

TEST(tcp_auth, a_trainer_without_the_secret_is_refused_by_the_worker) {
  auto r = connect_with("", "worker-secret");
  ASSERT_TRUE(r.worker->error);
  EXPECT_EQ(r.worker->kind(), static_cast<int>(errc::auth_error)) << r.worker->message();
  EXPECT_TRUE(r.trainer->error);
}

TEST(tcp_auth, the_same_secret_on_both_sides_connects) {
  auto r = connect_with("same", "same");
  EXPECT_FALSE(r.worker->error) << r.worker->message();
  EXPECT_FALSE(r.trainer->error) << r.trainer->message();
  EXPECT_TRUE(r.worker_initialized);
}

// Handshakes run concurrently: a connection that says nothing does not hold up the
// workers behind it, and it is cut off when the rendezvous completes.
TEST(tcp_rendezvous, a_silent_connection_does_not_delay_the_workers) {
  asio::io_context io;
  tcp::sender sender(tcp_config("s"), trainer_context{io.get_executor(), {}});  // 5 s deadline
  tcp::engine engine(tcp_config("s"), engine_context{io.get_executor()});
  json init = sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
  auto info = engine.parse_init_info(init);
  asio::ip::tcp::socket silent(io);
  silent.connect({asio::ip::make_address("127.0.0.1"), init["master_port"].get<std::uint16_t>()});
  const auto t0 = std::chrono::steady_clock::now();
  auto t = spawn(io, sender.connect_workers());
  auto w = spawn(io, engine.init_transfer_engine(*info));
  ASSERT_TRUE(run_until(io, [&] { return w->done && t->done; })) << "a hang";
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_FALSE(t->error) << t->message();
  EXPECT_FALSE(w->error) << w->message();
  EXPECT_LT(took, std::chrono::milliseconds(2500)) << "the silent peer held the rendezvous";
  // The silent peer was cut off: it reads the challenge, then end of stream.
  std::vector<std::byte> buf(4096);
  std::error_code ec;
  std::size_t total = 0;
  for (int i = 0; i < 8 && !ec; ++i) total += silent.read_some(asio::buffer(buf), ec);
  EXPECT_EQ(ec, asio::error::eof) << ec.message() << " after " << total << " bytes";
  sender.shutdown();
}

TEST(tcp_integrity, checksum_setting_must_match_between_trainer_and_worker) {
  asio::io_context io;
  tcp::sender sender(tcp_config(), trainer_context{io.get_executor(), {}});
  tcp::engine engine(tcp_config(), engine_context{io.get_executor()});
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}, {"checksums", true}};
  json init = sender.prepare(args);
  init["checksums"] = false;
  auto info = engine.parse_init_info(init);  // outlives the coroutine that reads it
  auto t = spawn(io, sender.connect_workers());
  auto w = spawn(io, engine.init_transfer_engine(*info));
  ASSERT_TRUE(run_until(io, [&] { return w->done; }));
  ASSERT_TRUE(w->error);
  EXPECT_EQ(w->kind(), static_cast<int>(errc::invalid_argument)) << w->message();
  EXPECT_NE(w->message().find("without checksums"), std::string::npos) << w->message();
  sender.shutdown();
  run_until(io, [&] { return t->done; });
}

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(tcp, engine_conformance,
                         ::testing::Values(
                             refit::testing::harness_factory{"tcp",
                                                             [](asio::io_context& io, refit::model_target* model) {
                                                               return std::unique_ptr<refit::testing::engine_harness>(
                                                                   new refit::testing::tcp_harness(io, model, false));
                                                             }},
                             refit::testing::harness_factory{"tcp_checksums",
                                                             [](asio::io_context& io, refit::model_target* model) {
                                                               return std::unique_ptr<refit::testing::engine_harness>(
                                                                   new refit::testing::tcp_harness(io, model, true));
                                                             }},
                             refit::testing::harness_factory{"tcp_auth",
                                                             [](asio::io_context& io, refit::model_target* model) {
                                                               return std::unique_ptr<refit::testing::engine_harness>(
                                                                   new refit::testing::tcp_harness(io, model, true,
                                                                                                   "shared secret"));
                                                             }}),
                         [](const auto& info) { return info.param.name; });
