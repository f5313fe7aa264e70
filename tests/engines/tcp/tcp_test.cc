#include "engines/tcp/tcp.h"

#include <asio/experimental/awaitable_operators.hpp>

#include "tests/conformance/conformance.h"

namespace refit::testing {
namespace {

weight_transfer_config tcp_config() {
  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = std::chrono::seconds(5);
  return config;
}

class tcp_harness final : public engine_harness {
 public:
  tcp_harness(asio::io_context& io, model_target* model) {
    sender_ = std::make_unique<tcp::sender>(tcp_config(), trainer_context{io.get_executor(), {}});
    engine_ = std::make_unique<tcp::engine>(tcp_config(), engine_context{io.get_executor(), {}, {}, model});
  }
  asio::awaitable<void> connect(const wire_params& wire) override {
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
    wire.write(args);
    auto info = engine_->parse_init_info(sender_->prepare(args));
    using namespace asio::experimental::awaitable_operators;
    co_await (sender_->connect_workers() && engine_->init_transfer_engine(*info));
  }
  weight_transfer_engine& engine() override { return *engine_; }
  weight_sender& sender() override { return *sender_; }

 private:
  std::unique_ptr<tcp::sender> sender_;
  std::unique_ptr<tcp::engine> engine_;
};

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(tcp, engine_conformance,
                         ::testing::Values(refit::testing::harness_factory{
                             "tcp", [](asio::io_context& io, refit::model_target* model) {
                               return std::unique_ptr<refit::testing::engine_harness>(
                                   new refit::testing::tcp_harness(io, model));
                             }}),
                         [](const auto& info) { return info.param.name; });
