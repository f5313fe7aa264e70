// An adopter's first program: a worker (a tensor_map_target served by a
// worker_host) and a trainer (a weight_sender driven by a worker_group) in one
// process, on one asio event loop, moving weights over refit's tcp engine and
// checking them. Built two ways by tests/consumer/run.sh: with Bazel against
// @refit//:refit, and with CMake against `./refit install` (pkg-config).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <refit/refit.h>

#include "lib/config.h"  // the consumer's own lib/config.h, not refit's

namespace {

asio::awaitable<void> train(refit::control::worker_host& host, std::uint16_t port, refit::tensor_map_target& model,
                            const consumer::config& cfg, int& verified) {
  auto ex = co_await asio::this_coro::executor;
  const std::chrono::milliseconds timeout(30000);
  std::vector<refit::control::worker_endpoint> endpoints;
  endpoints.push_back({"127.0.0.1", port});
  refit::control::worker_group workers(ex, timeout, "", std::move(endpoints));
  co_await workers.connect();

  refit::weight_transfer_config config;  // backend "tcp"
  config.timeout = timeout;
  auto sender = refit::engine_factory::instance().create_sender(config, refit::trainer_context{ex, {}});
  refit::json args;
  args["master_address"] = "127.0.0.1";
  args["master_port"] = 0;
  args["world_size"] = 2;
  const refit::json init_info = co_await workers.init(*sender, args);  // the sender's init_info, as sent

  // The trainer's weights: cfg.tensors bf16 tensors, new values every update.
  refit::update_metadata meta;
  for (std::uint64_t i = 0; i < cfg.tensors; ++i)
    meta.tensors.push_back({"layers." + std::to_string(i) + ".weight",
                            refit::dtype::bfloat16,
                            {static_cast<std::int64_t>(cfg.tensor_bytes / 2)}});
  std::vector<std::vector<std::byte>> storage;
  std::vector<refit::tensor_view> views;
  for (const auto& t : meta.tensors) {
    storage.emplace_back(t.nbytes());
    views.emplace_back(t, storage.back().data());
  }
  for (int v = 1; v <= cfg.updates; ++v) {
    for (std::size_t i = 0; i < storage.size(); ++i)
      std::memset(storage[i].data(), static_cast<int>(v * 16 + i), storage[i].size());
    // start, update_weights alongside the send, finish at version v, then every
    // worker's fingerprints against the trainer's own.
    auto result = co_await workers.update(*sender, meta, views, v);
    std::printf("update %d: %zu bytes in %.3f s, verified %s\n", v, static_cast<std::size_t>(meta.total_bytes()),
                result.seconds, result.verified ? "yes" : "no");
    if (result.verified) ++verified;
  }
  workers.close();
  sender->shutdown();
  host.stop();
}

}  // namespace

int main() {
  consumer::config cfg;
  std::string names;
  for (const auto& b : refit::engine_factory::instance().available()) names += " " + b;
  std::printf("backends:%s\n", names.c_str());

  asio::io_context io;
  refit::tensor_map_target model;  // reader_lock mode: readers see bytes and version together
  for (std::uint64_t i = 0; i < cfg.tensors; ++i)
    model.add({"layers." + std::to_string(i) + ".weight",
               refit::dtype::bfloat16,
               {static_cast<std::int64_t>(cfg.tensor_bytes / 2)}});

  refit::weight_transfer_config config;
  refit::control::worker_host host(config, refit::engine_context{io.get_executor(), {}, {}, &model},
                                   model.as_load_weights());
  refit::control::update_hooks hooks;
  hooks.on_update_finished = [&model](std::int64_t version, const refit::json&) { model.finish(version); };
  hooks.on_update_failed = [&model](const std::string& reason, refit::errc) { model.abort(reason); };
  host.set_hooks(std::move(hooks));
  const std::uint16_t port = host.listen("127.0.0.1", 0);
  asio::co_spawn(io, host.serve(), asio::detached);

  int verified = 0;
  std::string failure;
  asio::co_spawn(io, train(host, port, model, cfg, verified), [&](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const refit::error& x) {
      failure = std::string(refit::errc_name(x.kind())) + ": " + x.message();
    } catch (const std::exception& x) {
      failure = x.what();
    }
    host.stop();
  });
  io.run();

  auto reader = model.read();
  const auto version = reader.version();
  const bool served = version && *version == cfg.updates &&
                      static_cast<int>(reader.view("layers.0.weight").bytes()[0]) == cfg.updates * 16;
  if (!failure.empty()) std::fprintf(stderr, "demo: %s\n", failure.c_str());
  std::printf("demo: %d of %d updates verified; the model serves version %lld: %s\n", verified, cfg.updates,
              version ? static_cast<long long>(*version) : -1LL, served ? "ok" : "WRONG");
  return failure.empty() && verified == cfg.updates && served ? 0 : 1;
}
