// A trainer and a worker in two processes, on GPUs: the test or benchmark binary
// is the trainer, and starts itself again as the worker (a worker_host over a
// device_model, dying with it). "cuda_ipc" runs both on one GPU (CUDA opens no IPC
// handle of its own process); "nccl" needs the worker on another GPU than the
// trainer (NCCL refuses two ranks on one device). The trainer sends device tensors
// with the backend's sender and drives the worker's control verbs; the worker
// answers digests of what it holds.
//
//   int main(int argc, char** argv) {
//     if (auto rc = refit::cuda::testing::run_engine_worker_if_asked(argc, argv)) return *rc;
//     ...
//   }
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/io_context.hpp>

#include <refit/control/client.h>
#include <refit/trainer.h>

namespace refit::cuda::testing {

/// Runs the worker role and returns its exit status when argv asks for it
/// ("--refit-ipc-worker"), else nullopt.
std::optional<int> run_engine_worker_if_asked(int argc, char** argv);

/// The trainer's end of the pair. Every call has a deadline (the timeout given).
class engine_pair {
 public:
  /// Starts the worker process (this binary) for `backend` on `worker_device`; the
  /// trainer uses `trainer_device`.
  engine_pair(asio::io_context& io, std::string backend = "cuda_ipc", int trainer_device = 0, int worker_device = 0,
              std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~engine_pair();
  engine_pair(const engine_pair&) = delete;
  engine_pair& operator=(const engine_pair&) = delete;

  /// Connects the control client, makes the sender (trainer_context on the
  /// trainer's device, tensors written on `native_stream`) and inits both sides
  /// with `wire`.
  asio::awaitable<void> connect(json wire, const void* native_stream = nullptr);
  /// One update session (start, update_weights alongside the send, finish at
  /// `version`); returns the trainer's wall seconds for it.
  asio::awaitable<double> update(const update_metadata& meta, std::vector<tensor_view> device_views, int version);
  /// Kills the worker process (SIGKILL) and reaps it: a worker lost mid-update.
  void kill_worker();
  /// A control call on the worker (digest, weight_info, ipc_stats, set_store_as,
  /// process_only, ...).
  asio::awaitable<json> call(std::string method, json params = json::object());

 private:
  asio::io_context& io_;
  std::string backend_;
  int trainer_device_;
  std::chrono::milliseconds timeout_;
  int pid_ = -1;
  std::uint16_t port_ = 0;
  std::unique_ptr<control::client> client_;
  std::unique_ptr<weight_sender> sender_;
};

}  // namespace refit::cuda::testing
