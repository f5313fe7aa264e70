// The adapter end to end through a real engine (loopback, in process): a trainer
// module's tensors go out through torch_source, and a worker module with fused
// q/k/v receives them through module_target, which the engine base asks to check
// each update before any byte moves.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <asio/io_context.hpp>

#include <refit/engines/loopback/loopback.h>
#include <refit/session.h>
#include <refit/torch/source.h>
#include <refit/torch/target.h>
#include "tests/support/run.h"

namespace refit::libtorch {
namespace {

struct trainer_model : torch::nn::Module {
  trainer_model() {
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      auto layer = std::make_shared<torch::nn::Module>();
      const std::int64_t rows = name[0] == 'q' ? 4 : 2;
      layer->register_parameter("weight", at::randn({rows, 8}).to(at::kBFloat16));
      attn->register_module(name, layer);
    }
    attn = register_module("self_attn", attn);
    norm = register_parameter("norm", at::randn({8}).to(at::kBFloat16));
  }
  std::shared_ptr<torch::nn::Module> attn = std::make_shared<torch::nn::Module>();
  at::Tensor norm;
};

struct worker_model : torch::nn::Module {
  worker_model() {
    auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
    auto qkv = attn->register_module("qkv_proj", std::make_shared<torch::nn::Module>());
    qkv_weight = qkv->register_parameter("weight", at::zeros({8, 8}));  // float32: converted on load
    norm = register_parameter("norm", at::zeros({8}));
  }
  at::Tensor qkv_weight, norm;
};

asio::awaitable<void> send(weight_sender& sender, torch_source& source) {
  co_await sender.send_weights(source.metadata(), source);
}

asio::awaitable<void> receive(weight_update_session& session, const update_info& info, load_weights_fn load) {
  session.start_weight_update();
  co_await session.update_weights(info, std::move(load));
  co_await session.finish_weight_update(1);
}

TEST(libtorch_loopback, a_trainer_module_updates_a_fused_worker_module_in_place) {
  asio::io_context io;
  weight_transfer_config config;
  config.backend = "loopback";
  config.timeout = std::chrono::seconds(5);

  trainer_model trainer;
  worker_model worker;
  const void* address = worker.qkv_weight.data_ptr();
  module_target target(worker, {.fused = vllm_stacked_params()});

  loopback::sender sender(config, trainer_context{io.get_executor(), {}});
  engine_context ctx;
  ctx.executor = io.get_executor();
  ctx.model = &target;  // the engine announces each update to it
  loopback::engine engine(config, ctx);
  json args = {{"channel", "libtorch-loopback"}, {"buffer_bytes", 4096}};
  testing::run_to_completion(io, sender.init(args));
  testing::run_to_completion(io, engine.init_transfer_engine(*engine.parse_init_info(args)));

  torch_source source(trainer);
  auto info = engine.parse_update_info([&] {
    json j = json::object();
    write_update_metadata(source.metadata(), j);
    return j;
  }());
  weight_update_session session(engine);
  auto sent = testing::spawn(io, send(sender, source));
  auto received = testing::spawn(io, receive(session, *info, target.as_load_weights()));
  ASSERT_TRUE(testing::run(io));
  ASSERT_TRUE(sent->done && !sent->error) << sent->message();
  ASSERT_TRUE(received->done && !received->error) << received->message();

  at::Tensor expected =
      at::cat({trainer.attn->named_parameters()["q_proj.weight"], trainer.attn->named_parameters()["k_proj.weight"],
               trainer.attn->named_parameters()["v_proj.weight"]})
          .to(at::kFloat);
  EXPECT_TRUE(at::equal(worker.qkv_weight.detach(), expected));
  EXPECT_TRUE(at::equal(worker.norm.detach(), trainer.norm.detach().to(at::kFloat)));
  EXPECT_EQ(worker.qkv_weight.data_ptr(), address);
  EXPECT_FALSE(engine.weights_dirty());
  engine.shutdown();
  sender.shutdown();
}

TEST(libtorch_loopback, an_update_the_model_refuses_fails_before_the_engine_receives) {
  asio::io_context io;
  weight_transfer_config config;
  config.backend = "loopback";
  config.timeout = std::chrono::seconds(5);
  worker_model worker;
  module_target target(worker);  // no fused mapping: q/k/v_proj are unknown
  engine_context ctx;
  ctx.executor = io.get_executor();
  ctx.model = &target;
  loopback::sender sender(config, trainer_context{io.get_executor(), {}});
  loopback::engine engine(config, ctx);
  json args = {{"channel", "libtorch-loopback-refused"}};
  testing::run_to_completion(io, sender.init(args));
  testing::run_to_completion(io, engine.init_transfer_engine(*engine.parse_init_info(args)));

  trainer_model trainer;
  torch_source source(trainer);
  json j = json::object();
  write_update_metadata(source.metadata(), j);
  auto info = engine.parse_update_info(j);
  auto received = testing::spawn(io, engine.receive_weights(*info, target.as_load_weights()));
  ASSERT_TRUE(testing::run(io));
  ASSERT_TRUE(received->error);
  EXPECT_EQ(received->kind(), static_cast<int>(errc::invalid_argument));
  EXPECT_THAT(received->message(), ::testing::HasSubstr("update tensor 'self_attn.q_proj.weight' is not a tensor of "
                                                        "the model"));
  EXPECT_TRUE(at::equal(worker.qkv_weight.detach(), at::zeros({8, 8})));
  EXPECT_FALSE(engine.weights_dirty());
  EXPECT_FALSE(engine.receiving());
  engine.shutdown();
  sender.shutdown();
}

}  // namespace
}  // namespace refit::libtorch
