// _Sender, which refit/_sender.py wraps: the trainer's side. Internal; group.cc
// drives a _WorkerGroup's updates through it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <asio/awaitable.hpp>

#include <refit/factory.h>
#include <refit/trainer.h>

#include "bindings.h"

namespace refit::py {

inline nb::dict stats_to_python(const update_stats& s) { return nb::cast<nb::dict>(to_python(s.to_json())); }

class py_sender {
 public:
  py_sender(const std::string& backend, const std::string& device, std::int64_t timeout_ms,
            const std::optional<std::string>& secret_file, std::size_t socket_buffer_bytes) {
    auto config = make_config(backend, timeout_ms, "in_place", secret_file, 1, socket_buffer_bytes);
    trainer_context ctx;
    ctx.executor = runtime::get().executor();
    ctx.device = parse_device(device);
    sender_ = engine_factory::instance().create_sender(config, ctx);
  }
  ~py_sender() { teardown(destroy(std::move(sender_))); }
  static asio::awaitable<void> destroy(std::unique_ptr<weight_sender> sender) {
    sender->shutdown();
    sender.reset();
    co_return;
  }

  std::string backend() const { return std::string(sender_->backend()); }
  nb::dict prepare(nb::handle trainer_args) {
    json args = to_json(trainer_args);
    if (args.is_null()) args = json::object();
    json info = on_loop([&] { return sender_->prepare(args); });
    return nb::cast<nb::dict>(to_python(info));
  }
  asio::awaitable<void> connect_workers() { co_await sender_->connect_workers(); }

  static asio::awaitable<void> send(weight_sender* sender, std::shared_ptr<held_tensors> held,
                                    std::shared_ptr<const update_metadata> declared) {
    auto views = held->views();
    range_source<std::span<const tensor_view>> source(views);
    co_await sender->send_weights(*declared, source);
  }

  nb::dict last_send_stats() {
    auto stats = on_loop([this] { return sender_->last_send_stats(); });
    return stats_to_python(stats);
  }
  nb::object last_send_info() {
    return to_python(on_loop([this] { return sender_->last_send_info(); }));
  }
  void shutdown() {
    on_loop([this] {
      sender_->shutdown();
      return 0;
    });
  }
  weight_sender& sender() { return *sender_; }
  tensor_cache& cache() { return cache_; }

 private:
  std::unique_ptr<weight_sender> sender_;
  tensor_cache cache_;
};

// The tensors of one send and what the trainer declares for them (their own
// metadata unless `metadata` is given; shared with the sender's cache, not copied).
std::pair<std::shared_ptr<held_tensors>, std::shared_ptr<const update_metadata>> hold_for_send(nb::handle tensors,
                                                                                               nb::handle metadata,
                                                                                               const std::string& what,
                                                                                               tensor_cache* cache);

// A stream handle from Python (torch.cuda.Stream.cuda_stream: the cudaStream_t as an
// int) as send_options::producer_stream takes it.
std::optional<const void*> producer_stream(std::optional<std::uintptr_t> handle);

}  // namespace refit::py
