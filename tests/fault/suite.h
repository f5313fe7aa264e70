// What the fault suite's parts share (suite.cc describes the suite): its options,
// the processes it starts, the data proxy that injects faults, and the suite class,
// whose members are defined by theme:
//   suite.cc            the run (every kind, the leak check, the report) and main()
//   suite_processes.cc  worker and trainer processes
//   suite_proxy.cc      the data proxy; proxies for a trainer; the side channel's
//                       calibration
//   suite_checks.cc     what the workers say after a fault, and the verdicts
//   suite_faults.cc     the faults injected in a stream (kills, corruption, stall,
//                       impostor, slow, the chain kinds)
//   suite_stale.cc      stale_trainer
//   suite_session.cc    frozen_trainer, staged_kill_after_chunk
//   suite_delta.cc      delta_wrong_base
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/read.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include <refit/backend/net.h>
#include <refit/control/client.h>
#include <refit/integrity/auth.h>
#include <refit/integrity/fingerprint.h>
#include "examples/weight_sync/model.h"
#include "tests/support/wait.h"

namespace refit::fault {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string binary;  // examples/weight_sync
  int rounds = 2;      // scenarios of each fault kind
  std::uint64_t seed = 0;
  int workers = 3;
  std::string model_bytes = "24M";
  std::int64_t timeout_ms = 1500;
  std::string engine = "tcp";
  /// Whether the data crosses the proxies (tcp); otherwise only the side channel.
  bool data_proxied() const { return engine == "tcp"; }
};

inline void say(const std::string& line) { std::fprintf(stderr, "[fault] %s\n", line.c_str()); }

// ------------------------------------------------------------------ processes

struct process {
  pid_t pid = -1;
  int out = -1;  // its stdout
};

process start(const std::vector<std::string>& args, const std::string& log);
// Waits for the process to exit, up to `limit`; nullopt if it did not (a hang).
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds limit);
int count_entries(const std::string& dir);

struct worker {
  process proc;
  std::uint16_t port = 0;
  std::unique_ptr<control::client> client;
  int fds = 0, threads = 0;  // at the start, for the leak check
};

// ------------------------------------------------------------------ data proxy

enum class action { none, kill_trainer, kill_worker, corrupt, stall, throttle, hook };

// Forwards one worker's data connection to the trainer, injecting `act` when the
// trainer-to-worker stream passes byte `at`.
class proxy {
 public:
  explicit proxy(asio::io_context& io) : io_(io), acceptor_(net::listen(io.get_executor(), "127.0.0.1", 0)) {}
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  // Where to forward: the trainer's data port, 0 until the trainer reports it
  // (a worker accepted before then waits for it).
  void forward_to(std::shared_ptr<const std::uint16_t> trainer_port) { trainer_port_ = std::move(trainer_port); }

  action act = action::none;
  std::uint64_t at = 0;
  std::function<void()> kill;  // for kill_* actions and hook
  std::function<bool()> hold;  // hook: forwarding waits while this is true
  std::chrono::milliseconds stall{0};
  double throttle_bytes_per_s = 0;
  bool fired = false;
  std::uint64_t downstream_bytes = 0;  // forwarded to the worker so far

  void start() { asio::co_spawn(io_, serve(), asio::detached); }
  void stop();

 private:
  asio::awaitable<void> serve();
  asio::awaitable<void> pump(std::shared_ptr<asio::ip::tcp::socket> from, std::shared_ptr<asio::ip::tcp::socket> to,
                             bool downstream, std::shared_ptr<int> open);

  asio::io_context& io_;
  asio::ip::tcp::acceptor acceptor_;
  std::shared_ptr<const std::uint16_t> trainer_port_ = std::make_shared<std::uint16_t>(0);
  // When the stall ends (the epoch when none fired): shared with the pumps.
  std::shared_ptr<clock_type::time_point> black_hole_ = std::make_shared<clock_type::time_point>();
  std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets_;
};

// ------------------------------------------------------------------ the suite

struct report {
  int scenarios = 0, injected = 0, detected = 0, lost = 0, hangs = 0, recoveries = 0, recoveries_failed = 0;
  int slow_ok = 0, slow_failed = 0;
  json by_kind = json::object();
  std::vector<std::string> problems;
};

class suite {
 public:
  explicit suite(options o);
  json run();

 private:
  // suite.cc
  static void write_secret(const std::string& path, const std::string& value);
  bool recover(const std::string& why);

  // suite_processes.cc
  worker start_worker(int index);
  void stop_worker(worker& w);
  // Runs an awaitable on the suite's loop to completion (rethrowing its error).
  template <class T>
  T run_sync(asio::awaitable<T> a) {
    std::exception_ptr error;
    std::optional<T> value;
    bool done = false;
    asio::co_spawn(io_, std::move(a), [&](std::exception_ptr e, T v) {
      error = e;
      value = std::move(v);
      done = true;
    });
    io_.restart();
    while (!done) io_.run_one();
    if (error) std::rethrow_exception(error);
    return std::move(*value);
  }
  void run_sync(asio::awaitable<void> a) {
    std::exception_ptr error;
    bool done = false;
    asio::co_spawn(io_, std::move(a), [&](std::exception_ptr e) {
      error = e;
      done = true;
    });
    io_.restart();
    while (!done) io_.run_one();
    if (error) std::rethrow_exception(error);
  }

  static asio::awaitable<json> call(control::client& c, std::string method) { co_return co_await c.call(method); }

  // A trainer process of the main job driving every worker, its stdout read on
  // the suite's loop (while proxies forward its streams).
  struct trainer_result {
    bool exited = false;
    int status = 0;
    json last;  // its last stdout line, if JSON
  };
  struct running_trainer {
    process proc;
    std::shared_ptr<std::string> text = std::make_shared<std::string>();
    std::shared_ptr<bool> eof = std::make_shared<bool>(false);
    // Its data port, from its "REFIT_MASTER_PORT <port>" line (0 until then).
    std::shared_ptr<std::uint16_t> master_port = std::make_shared<std::uint16_t>(0);
  };
  running_trainer start_trainer(const std::vector<std::string>& extra, const std::string& log);
  trainer_result wait_trainer(running_trainer& t, std::chrono::milliseconds limit,
                              std::vector<std::unique_ptr<proxy>>* proxies = nullptr);
  trainer_result run_trainer(const std::vector<std::string>& extra, std::vector<std::unique_ptr<proxy>>* proxies,
                             const std::string& log, process* out_proc = nullptr);

  // suite_proxy.cc
  // Proxies in front of the next trainer's data port, one per worker, and the
  // ports to advertise for them ("p1,p2,..."). The trainer picks its own port
  // and reports it (wait_trainer hands it to the proxies).
  struct proxy_set {
    std::vector<std::unique_ptr<proxy>> proxies;
    std::string advertise;
  };
  proxy_set make_proxies();
  void calibrate(const std::string& topology, bool checksums = false);

  // suite_checks.cc
  fingerprint_list fingerprint_of(worker& w);
  std::optional<json> settled_info(worker& w);
  bool every_chunk_received(std::chrono::milliseconds limit);
  std::string not_at_a_version(std::size_t i, const json& info, int old_version, std::optional<int> new_version,
                               const std::string& commit);
  json& count_injected(const std::string& kind);
  void count_verdict(json& stats, const std::string& name, const std::vector<std::string>& missed);

  // The scenarios: suite_faults.cc, suite_stale.cc, suite_session.cc, suite_delta.cc
  void scenario(const std::string& kind, const std::string& commit);
  asio::awaitable<void> stale_calls(std::uint16_t port,
                                    std::shared_ptr<std::vector<std::pair<std::string, std::string>>> out,
                                    std::shared_ptr<bool> done, bool between);
  static asio::awaitable<void> stale_wave(control::client& c, std::vector<std::pair<std::string, std::string>>& out);
  void stale_verdict(const std::string& name, const proxy& px,
                     const std::vector<std::pair<std::string, std::string>>& stale, const trainer_result& result,
                     bool hang, int round);
  void session_scenario(const std::string& kind, const std::string& commit);
  void delta_scenario(const std::string& kind);
  asio::awaitable<void> reload_model(std::uint16_t port, std::shared_ptr<std::optional<std::string>> out);

  // Every trainer's model (with --model-bytes).
  static constexpr int model_layers = 2;
  static constexpr std::int64_t model_vocab = 4000;

  options o_;
  std::mt19937_64 rng_;
  asio::io_context io_;
  std::string dir_, secret_file_, wrong_secret_file_, secret_;
  std::vector<worker> workers_;
  int version_ = 0;
  // Per topology: side-channel bytes each worker gets at init and per update
  // (calibrate()).
  std::map<std::string, std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>>> side_;
  bool stale_finished_ = false;
  std::map<int, fingerprint_list> fingerprints_;
  report r_;
};

}  // namespace refit::fault
