#include "tests/cuda/engine_pair.h"

#include <cuda_runtime_api.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include <asio/steady_timer.hpp>

#include <refit/control/worker_group.h>
#include <refit/control/worker_host.h>
#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/factory.h>
#include <refit/json_reader.h>
#include "examples/common/worker_process.h"
#include "examples/torch_ipc/device_model.h"

namespace refit::cuda::testing {
namespace {

constexpr const char* worker_flag = "--refit-engine-worker";  // then BACKEND DEVICE

// Converts `bytes` of bfloat16 into float32 `buckets` times, bucket by bucket, on a
// stream of its own, as the worker's load_weights would: the processing alone,
// without any transfer. Returns GPU seconds.
double process_only(std::uint64_t bytes, std::uint64_t bucket_bytes, int device) {
  const device_scope scope(device);
  const std::size_t elems = static_cast<std::size_t>(bucket_bytes / 2);
  device_buffer src(bucket_bytes, device), dst(elems * 4, device);
  REFIT_CUDA_CHECK(cudaMemset(src.data(), 0x3f, bucket_bytes));
  stream s;
  event start = event::timing(), end = event::timing();
  cuda::convert(src.data(), dtype::bfloat16, dst.data(), dtype::float32, elems, s.get());  // warm-up
  start.record(s);
  for (std::uint64_t done = 0; done < bytes; done += bucket_bytes)
    cuda::convert(src.data(), dtype::bfloat16, dst.data(), dtype::float32, elems, s.get());
  end.record(s);
  end.synchronize();
  return event::elapsed_ms(start, end) / 1e3;
}

int worker_main(const std::string& backend, int device) {
  example::die_with_trainer(SIGKILL);  // a worker stuck in CUDA dies with its trainer too
  REFIT_CUDA_CHECK(cudaSetDevice(device));
  asio::io_context io;
  example::device_model model(device);
  weight_transfer_config config;
  config.backend = backend;
  config.timeout = std::chrono::seconds(60);
  // "discard" (set_store_as): load_weights does nothing, so an update costs its
  // receive alone (the benchmark's baseline).
  std::atomic<bool> discard{false};
  control::worker_host host(config, engine_context{io.get_executor(), refit::device::cuda(device), {}, &model},
                            [&model, &discard](std::span<const tensor_view> views) {
                              if (!discard) model.load_weights(views);
                            });
  const auto port = host.listen("127.0.0.1", 0);
  example::add_model_methods(host, model);  // digest, ipc_stats
  // "float32": keep floating-point tensors as float32 (converted on arrival by the
  // conversion kernel, the post-processing); "": as sent (batched copies out of
  // staging); "discard": nothing is kept.
  host.add_method("set_store_as", [&model, &discard](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "set_store_as params");
    auto as = r.optional<std::string>("dtype", "");
    r.finish();
    discard = as == "discard";
    model.set_store_as(as.empty() || discard ? std::nullopt : std::optional<dtype>(parse_dtype(as)));
    co_return json::object();
  });
  host.add_method("process_only", [device](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "process_only params");
    auto bytes = r.required<std::uint64_t>("bytes");
    auto bucket = r.required<std::uint64_t>("bucket_bytes");
    r.finish();
    co_return json{{"seconds", process_only(bytes, bucket, device)}};
  });
  return example::serve_worker(io, host, port);
}

}  // namespace

std::optional<int> run_engine_worker_if_asked(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], worker_flag) != 0) continue;
    if (i + 2 >= argc) {
      std::fprintf(stderr, "%s needs BACKEND DEVICE\n", worker_flag);
      return 2;
    }
    try {
      return worker_main(argv[i + 1], std::stoi(argv[i + 2]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s worker: %s\n", argv[i + 1], e.what());
      return 1;
    }
  }
  return std::nullopt;
}

engine_pair::engine_pair(asio::io_context& io, std::string backend, int trainer_device, int worker_device,
                         std::chrono::milliseconds timeout)
    : io_(io), backend_(std::move(backend)), trainer_device_(trainer_device), timeout_(timeout) {
  auto w = example::start_worker_process({backend_ + "_worker", worker_flag, backend_, std::to_string(worker_device)},
                                         timeout, "the " + backend_ + " worker");
  pid_ = w.pid;
  port_ = w.port;
}

engine_pair::~engine_pair() {
  if (sender_) sender_->shutdown();
  if (client_) client_->close();
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    example::reap_worker(pid_, std::chrono::seconds(10));
  }
}

asio::awaitable<void> engine_pair::connect(json wire, const void* native_stream) {
  client_ = std::make_unique<control::client>(io_.get_executor(), timeout_);
  co_await client_->connect("127.0.0.1", port_);
  weight_transfer_config config;
  config.backend = backend_;
  config.timeout = timeout_;
  trainer_context ctx{io_.get_executor(), refit::device::cuda(trainer_device_)};
  ctx.native_stream = native_stream;
  sender_ = engine_factory::instance().create_sender(config, ctx);
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  for (auto& [k, v] : wire.items()) args[k] = v;
  json init = sender_->prepare(args);
  init["rank_offset"] = 1;
  json params = {{"init_info", init}};
  co_await control::both(sender_->connect_workers(), client_->call("init_weight_transfer_engine", params));
}

asio::awaitable<double> engine_pair::update(const update_metadata& meta, std::vector<tensor_view> views, int version) {
  const auto t0 = std::chrono::steady_clock::now();
  co_await client_->call("start_weight_update");
  json info;
  write_update_metadata(meta, info);
  json body = {{"update_info", info}};
  co_await control::both(client_->call("update_weights", body), trainer_send_weights(*sender_, meta, views));
  co_await client_->call("finish_weight_update", control::params("weight_version", version));
  co_return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void engine_pair::kill_worker() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  example::reap_worker(pid_, std::chrono::seconds(10));
  pid_ = -1;
}

asio::awaitable<json> engine_pair::call(std::string method, json params) {
  co_return co_await client_->call(method, params);
}

}  // namespace refit::cuda::testing
