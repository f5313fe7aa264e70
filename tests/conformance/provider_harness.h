// A conformance harness for engines built on links::worker_engine and
// links::sender_base with a provider of their transport (nccl, cuda_ipc): both
// sides in this process, on one io_context, sharing the provider.
#pragma once

#include <memory>
#include <string>

#include <asio/experimental/awaitable_operators.hpp>

#include "tests/conformance/conformance.h"

namespace refit::testing {

template <class Engine, class Sender>
class provider_harness : public engine_harness {
 public:
  template <class Provider>
  provider_harness(asio::io_context& io, model_target* model, std::shared_ptr<Provider> provider,
                   const std::string& backend, const std::string& secret = {}) {
    weight_transfer_config config;
    config.backend = backend;
    config.timeout = std::chrono::seconds(5);
    config.auth_secret = secret;
    sender_ = std::make_unique<Sender>(config, trainer_context{io.get_executor(), {}}, provider);
    engine_ = std::make_unique<Engine>(config, engine_context{io.get_executor(), {}, {}, model}, provider);
  }
  asio::awaitable<void> connect(const wire_params& wire) override {
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
    wire.write(args);
    info_ = engine_->parse_init_info(sender_->prepare(args));
    using namespace asio::experimental::awaitable_operators;
    co_await (sender_->connect_workers() && engine_->init_transfer_engine(*info_));
  }
  weight_transfer_engine& engine() override { return *engine_; }
  weight_sender& sender() override { return *sender_; }
  /// The bytes arrive in one staging buffer per bucket.
  Engine& typed_engine() { return *engine_; }

 private:
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<refit::init_info> info_;
};

}  // namespace refit::testing
