// The control-plane tests' shared setup (tests/control): a worker_host over the
// tcp engine on one io_context, control clients to it, a tcp trainer, and the
// calls, chunks and updates the tests drive through them; plus a model that
// keeps what it is sent.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <asio/io_context.hpp>

#include <refit/control/client.h>
#include <refit/control/worker_host.h>
#include <refit/engines/tcp/tcp.h>
#include <refit/integrity/fingerprint.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {

/// The tcp engine's config, with `timeout` for every deadline.
weight_transfer_config tcp_config(std::chrono::milliseconds timeout = std::chrono::seconds(5));

/// A model that keeps a copy of every tensor it is sent (fingerprinted on
/// request) and refuses any update with a tensor named "forbidden". With
/// `tamper`, that tensor's first byte is flipped as it is loaded (a worker that
/// holds other bytes than it was sent).
class holding_model final : public model_target {
 public:
  explicit holding_model(std::string tamper = {}) : tamper_(std::move(tamper)) {}
  void load_weights(std::span<const tensor_view> views) override;
  void begin_update(const update_metadata& meta) override;
  fingerprint_list fingerprint(const std::vector<std::string>& names) override;
  /// Tensors it holds read back (undo of a fleet-atomic commit).
  bool can_read_back(const tensor_spec& spec) override;
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override;
  /// With `exchanges` set: commits of its own loader swap (counted in `exchanged`).
  bool can_exchange() const override { return exchanges; }
  void exchange(std::span<const tensor_view> staged) override;
  bool exchanges = false;
  std::atomic<int> exchanged{0};

  /// Faults of the next update only: begin_update refuses it (before any byte
  /// moves), or load_weights throws (in a staged session: at its commit).
  std::atomic<bool> refuse_next{false};
  std::atomic<bool> fail_next_load{false};
  /// load_weights succeeds this many more times, then throws once (-1: off).
  std::atomic<int> fail_load_after{-1};
  /// load_weights runs this many more times, then once only after stall_ms (a
  /// worker past its trainer's deadline; -1: off).
  std::atomic<int> stall_load_after{-1};
  std::atomic<int> stall_ms{0};
  /// Called (on the loading thread) as that stall begins: a test's way to act
  /// while this worker is inside its commit or rollback. Set before the update.
  std::function<void()> on_stall;

 private:
  struct tensor {
    tensor_spec spec;
    std::vector<std::byte> bytes;
  };
  std::string tamper_;
  std::mutex mutex_;
  std::map<std::string, tensor> tensors_;
};

/// A worker host with a tcp engine, clients to it and a tcp trainer, on one loop.
class control_fixture : public ::testing::Test {
 protected:
  /// Creates the host over `context` (its executor is io_'s), sets `hooks`,
  /// listens on a free port, serves, connects the trainer's client (trainer_)
  /// and creates its sender.
  void start_host(const weight_transfer_config& config, engine_context context, load_weights_fn load,
                  control::host_limits limits = {}, control::update_hooks hooks = {});
  void TearDown() override { stop_all(); }
  /// Closes every client, stops the host and the sender, runs the loop until it
  /// has nothing left (false when that took more than 5 s), then destroys them.
  bool stop_all();

  /// Another client of the host.
  control::client* connect();
  json call(control::client* c, const std::string& method, json params = json::object());
  /// Through the trainer's client.
  json call(const std::string& method, json params = json::object()) {
    return call(trainer_, method, std::move(params));
  }
  /// Calls and expects a refit::error of `kind`; returns its message.
  std::string call_error(control::client* c, const std::string& method, json params, errc kind);
  std::string call_error(const std::string& method, json params, errc kind) {
    return call_error(trainer_, method, std::move(params), kind);
  }
  /// init_weight_transfer_engine through `client` (the trainer's by default) for
  /// `sender`'s init info (the trainer's sender by default), the sender
  /// accepting the worker meanwhile.
  void init(control::client* client = nullptr, tcp::sender* sender = nullptr);
  static json update_body(const tensor_set& set, const char* commit = nullptr);
  /// One chunk through the trainer's connection (or `client`), the bytes through
  /// the trainer's sender (or `sender`).
  void chunk(tensor_set& set, const char* commit = nullptr, control::client* client = nullptr,
             tcp::sender* sender = nullptr);
  /// start, one chunk, finish at `version` (none: the finish names none).
  void full_update(tensor_set& set, std::optional<std::int64_t> version, const char* commit = nullptr,
                   control::client* client = nullptr, tcp::sender* sender = nullptr);
  json info() { return call(trainer_, "weight_info"); }

  asio::io_context io_;
  engine_factory factory_;
  std::unique_ptr<control::worker_host> host_;
  std::uint16_t port_ = 0;
  std::vector<std::unique_ptr<control::client>> clients_;
  control::client* trainer_ = nullptr;
  std::unique_ptr<tcp::sender> sender_;

  /// The coroutine call() runs: `method` on `c`, its result into *out.
  static asio::awaitable<void> call_into(control::client* c, std::string method, json params, json* out);
};

}  // namespace refit::testing
