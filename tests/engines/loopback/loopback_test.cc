#include <refit/engines/loopback/loopback.h>

#include <atomic>

#include "tests/conformance/conformance.h"

namespace refit::testing {
namespace {

class loopback_harness final : public engine_harness {
 public:
  loopback_harness(asio::io_context& io, model_target* model) : io_(io) {
    weight_transfer_config config;
    config.backend = "loopback";
    config.timeout = std::chrono::seconds(5);
    sender_ = std::make_unique<loopback::sender>(config, trainer_context{io.get_executor(), {}});
    engine_ = std::make_unique<loopback::engine>(config, engine_context{io.get_executor(), {}, {}, model});
  }
  asio::awaitable<void> connect(const wire_params& wire) override {
    static std::atomic<int> counter{0};
    json args = {{"channel", "conformance-" + std::to_string(counter++)}};
    wire.write(args);
    co_await sender_->init(args);
    co_await engine_->init_transfer_engine(*engine_->parse_init_info(args));
  }
  weight_transfer_engine& engine() override { return *engine_; }
  weight_sender& sender() override { return *sender_; }

 private:
  asio::io_context& io_;
  std::unique_ptr<loopback::sender> sender_;
  std::unique_ptr<loopback::engine> engine_;
};

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(loopback, engine_conformance,
                         ::testing::Values(refit::testing::harness_factory{
                             "loopback",
                             [](asio::io_context& io, refit::model_target* model) {
                               return std::unique_ptr<refit::testing::engine_harness>(
                                   new refit::testing::loopback_harness(io, model));
                             }}),
                         [](const auto& info) { return info.param.name; });
