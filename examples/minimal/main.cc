// refit in one sitting: a worker (what an inference server runs) and a trainer, in
// one process on one event loop, over the tcp backend on loopback. The trainer
// sends two small tensors as version 1; then the worker's model must hold exactly
// them. Exit status 0 when it does.
//
//   bazel run //examples/minimal
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <refit/refit.h>

int main() {
  asio::io_context io;
  refit::update_metadata meta;
  meta.tensors = {{"layers.0.weight", refit::dtype::float32, {4, 8}}, {"layers.0.bias", refit::dtype::float32, {8}}};

  // Worker: a model of named tensors (zeroed), vLLM's weight-transfer verbs served
  // on this loop. Its port is what a trainer is told (here: 0, any free port).
  refit::tensor_map_target model;
  for (const auto& spec : meta.tensors) model.add(spec);
  refit::weight_transfer_config config;  // backend "tcp", commit in_place
  refit::control::worker_host host(config, {io.get_executor(), {}, {}, &model}, model.as_load_weights());
  // The model serves an update's bytes once its session finishes (or drops it).
  host.set_hooks(refit::control::tensor_map_hooks(host, model));
  const std::uint16_t port = host.listen("127.0.0.1", 0);
  asio::co_spawn(io, host.serve(), asio::detached);

  // Trainer: its weights, one buffer per tensor, and views of them.
  std::vector<std::vector<float>> weights;
  std::vector<refit::tensor_view> views;
  for (const auto& spec : meta.tensors) {
    auto& w = weights.emplace_back(spec.nbytes() / sizeof(float));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * static_cast<float>(i + weights.size());
    views.emplace_back(spec, w.data());
  }
  std::exception_ptr failure;
  // The data connection: the trainer listens, the worker (rank 1 of 2) connects.
  // (Built outside the coroutine: GCC 12 mishandles braced lists inside one.)
  const refit::json trainer_args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  const std::vector<refit::control::worker_endpoint> endpoints = {{"127.0.0.1", port}};
  auto trainer = [&]() -> asio::awaitable<void> {
    auto ex = co_await asio::this_coro::executor;
    refit::control::worker_group workers(ex, std::chrono::seconds(10), /*secret=*/"", endpoints);
    co_await workers.connect();
    auto sender = refit::engine_factory::instance().create_sender(config, refit::trainer_context{ex, {}});
    co_await workers.init(*sender, trainer_args);
    // start, send alongside update_weights, finish at version 1, compare fingerprints.
    const auto result = co_await workers.update(*sender, meta, views, /*version=*/1);
    std::printf("update 1: %zu tensors in %.3f s\n", meta.tensors.size(), result.seconds);
    sender->shutdown();
    workers.close();
  };
  asio::co_spawn(io, trainer(), [&](std::exception_ptr e) {
    failure = e;
    host.stop();  // ends serve(), so io.run() returns
  });
  io.run();
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "minimal: %s\n", e.what());
      return 1;
    }
  }

  // What the server's request handlers see now: version 1, the trainer's bytes.
  const auto reader = model.read();
  bool ok = reader.version() == 1;
  for (const auto& v : views) ok = ok && std::memcmp(reader.view(v.name).data, v.data, v.nbytes()) == 0;
  std::printf("%s\n", ok ? "ok: both tensors arrived, version 1" : "FAILED: the worker holds other weights");
  return ok ? 0 : 1;
}
