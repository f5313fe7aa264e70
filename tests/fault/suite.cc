// The fault-injection suite: real worker and trainer processes (the main job's
// binary, examples/weight_sync) with faults injected at random points of the
// weight stream, through one data proxy per worker:
//
//   kill_trainer  SIGKILL the trainer when worker k's stream reaches a random bucket
//   kill_worker   SIGKILL worker k there (it is restarted for the recovery)
//   corrupt       flip one byte of worker k's stream there (checksums on)
//   stall         stop forwarding worker k's stream there for twice the deadline
//   impostor      a trainer with the wrong shared secret tries to drive the workers
//   stale_trainer a second control client with the right secret (a stale trainer, a
//                 fail-over gone wrong) calls finish, init, update and start on
//                 worker k when its stream reaches a random bucket, and again
//                 between the live update's last chunk and its finish (the trainer
//                 holds there): each must be refused, and the live update must
//                 complete and verify
//   frozen_trainer  SIGSTOP the trainer once every worker holds its chunk, before
//                 its finish (it holds there): every worker must abort the session
//                 within its session timeout ("sent nothing for"), keeping the old
//                 weights; a replacement trainer then updates everyone; the frozen
//                 trainer, resumed (SIGCONT), must fail, told its session was
//                 aborted, and change nothing (its round is one no other trainer
//                 uses, so a finish taken late would show)
//   staged_kill_after_chunk  (always staged) SIGKILL the trainer at the same point:
//                 every worker must end the session ("closed its connection") and
//                 stay clean at the old version, with the old weights
//   slow          (not a fault) throttle every stream, within the deadline: must succeed
//   chain_kill_middle  (3+ workers, relay chain trainer -> 0 -> 1 -> 2 ...) SIGKILL
//                 worker 1 when worker 0's stream reaches a random bucket: its
//                 successor fails at once (peer_lost, before any deadline) naming
//                 the lost rank, and so does the trainer
//   delta_wrong_base  (tcp) a trainer with deltas on (--delta) sends two updates;
//                 between them one worker's model is reloaded (load_model: its
//                 tensors zeroed) behind refit's back, so the second update's base
//                 is not what it holds: it must refuse the base and be sent the
//                 update full (one full fallback), the others take the delta, and
//                 every worker ends exactly at the new version
//   chain_corrupt (3+ workers, chain, checksums) flip one byte of the first hop:
//                 worker 0 reports the corruption, every worker after it fails too
//                 (the byte was forwarded), none claims the update
// The other kinds run as a star (--topology star); every recovery update uses the
// engine's default topology (a chain from 3 workers on).
//
// --engine ucx runs the same processes over the ucx engine. Its bytes do not cross
// the proxies (UCX moves them: shared memory here); its side channel does (the
// update header, a grant and a "done" per bucket), so the proxies still kill,
// stall and hold at a point inside the update: the suite first measures, with two
// clean updates, how many side-channel bytes each worker gets at init and per
// update, and aims into the update's part. corrupt and chain_corrupt flip a byte of
// one bucket's checksum as its "done" crosses the proxy (the bucket's bytes do not:
// with checksums on, the worker must find them not to match, as it would a flipped
// byte of data): the suite calibrates the side channel with checksums on too and
// requires each update's part to be the update header and one 24-byte "done" per
// bucket (engines/ucx/wire.h), aiming at a random bucket's checksum field. slow,
// which throttles the data, does not run for ucx.
//
// After each fault: every side that should see an error saw one within its
// deadline (detected), every process finished or answered in time and every
// session ended (no hang), and every worker is exactly at the old or the new
// version: it says "clean" at one of the two and holds exactly that version's
// weights; a failed staged update left it at the old one; only an in_place worker
// may instead say "dirty" (claiming no version). Anything else counts as a lost
// update. Then a new trainer runs a full update, which every worker must verify
// (recovery). Worker descriptors and threads are compared at the start and the
// end (nothing leaks across failures).
//
//   bazel run //tests/fault:suite -- [--rounds N] [--seed S] [--short] [--engine tcp|ucx]
//
// Progress goes to stderr; the last stdout line is one JSON object with
// faults_injected, faults_detected, lost_updates, hangs and the rest. Exit status
// 0 only when every fault was detected, nothing was lost and nothing hung.
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

extern char** environ;

namespace refit::fault {
namespace {

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

void say(const std::string& line) { std::fprintf(stderr, "[fault] %s\n", line.c_str()); }

// ------------------------------------------------------------------ processes

struct process {
  pid_t pid = -1;
  int out = -1;  // its stdout
};

process start(const std::vector<std::string>& args, const std::string& log) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw_error(errc::io_error, std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  process p;
  int rc = posix_spawn(&p.pid, copy[0].c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    throw_error(errc::io_error, "cannot start " + copy[0] + ": " + std::strerror(rc));
  }
  p.out = fds[0];
  return p;
}

// Waits for the process to exit, up to `limit`; nullopt if it did not (a hang).
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  std::optional<int> result;
  testing::poll_until(
      [&] {
        int status = 0;
        const pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) result = status;
        if (r < 0) result = -1;
        return result.has_value();
      },
      limit, 10ms);
  return result;
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

struct worker {
  process proc;
  std::uint16_t port = 0;
  std::unique_ptr<control::client> client;
  int fds = 0, threads = 0;  // at the start, for the leak check
};

std::uint16_t free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor a(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  return a.local_endpoint().port();
}

// ------------------------------------------------------------------ data proxy

enum class action { none, kill_trainer, kill_worker, corrupt, stall, throttle, hook };

// Forwards one worker's data connection to the trainer, injecting `act` when the
// trainer-to-worker stream passes byte `at`.
class proxy {
 public:
  proxy(asio::io_context& io, std::uint16_t trainer_port)
      : io_(io), acceptor_(net::listen(io.get_executor(), "127.0.0.1", 0)), trainer_port_(trainer_port) {}
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  action act = action::none;
  std::uint64_t at = 0;
  std::function<void()> kill;  // for kill_* actions and hook
  std::function<bool()> hold;  // hook: forwarding waits while this is true
  std::chrono::milliseconds stall{0};
  double throttle_bytes_per_s = 0;
  bool fired = false;
  std::uint64_t downstream_bytes = 0;  // forwarded to the worker so far

  void start() { asio::co_spawn(io_, serve(), asio::detached); }
  void stop() {
    std::error_code ec;
    acceptor_.close(ec);
    // A black hole stays one until it ends (its pumps close the sockets then): the
    // trainer giving up must not reach the stalled worker sooner.
    if (clock_type::now() < *black_hole_) return;
    for (auto& s : sockets_) s->close(ec);
  }

 private:
  asio::awaitable<void> serve() {
    for (;;) {
      std::error_code ec;
      auto worker = std::make_shared<asio::ip::tcp::socket>(io_);
      co_await acceptor_.async_accept(*worker, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return;
      auto trainer = std::make_shared<asio::ip::tcp::socket>(io_);
      co_await trainer->async_connect(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), trainer_port_),
                                      asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        worker->close(ec);
        continue;
      }
      sockets_.push_back(worker);
      sockets_.push_back(trainer);
      auto open = std::make_shared<int>(2);  // pumps of this connection still running
      asio::co_spawn(io_, pump(worker, trainer, false, open), asio::detached);
      asio::co_spawn(io_, pump(trainer, worker, true, open), asio::detached);
    }
  }

  asio::awaitable<void> pump(std::shared_ptr<asio::ip::tcp::socket> from, std::shared_ptr<asio::ip::tcp::socket> to,
                             bool downstream, std::shared_ptr<int> open) {
    std::vector<std::byte> buf(64 << 10);
    std::uint64_t seen = 0;
    std::error_code ec;
    asio::steady_timer timer(io_);
    const std::shared_ptr<clock_type::time_point> black_hole = black_hole_;  // outlives this proxy
    for (;;) {
      std::size_t n = co_await from->async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
      if (downstream && act == action::throttle && throttle_bytes_per_s > 0) {
        timer.expires_after(std::chrono::microseconds(static_cast<std::int64_t>(n / throttle_bytes_per_s * 1e6)));
        co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      }
      if (downstream && !fired && act != action::none && act != action::throttle && at < seen + n) {
        fired = true;
        if (act == action::corrupt) {
          buf[at >= seen ? at - seen : 0] ^= std::byte{0x5a};
        } else if (act == action::stall) {
          *black_hole_ = clock_type::now() + stall;
          timer.expires_after(stall);
          co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
          break;
        } else {
          if (kill) kill();
          // What was in flight when the process died is what it sent; forward it.
          // A hook holds the stream (the session stays live) while it runs.
          const auto give_up = clock_type::now() + 10s;
          while (act == action::hook && hold && hold() && clock_type::now() < give_up) {
            timer.expires_after(1ms);
            co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
          }
        }
      }
      seen += n;
      if (downstream) downstream_bytes += n;
      co_await asio::async_write(*to, asio::buffer(buf.data(), n), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
    }
    // A stalled link is a black hole: not even the trainer's close gets through to
    // the worker before the stall ends (the worker must time out on its own). Only
    // locals from here on: the proxy may be gone by the time the wait ends.
    if (clock_type::now() < *black_hole) {
      timer.expires_at(*black_hole);
      co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    // Like a wire: this direction ends (FIN) while the other still carries what is
    // in flight (a failing worker's last status, its reason); the last pump closes.
    to->shutdown(asio::ip::tcp::socket::shutdown_send, ec);
    if (--*open == 0) {
      from->close(ec);
      to->close(ec);
    }
  }

  asio::io_context& io_;
  asio::ip::tcp::acceptor acceptor_;
  std::uint16_t trainer_port_;
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
  explicit suite(options o) : o_(std::move(o)), rng_(o_.seed) {
    char tmpl[] = "/tmp/refit-fault-XXXXXX";
    if (!mkdtemp(tmpl)) throw_error(errc::io_error, "mkdtemp failed");
    dir_ = tmpl;
    secret_file_ = dir_ + "/secret";
    wrong_secret_file_ = dir_ + "/wrong-secret";
    write_secret(secret_file_, "fault-suite-secret-" + std::to_string(o_.seed));
    write_secret(wrong_secret_file_, "not-the-secret");
    secret_ = auth::read_secret_file(secret_file_);
  }

  json run() {
    const auto t0 = clock_type::now();
    for (int i = 0; i < o_.workers; ++i) workers_.push_back(start_worker(i));
    // A baseline: every worker holds a known version.
    if (!recover("baseline"))
      throw_error(errc::io_error, "the baseline update failed (" +
                                      (r_.problems.empty() ? std::string("?") : r_.problems.back()) + "); see " + dir_);
    for (auto& w : workers_) {
      w.fds = count_entries("/proc/" + std::to_string(w.proc.pid) + "/fd");
      w.threads = count_entries("/proc/" + std::to_string(w.proc.pid) + "/task");
    }
    std::vector<std::string> kinds = {"kill_trainer",  "kill_worker", "corrupt",       "stall",
                                      "impostor",      "slow",        "stale_trainer", "staged_kill_after_chunk",
                                      "frozen_trainer"};
    if (!o_.data_proxied()) {
      std::erase_if(kinds, [](const std::string& k) { return k == "slow"; });
      calibrate("star");
      calibrate("star", true);  // (corrupt aims at a "done" of an update with checksums on)
      // A chain's init tells worker 0 more (its successors), so its own count.
      if (o_.workers >= 3) {
        calibrate("chain");
        calibrate("chain", true);
      }
    }
    if (o_.workers >= 3) {
      kinds.push_back("chain_kill_middle");
      kinds.push_back("chain_corrupt");
    }
    if (o_.engine == "tcp") kinds.push_back("delta_wrong_base");
    for (int r = 0; r < o_.rounds; ++r)
      for (std::size_t k = 0; k < kinds.size(); ++k) {
        // Both commit modes for every kind over the rounds (alternating).
        const char* commit = (r + k) % 2 == 0 || kinds[k] == "staged_kill_after_chunk" ? "staged" : "in_place";
        try {
          if (kinds[k] == "frozen_trainer" || kinds[k] == "staged_kill_after_chunk")
            session_scenario(kinds[k], commit);
          else if (kinds[k] == "delta_wrong_base")
            delta_scenario(kinds[k]);  // in place: deltas refuse staged sessions
          else
            scenario(kinds[k], commit);
        } catch (const std::exception& e) {
          ++r_.recoveries_failed;
          r_.problems.push_back(kinds[k] + ": the suite could not complete the scenario: " + e.what());
          say(kinds[k] + ": suite error: " + e.what());
        }
      }
    // Leak check on the workers that lived through every fault.
    int fd_growth = 0, thread_growth = 0;
    for (auto& w : workers_) {
      if (w.fds == 0) continue;  // restarted: no baseline
      fd_growth = std::max(fd_growth, count_entries("/proc/" + std::to_string(w.proc.pid) + "/fd") - w.fds);
      thread_growth =
          std::max(thread_growth, count_entries("/proc/" + std::to_string(w.proc.pid) + "/task") - w.threads);
    }
    if (fd_growth > 0) r_.problems.push_back("worker descriptors grew by " + std::to_string(fd_growth));
    if (thread_growth > 0) r_.problems.push_back("worker threads grew by " + std::to_string(thread_growth));
    for (auto& w : workers_) stop_worker(w);
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    const bool ok = r_.detected == r_.injected && r_.lost == 0 && r_.hangs == 0 && r_.recoveries_failed == 0 &&
                    r_.slow_failed == 0 && fd_growth <= 0 && thread_growth <= 0;
    if (ok) {
      std::string cmd = "rm -rf '" + dir_ + "'";
      if (std::system(cmd.c_str()) != 0) say("could not remove " + dir_);
    } else {
      say("logs kept in " + dir_);
    }
    json problems = r_.problems;
    return {{"scenarios", r_.scenarios},
            {"faults_injected", r_.injected},
            {"faults_detected", r_.detected},
            {"lost_updates", r_.lost},
            {"hangs", r_.hangs},
            {"recoveries", r_.recoveries},
            {"recoveries_failed", r_.recoveries_failed},
            {"slow_within_deadline_ok", r_.slow_ok},
            {"slow_within_deadline_failed", r_.slow_failed},
            {"worker_fd_growth", fd_growth},
            {"worker_thread_growth", thread_growth},
            {"by_kind", r_.by_kind},
            {"problems", problems},
            {"seed", o_.seed},
            {"workers", o_.workers},
            {"model_bytes", o_.model_bytes},
            {"engine", o_.engine},
            {"timeout_ms", o_.timeout_ms},
            {"seconds", seconds},
            {"passed", ok}};
  }

 private:
  static void write_secret(const std::string& path, const std::string& value) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::write(fd, value.data(), value.size()) != static_cast<ssize_t>(value.size()))
      throw_error(errc::io_error, "cannot write " + path);
    ::close(fd);
  }

  worker start_worker(int index) {
    worker w;
    w.proc = start({o_.binary, "--role", "worker", "--engine", o_.engine, "--timeout-ms", std::to_string(o_.timeout_ms),
                    "--auth-secret-file", secret_file_},
                   dir_ + "/worker" + std::to_string(index) + ".log");
    std::string line;
    const auto until = clock_type::now() + 10s;
    while (line.find('\n') == std::string::npos) {
      pollfd p{w.proc.out, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock_type::now()).count();
      if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0)
        throw_error(errc::timeout, "worker " + std::to_string(index) + " did not report its port");
      char buf[128];
      ssize_t n = ::read(w.proc.out, buf, sizeof buf);
      if (n <= 0) throw_error(errc::peer_lost, "worker " + std::to_string(index) + " exited at start");
      line.append(buf, static_cast<std::size_t>(n));
    }
    unsigned port = 0;
    if (std::sscanf(line.c_str(), "REFIT_WORKER_PORT %u", &port) != 1)
      throw_error(errc::protocol_error, "worker printed '" + line + "'");
    w.port = static_cast<std::uint16_t>(port);
    w.client =
        std::make_unique<control::client>(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
    run_sync(w.client->connect("127.0.0.1", w.port));
    return w;
  }

  void stop_worker(worker& w) {
    if (w.client) w.client->close();
    if (w.proc.pid > 0) {
      kill(w.proc.pid, SIGTERM);
      if (!wait_exit(w.proc.pid, 5s)) {
        kill(w.proc.pid, SIGKILL);
        wait_exit(w.proc.pid, 5s);
      }
      close(w.proc.out);
      w.proc.pid = -1;
    }
  }

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

  // A stale trainer: its own authenticated connection to a worker, whose every verb
  // on the live session must be refused.
  // Two waves: mid-chunk, then (`between`) once the chunk is received and the
  // session waits for its finish.
  asio::awaitable<void> stale_calls(std::uint16_t port,
                                    std::shared_ptr<std::vector<std::pair<std::string, std::string>>> out,
                                    std::shared_ptr<bool> done, bool between) {
    control::client c(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
    try {
      co_await c.connect("127.0.0.1", port);
      co_await stale_wave(c, *out);
      *done = true;  // the held stream goes on
      if (between) {
        const auto until = clock_type::now() + std::chrono::milliseconds(o_.timeout_ms * 2);
        asio::steady_timer t(io_);
        bool window = false;
        while (!window && clock_type::now() < until) {
          json info = co_await c.call("weight_info");
          window = info["session_active"].get<bool>() && !info["receiving"].get<bool>();
          if (!window) {
            t.expires_after(2ms);
            co_await t.async_wait(asio::use_awaitable);
          }
        }
        if (window)
          co_await stale_wave(c, *out);
        else
          out->emplace_back("the window between update and finish", "never seen");
      }
    } catch (const error& e) {
      out->emplace_back("connect", std::string(errc_name(e.kind())));
    }
    c.close();
    *done = true;
    stale_finished_ = true;
  }

  static asio::awaitable<void> stale_wave(control::client& c, std::vector<std::pair<std::string, std::string>>& out) {
    {
      const json update_info = {{"names", {"w"}}, {"dtype_names", {"float32"}}, {"shapes", {{4}}}};
      const std::vector<std::pair<std::string, json>> calls = {
          {"finish_weight_update", {{"weight_version", 999}}},
          {"init_weight_transfer_engine",
           {{"init_info",
             {{"master_address", "127.0.0.1"}, {"master_port", 1}, {"rank_offset", 1}, {"world_size", 2}}}}},
          {"update_weights", {{"update_info", update_info}}},
          {"start_weight_update", json::object()}};
      for (const auto& [method, params] : calls) {
        std::string got;
        try {
          co_await c.call(method, params);
        } catch (const error& e) {
          got = std::string(errc_name(e.kind()));
        }
        out.emplace_back(method, got);
      }
    }
  }

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
  };
  running_trainer start_trainer(const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> args = {o_.binary,        "--quiet",
                                     "--engine",       o_.engine,
                                     "--model-bytes",  o_.model_bytes,
                                     "--layers",       std::to_string(model_layers),
                                     "--vocab",        std::to_string(model_vocab),
                                     "--buffer-bytes", "1M",
                                     "--num-buffers",  "2",
                                     "--timeout-ms",   std::to_string(o_.timeout_ms)};
    std::string ports;
    for (auto& w : workers_) ports += (ports.empty() ? "" : ",") + std::to_string(w.port);
    args.push_back("--connect");
    args.push_back(ports);
    args.insert(args.end(), extra.begin(), extra.end());
    running_trainer t;
    t.proc = start(args, log);
    auto reader = [](asio::io_context& io, int fd, std::shared_ptr<std::string> text,
                     std::shared_ptr<bool> eof) -> asio::awaitable<void> {
      asio::posix::stream_descriptor d(io, ::dup(fd));
      char buf[4096];
      for (;;) {
        std::error_code ec;
        std::size_t n = co_await d.async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        text->append(buf, n);
      }
      *eof = true;
    };
    asio::co_spawn(io_, reader(io_, t.proc.out, t.text, t.eof), asio::detached);
    return t;
  }
  // Serves the loop until the trainer's stdout ends or `limit` passes; a trainer
  // that does not exit then is killed (a hang).
  trainer_result wait_trainer(running_trainer& t, std::chrono::milliseconds limit,
                              std::vector<std::unique_ptr<proxy>>* proxies = nullptr) {
    const auto until = clock_type::now() + limit;
    io_.restart();
    while (!*t.eof && clock_type::now() < until) io_.run_for(20ms);
    trainer_result r;
    if (auto st = wait_exit(t.proc.pid, *t.eof ? std::chrono::milliseconds(o_.timeout_ms * 2) : 0ms)) {
      r.exited = true;
      r.status = *st;
    } else {
      kill(t.proc.pid, SIGKILL);
      wait_exit(t.proc.pid, 5s);
    }
    if (proxies)
      for (auto& px : *proxies) px->stop();
    io_.restart();
    io_.poll();
    close(t.proc.out);
    const std::string& text = *t.text;
    auto nl = text.find_last_of('\n', text.size() >= 2 ? text.size() - 2 : 0);
    std::string last = text.substr(nl == std::string::npos ? 0 : nl + 1);
    r.last = json::parse(last, nullptr, false);
    return r;
  }
  // Starts a trainer and serves its proxies until it exits (or is found hung).
  trainer_result run_trainer(const std::vector<std::string>& extra, std::vector<std::unique_ptr<proxy>>* proxies,
                             const std::string& log, process* out_proc = nullptr) {
    running_trainer t = start_trainer(extra, log);
    if (out_proc) *out_proc = t.proc;
    // Generous: a trainer must end within a few deadlines of its last progress.
    return wait_trainer(t, std::chrono::milliseconds(o_.timeout_ms * 6) + 20s, proxies);
  }

  // Proxies in front of a new trainer data port (master), one per worker, and
  // the ports to advertise for them ("p1,p2,...").
  struct proxy_set {
    std::uint16_t master;
    std::vector<std::unique_ptr<proxy>> proxies;
    std::string advertise;
  };
  proxy_set make_proxies() {
    proxy_set out{free_port(), {}, {}};
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      out.proxies.push_back(std::make_unique<proxy>(io_, out.master));
      out.advertise += (out.advertise.empty() ? "" : ",") + std::to_string(out.proxies.back()->port());
    }
    return out;
  }

  // Over an engine whose data does not cross the proxies: how many side-channel
  // bytes each worker gets at init and per update in `topology`, from two clean
  // trainers through proxies (1 update, then 2), each verified.
  void calibrate(const std::string& topology, bool checksums = false) {
    std::vector<std::uint64_t> totals[2];
    const std::string key = topology + (checksums ? "+checksums" : "");
    for (int updates = 1; updates <= 2; ++updates) {
      auto [master, proxies, advertise] = make_proxies();
      for (auto& p : proxies) p->start();
      const int round = version_ + 1;
      std::vector<std::string> args = {
          "--first-round",      std::to_string(round),  "--updates",        std::to_string(updates),
          "--master-port",      std::to_string(master), "--advertise-port", advertise,
          "--auth-secret-file", secret_file_,           "--topology",       topology};
      if (checksums) args.push_back("--checksums");
      auto r = run_trainer(args, &proxies, dir_ + "/trainer-calibrate-" + key + "-" + std::to_string(updates) + ".log");
      if (!(r.exited && r.last.is_object() && r.last.value("verified", false)))
        throw_error(errc::io_error,
                    "calibration over " + o_.engine + " failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
      version_ = round + updates - 1;
      fingerprints_[version_] = fingerprint_of(workers_[0]);
      for (auto& p : proxies) totals[updates - 1].push_back(p->downstream_bytes);
    }
    auto& [init, update] = side_[key];
    // A chain's only proxied update stream is worker 0's: the others hear of an
    // update from their predecessor.
    const std::size_t measured = topology == "chain" ? 1 : workers_.size();
    for (std::size_t i = 0; i < measured; ++i) {
      if (totals[1][i] <= totals[0][i] || totals[0][i] <= totals[1][i] - totals[0][i])
        throw_error(errc::io_error, "calibration over " + o_.engine + " (" + topology + "): worker " +
                                        std::to_string(i) + "'s side channel carried " + std::to_string(totals[0][i]) +
                                        " and " + std::to_string(totals[1][i]) + " bytes for 1 and 2 updates");
      update.push_back(totals[1][i] - totals[0][i]);
      init.push_back(totals[0][i] - update.back());
      say("calibrated worker " + std::to_string(i) + " (" + key + "): " + std::to_string(init.back()) +
          " side-channel bytes at init, " + std::to_string(update.back()) + " per update");
    }
  }

  // A full update by a new trainer that every worker must verify.
  bool recover(const std::string& why) {
    const int round = ++version_;
    std::vector<std::string> args = {"--first-round",      std::to_string(round), "--updates", "1",
                                     "--auth-secret-file", secret_file_};
    args.push_back("--checksums");
    auto r = run_trainer(args, nullptr, dir_ + "/trainer-" + std::to_string(round) + "-recover.log");
    const bool ok = r.exited && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && r.last.is_object() &&
                    r.last.value("verified", false);
    if (!ok) {
      if (!r.exited) ++r_.hangs;
      r_.problems.push_back("recovery after " + why + " failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
      --version_;
      return false;
    }
    fingerprints_[round] = fingerprint_of(workers_[0]);
    return true;
  }

  fingerprint_list fingerprint_of(worker& w) {
    json a = run_sync(call(*w.client, "weight_fingerprint"));
    return fingerprints_from_json(json{{"algorithm", a["algorithm"]}, {"tensors", a["tensors"]}});
  }

  // Polls a worker until no update is being received there and no session is open;
  // nullopt if it stays busy (a hang) or stops answering. Every session ends once
  // its trainer is gone: at once when its connection closes, else when its owner's
  // silence reaches the worker's session timeout (the --timeout-ms here).
  std::optional<json> settled_info(worker& w) {
    std::optional<json> settled;
    testing::poll_until(
        [&] {
          try {
            json info = run_sync(call(*w.client, "weight_info"));
            if (info["receiving"].get<bool>() || info["session_active"].get<bool>()) return false;
            settled = std::move(info);
          } catch (const error&) {
          }
          return true;  // settled, or it stopped answering
        },
        std::chrono::milliseconds(o_.timeout_ms * 4), 20ms);
    return settled;
  }

  // Polls until every worker has received its chunk and waits for the finish
  // (session open, nothing being received); false if that is not seen in time.
  bool every_chunk_received(std::chrono::milliseconds limit) {
    const auto until = clock_type::now() + limit;
    while (clock_type::now() < until) {
      bool all = true;
      for (auto& w : workers_) {
        json info = run_sync(call(*w.client, "weight_info"));
        all = all && info["session_active"].get<bool>() && !info["receiving"].get<bool>() &&
              info["session_chunks"].is_number_integer() && info["session_chunks"].get<int>() > 0;
        if (!all) break;
      }
      if (all) return true;
      io_.restart();
      io_.run_for(10ms);  // the trainer's stdout reader runs meanwhile
    }
    return false;
  }

  // Whether worker i's answer `info` holds exactly a version the scenario allows
  // (`old_version`, or `new_version` when it may have landed) and says so; staged
  // workers must, in_place ones may instead say dirty (they claim no version).
  // Returns why not ("" when it does).
  std::string not_at_a_version(std::size_t i, const json& info, int old_version, std::optional<int> new_version,
                               const std::string& commit) {
    const std::string state = info["state"];
    const int v = info["weight_version"].is_number_integer() ? info["weight_version"].get<int>() : -1;
    if (state == "updating") return "still says updating: a session outlived its trainer";
    if (state == "dirty") {
      if (commit == "staged") return "is dirty after a staged update (" + info["dirty_reason"].dump() + ")";
      return {};
    }
    if (v != old_version && (!new_version || v != *new_version))
      return "says clean at version " + std::to_string(v) + ", neither the old (" + std::to_string(old_version) + ")" +
             (new_version ? " nor the new (" + std::to_string(*new_version) + ")" : std::string());
    auto known = fingerprints_.find(v);
    if (known == fingerprints_.end() || !compare_fingerprints(known->second, fingerprint_of(workers_[i])).empty())
      return "says clean at version " + std::to_string(v) + " but holds other weights";
    return {};
  }

  // One more fault of `kind` injected; returns its entry of the report's by_kind.
  json& count_injected(const std::string& kind) {
    ++r_.injected;
    json& stats = r_.by_kind[kind];
    if (stats.is_null()) stats = {{"injected", 0}, {"detected", 0}};
    stats["injected"] = stats["injected"].get<int>() + 1;
    return stats;
  }
  // A scenario's verdict: detected when nothing was missed, else each miss is one
  // of the report's problems.
  void count_verdict(json& stats, const std::string& name, const std::vector<std::string>& missed) {
    if (missed.empty()) {
      ++r_.detected;
      stats["detected"] = stats["detected"].get<int>() + 1;
    } else {
      for (const auto& m : missed) r_.problems.push_back(name + ": " + m);
    }
  }

  // delta_wrong_base: a delta trainer's two updates, worker `target`'s model
  // reloaded between them (the proxy holds the first byte of the second update
  // while the suite calls load_model on it).
  void delta_scenario(const std::string& kind) {
    ++r_.scenarios;
    json& stats = count_injected(kind);
    const int target = std::uniform_int_distribution<int>(0, o_.workers - 1)(rng_);
    const std::string name =
        kind + "#" + std::to_string(r_.scenarios) + " (in_place, worker " + std::to_string(target) + ")";
    say(name + ": running");
    const std::vector<std::string> delta = {
        "--delta",  "--change-fraction", "0.01",        "--topology",         "star",
        "--commit", "in_place",          "--checksums", "--auth-secret-file", secret_file_};
    const auto run = [&](int round, int updates, const std::string& tag, proxy_set& set) {
      std::vector<std::string> args = {"--first-round",         std::to_string(round), "--updates",
                                       std::to_string(updates), "--master-port",       std::to_string(set.master),
                                       "--advertise-port",      set.advertise};
      args.insert(args.end(), delta.begin(), delta.end());
      for (auto& p : set.proxies) p->start();
      return run_trainer(args, &set.proxies, dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + tag + ".log");
    };
    std::vector<std::string> missed;
    // Where the second update starts on the target's stream: the bytes a one-update
    // trainer with deltas on sends it (init and a full update).
    std::uint64_t first_update_bytes = 0;
    {
      auto set = make_proxies();
      const int round = version_ + 1;
      auto r = run(round, 1, kind + "-measure", set);
      if (!(r.exited && r.last.is_object() && r.last.value("verified", false)))
        throw_error(errc::io_error,
                    "the measuring delta trainer failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
      version_ = round;
      fingerprints_[round] = fingerprint_of(workers_[0]);
      first_update_bytes = set.proxies[target]->downstream_bytes;
    }
    auto set = make_proxies();
    auto& px = *set.proxies[target];
    px.act = action::hook;
    px.at = first_update_bytes;
    auto reloaded = std::make_shared<std::optional<std::string>>();  // "" once done, else the error
    px.kill = [this, target, reloaded] {
      asio::co_spawn(io_, reload_model(workers_[target].port, reloaded), asio::detached);
    };
    px.hold = [reloaded] { return !reloaded->has_value(); };
    const int round = version_ + 1;
    auto result = run(round, 2, kind, set);
    const bool hang = !result.exited;
    if (!px.fired) missed.push_back("the second update never reached worker " + std::to_string(target));
    if (!reloaded->has_value() || !(*reloaded)->empty())
      missed.push_back("the reload did not complete: " + reloaded->value_or("no answer"));
    const bool verified = !hang && result.last.is_object() && result.last.value("verified", false);
    if (!verified)
      missed.push_back("the delta trainer did not verify both updates: " +
                       (result.last.is_object() ? result.last.dump() : "no JSON"));
    const json d = result.last.is_object() ? result.last.value("delta", json()) : json();
    if (verified && !(d.is_object() && d.value("full_fallbacks", -1) == 1 && d.value("encoded_buckets", 0) > 0))
      missed.push_back("expected one full fallback and delta buckets for the others: " + d.dump());
    if (verified) {
      version_ = round + 1;
      fingerprints_[version_] = fingerprint_of(workers_[0]);
    }
    if (hang) ++r_.hangs;
    // Every worker clean at the new version, holding exactly its weights (where
    // the trainer failed, that is missed above and the recovery decides).
    for (std::size_t i = 0; verified && i < workers_.size(); ++i) {
      auto info = settled_info(workers_[i]);
      if (!info) {
        missed.push_back("worker " + std::to_string(i) + " stayed busy or stopped answering");
        continue;
      }
      // (As after a staged commit: no worker may say dirty.)
      const std::string lost = not_at_a_version(i, *info, version_, std::nullopt, "staged");
      if (!lost.empty()) {
        ++r_.lost;
        r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + lost);
      }
    }
    count_verdict(stats, name, missed);
    say(name + ": " +
        (missed.empty()
             ? "the reloaded worker refused the base and got the update full; every worker exact at version " +
                   std::to_string(version_)
             : "MISSED: " + missed.front()));
    if (!verified) {
      if (recover(name))
        ++r_.recoveries;
      else
        ++r_.recoveries_failed;
    }
  }

  // load_model on the worker at `port`: the trainer's layout, tensors zeroed (a
  // reloaded model). `out`: "" once it answered, else what went wrong.
  asio::awaitable<void> reload_model(std::uint16_t port, std::shared_ptr<std::optional<std::string>> out) {
    control::client c(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
    try {
      json layout = json::object();
      write_update_metadata(
          example::make_layout(example::parse_bytes(o_.model_bytes, "--model-bytes"), model_layers, model_vocab).meta,
          layout);
      co_await c.connect("127.0.0.1", port);
      co_await c.call("load_model", layout);
      *out = "";
    } catch (const std::exception& e) {
      *out = e.what();
    }
    c.close();
  }

  // frozen_trainer / staged_kill_after_chunk: the trainer stops (SIGSTOP) or dies
  // (SIGKILL) once every worker has its chunk, before its finish.
  void session_scenario(const std::string& kind, const std::string& commit) {
    ++r_.scenarios;
    json& stats = count_injected(kind);
    const bool frozen = kind == "frozen_trainer";
    const int old_version = version_;
    // The frozen trainer's round is one no other trainer uses: if its late finish
    // were taken, the workers would say that version.
    const int round = frozen ? version_ + 1000 : version_ + 1;
    const std::string name = kind + "#" + std::to_string(r_.scenarios) + " (" + commit + ")";
    std::vector<std::string> missed;
    bool hang = false;
    say(name + ": running");
    // It holds between its chunk and its finish longer than the session timeout
    // (the workers' --timeout-ms); frozen, it resumes after the hold, so its
    // finish comes at once.
    running_trainer t = start_trainer(
        {"--first-round", std::to_string(round), "--updates", "1", "--commit", commit, "--auth-secret-file",
         secret_file_, "--hold-before-finish-ms", std::to_string(o_.timeout_ms * 3)},
        dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + kind + ".log");
    if (!every_chunk_received(std::chrono::milliseconds(o_.timeout_ms * 6) + 20s)) {
      missed.push_back("the workers never all held their chunk");
    }
    const auto stopped_at = clock_type::now();
    kill(t.proc.pid, frozen ? SIGSTOP : SIGKILL);
    // Every session ends (owner silent for the session timeout, or its connection
    // closed) and leaves the old weights: clean at the old version when staged.
    std::vector<std::optional<json>> after(workers_.size());
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      after[i] = settled_info(workers_[i]);
      if (!after[i]) {
        hang = true;
        missed.push_back("worker " + std::to_string(i) + " kept the session of a " + (frozen ? "frozen" : "dead") +
                         " trainer, or stopped answering");
        continue;
      }
      const std::string e = (*after[i])["last_error"].is_string() ? (*after[i])["last_error"].get<std::string>() : "";
      const char* says = frozen ? "sent nothing for" : "closed its connection";
      if (e.find(says) == std::string::npos)
        missed.push_back("worker " + std::to_string(i) + " did not say its session was aborted (" + says + "): '" + e +
                         "'");
      if (std::string why = not_at_a_version(i, *after[i], old_version, std::nullopt, commit); !why.empty()) {
        ++r_.lost;
        r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + why);
      }
    }
    const double aborted_after = std::chrono::duration<double>(clock_type::now() - stopped_at).count();
    if (frozen) {
      // A replacement trainer takes over; then the frozen one resumes, and its
      // finish must be refused and change nothing.
      const bool recovered = recover(name);
      if (recovered)
        ++r_.recoveries;
      else
        ++r_.recoveries_failed;
      kill(t.proc.pid, SIGCONT);
      trainer_result late = wait_trainer(t, std::chrono::milliseconds(o_.timeout_ms * 6) + 20s);
      if (!late.exited) {
        hang = true;
        missed.push_back("the resumed trainer did not exit");
      } else if (WIFEXITED(late.status) && WEXITSTATUS(late.status) == 0) {
        missed.push_back("the resumed trainer's update succeeded");
      } else {
        const std::string e = late.last.is_object() && late.last.contains("error") ? late.last["error"].dump() : "";
        if (e.find("was aborted") == std::string::npos)
          missed.push_back("the resumed trainer was not told its session was aborted: " + e);
      }
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        auto info = settled_info(workers_[i]);
        if (!info) {
          hang = true;
          continue;
        }
        if (std::string why = not_at_a_version(i, *info, version_, std::nullopt, commit); !why.empty()) {
          ++r_.lost;
          r_.problems.push_back(name + ": after the frozen trainer resumed, worker " + std::to_string(i) + " " + why);
        }
      }
    } else {
      wait_trainer(t, 5s);
      if (recover(name))
        ++r_.recoveries;
      else
        ++r_.recoveries_failed;
    }
    if (hang) ++r_.hangs;
    count_verdict(stats, name, missed);
    char took[64];
    std::snprintf(took, sizeof took, "%.2f s", aborted_after);
    say(name + ": " +
        (missed.empty() ? std::string("every session aborted within ") + took +
                              (commit == "staged" ? ", the old weights clean at the old version"
                                                  : ", the weights dirty (in_place)") +
                              (frozen ? "; the resumed trainer was refused" : "")
                        : "MISSED: " + missed.front()));
  }

  void scenario(const std::string& kind, const std::string& commit) {
    ++r_.scenarios;
    const bool chain = kind.rfind("chain_", 0) == 0;
    // The stream the fault is injected in (a chain's only proxied stream is the
    // first hop's), and the worker a kill hits (a chain's: the middle one).
    const int target = chain ? 0 : std::uniform_int_distribution<int>(0, o_.workers - 1)(rng_);
    const int victim = chain ? 1 : target;
    // Up to half of the stream: the rest (over 10 MB) is more than the socket
    // buffers between trainer and proxy hold, so a killed trainer truly cuts it.
    const double fraction = std::uniform_real_distribution<double>(0.05, 0.5)(rng_);
    const std::uint64_t model = 24ull << 20;
    // Over ucx, into the update's part of the side channel (measured: calibrate());
    // a corruption there into one bucket's checksum (see the top of this file).
    const bool corrupts = kind == "corrupt" || kind == "chain_corrupt";
    std::uint64_t at = 300 + static_cast<std::uint64_t>(fraction * model);
    if (!o_.data_proxied()) {
      const auto& [init, update] = side_.at(std::string(chain ? "chain" : "star") + (corrupts ? "+checksums" : ""));
      at = init[target] + static_cast<std::uint64_t>(fraction * update[target]);
      if (corrupts) {
        constexpr std::uint64_t header = 48, done = 24, checksum_at = 16;
        if (update[target] <= header || (update[target] - header) % done != 0)
          throw_error(errc::io_error, "ucx side channel: " + std::to_string(update[target]) +
                                          " bytes per update are not a 48-byte header and 24-byte dones");
        const std::uint64_t buckets = (update[target] - header) / done;
        const auto k = std::uniform_int_distribution<std::uint64_t>(0, buckets - 1)(rng_);
        const auto j = std::uniform_int_distribution<std::uint64_t>(0, 7)(rng_);
        at = init[target] + header + k * done + checksum_at + j;
      }
    }
    const int round = version_ + 1;
    const std::string name = kind + "#" + std::to_string(r_.scenarios) + " (" + commit + ", worker " +
                             std::to_string(target) + ", byte " + std::to_string(at) + ")";
    std::vector<json> before(workers_.size());
    for (std::size_t i = 0; i < workers_.size(); ++i) before[i] = run_sync(call(*workers_[i].client, "weight_info"));

    auto [master, proxies, advertise] = make_proxies();
    process trainer_proc;
    bool killed_worker = false;
    auto& px = *proxies[target];
    px.at = at;
    if (kind == "kill_trainer") {
      px.act = action::kill_trainer;
      px.kill = [&trainer_proc] { kill(trainer_proc.pid, SIGKILL); };
    } else if (kind == "kill_worker" || kind == "chain_kill_middle") {
      px.act = action::kill_worker;
      pid_t pid = workers_[victim].proc.pid;
      px.kill = [pid, &killed_worker] {
        kill(pid, SIGKILL);
        killed_worker = true;
      };
    } else if (kind == "corrupt" || kind == "chain_corrupt") {
      px.act = action::corrupt;
    } else if (kind == "stall") {
      px.act = action::stall;
      px.stall = std::chrono::milliseconds(o_.timeout_ms * 2);
    } else if (kind == "slow") {
      for (auto& p : proxies) {
        p->act = action::throttle;
        p->throttle_bytes_per_s = 40e6;
      }
    }
    // The stale trainer's calls on worker `target`, mid-stream: each outcome is the
    // error kind it got ("" if it was accepted).
    auto stale = std::make_shared<std::vector<std::pair<std::string, std::string>>>();
    auto stale_done = std::make_shared<bool>(false);
    stale_finished_ = false;
    if (kind == "stale_trainer") {
      px.act = action::hook;
      px.kill = [this, target, stale, stale_done] {
        asio::co_spawn(io_, stale_calls(workers_[target].port, stale, stale_done, true), asio::detached);
      };
      px.hold = [stale_done] { return !*stale_done; };
    }
    for (auto& p : proxies) p->start();

    std::vector<std::string> extra = {"--first-round",      std::to_string(round),
                                      "--updates",          "1",
                                      "--commit",           commit,
                                      "--master-port",      std::to_string(master),
                                      "--advertise-port",   advertise,
                                      "--auth-secret-file", kind == "impostor" ? wrong_secret_file_ : secret_file_};
    extra.insert(extra.end(), {"--topology", chain ? "chain" : "star"});
    if (kind == "corrupt" || kind == "chain_corrupt") extra.push_back("--checksums");
    if (kind == "stale_trainer") {
      extra.push_back("--hold-before-finish-ms");
      extra.push_back(std::to_string(o_.timeout_ms / 2));
    }
    say(name + ": running");
    auto result = run_trainer(extra, &proxies, dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + kind + ".log",
                              &trainer_proc);
    bool hang = !result.exited;
    const std::string trainer_error =
        result.last.is_object() && result.last.contains("error") ? result.last["error"].get<std::string>() : "";

    if (kind == "stale_trainer") {
      io_.restart();
      const auto until = clock_type::now() + std::chrono::milliseconds(o_.timeout_ms * 4);
      while (!stale_finished_ && clock_type::now() < until) io_.run_for(20ms);
      json& stats = count_injected(kind);
      std::vector<std::string> missed;
      if (!px.fired) missed.push_back("the point of the stale calls was never reached");
      if (!stale_finished_) missed.push_back("the stale calls did not complete");
      if (stale->size() < 8) missed.push_back("only " + std::to_string(stale->size()) + " of 8 stale calls were made");
      for (const auto& [call, kind_got] : *stale)
        if (kind_got != "invalid_state")
          missed.push_back("the stale " + call + " got '" + kind_got + "', not invalid_state");
      const bool verified = !hang && result.last.is_object() && result.last.value("verified", false);
      if (!verified)
        missed.push_back("the live update did not verify: " +
                         (result.last.is_object() ? result.last.dump() : "no JSON"));
      if (hang) ++r_.hangs;
      if (verified) {
        version_ = round;
        fingerprints_[round] = fingerprint_of(workers_[0]);
      }
      // Whatever happened, a worker that says clean must hold its version's weights.
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        auto info = settled_info(workers_[i]);
        if (!info) continue;
        const std::string state = (*info)["state"];
        const int v = (*info)["weight_version"].is_number_integer() ? (*info)["weight_version"].get<int>() : -1;
        auto known = fingerprints_.find(v);
        if (state == "clean" && (known == fingerprints_.end() ||
                                 !compare_fingerprints(known->second, fingerprint_of(workers_[i])).empty())) {
          ++r_.lost;
          r_.problems.push_back(name + ": worker " + std::to_string(i) + " says clean at version " + std::to_string(v) +
                                " but holds other weights");
        }
      }
      count_verdict(stats, name, missed);
      say(name + ": " +
          (missed.empty() ? "every stale call refused; the live update verified" : "MISSED: " + missed.front()));
      if (!verified) {
        if (recover(name))
          ++r_.recoveries;
        else
          ++r_.recoveries_failed;
      }
      return;
    }
    if (kind == "slow") {
      const bool ok = !hang && result.last.is_object() && result.last.value("verified", false);
      if (ok) {
        ++r_.slow_ok;
        version_ = round;
        fingerprints_[round] = fingerprint_of(workers_[0]);
      } else {
        ++r_.slow_failed;
        r_.problems.push_back(name + ": a slow stream within the deadline failed: " +
                              (result.last.is_object() ? result.last.dump() : "no JSON"));
      }
      if (hang) ++r_.hangs;
      say(name + (ok ? ": completed and verified" : ": FAILED"));
      return;
    }
    json& stats = count_injected(kind);

    // Why the trainer's result holds no error: it reported success, or it printed
    // no result at all (it crashed: under a sanitizer, a report ends the process).
    auto no_trainer_error = [&]() -> std::string {
      if (result.last.is_object()) return "the trainer reported success";
      std::string status = !result.exited               ? "it did not exit"
                           : WIFEXITED(result.status)   ? "exit status " + std::to_string(WEXITSTATUS(result.status))
                           : WIFSIGNALED(result.status) ? "killed by signal " + std::to_string(WTERMSIG(result.status))
                                                        : "status " + std::to_string(result.status);
      return "the trainer printed no result (" + status + "; its log is in " + dir_ + ")";
    };
    // What each side reported.
    bool detected = true;
    std::vector<std::string> missed;
    std::vector<std::optional<json>> after(workers_.size());
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      if (static_cast<int>(i) == victim && killed_worker) continue;
      after[i] = settled_info(workers_[i]);
      if (!after[i]) {
        hang = true;
        missed.push_back("worker " + std::to_string(i) + " stayed busy or stopped answering");
      }
    }
    auto worker_error = [&](std::size_t i) -> std::string {
      if (!after[i]) return {};
      const json& e = (*after[i])["last_error"];
      // A new error since the scenario began.
      if (!e.is_string() || e == before[i]["last_error"]) return {};
      return e.get<std::string>();
    };
    const std::string rank = "rank " + std::to_string(victim + 1);
    if (kind == "kill_trainer") {
      if (!px.fired) missed.push_back("the kill point was never reached");
      // The cut stream must fail; another worker may have received all of its
      // stream before the kill (then its session waits for a finish that never
      // comes: "updating"; or, once the trainer's control connection closed, it
      // was aborted: "dirty", the new weights claimed by no version).
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        const bool aborted = after[i] && before[i]["state"] == "clean" && (*after[i])["state"] == "dirty" &&
                             (*after[i])["dirty_reason"].is_string() &&
                             (*after[i])["dirty_reason"].get<std::string>().find("aborted") != std::string::npos;
        const bool completed = after[i] && ((*after[i])["session_active"] == true || aborted);
        if (worker_error(i).empty() && (static_cast<int>(i) == target || !completed))
          missed.push_back("worker " + std::to_string(i) + " reported no error (" +
                           (after[i] ? after[i]->dump() : std::string("no answer")) + ")");
      }
    } else if (kind == "kill_worker") {
      if (!killed_worker) missed.push_back("the kill point was never reached");
      if (trainer_error.find(rank) == std::string::npos)
        missed.push_back("the trainer did not name the lost " + rank + ": '" + trainer_error + "'");
    } else if (kind == "corrupt") {
      const std::string e = worker_error(target);
      if (e.find("integrity_error") == std::string::npos && e.find("protocol_error") == std::string::npos)
        missed.push_back("worker " + std::to_string(target) + " did not report the corruption: '" + e + "'");
      if (trainer_error.empty()) missed.push_back(no_trainer_error());
    } else if (kind == "chain_kill_middle") {
      if (!killed_worker) missed.push_back("the kill point was never reached");
      if (trainer_error.find(rank) == std::string::npos)
        missed.push_back("the trainer did not name the lost " + rank + ": '" + trainer_error + "'");
      // Every successor fails at once: upstream lost, not a deadline.
      for (std::size_t i = static_cast<std::size_t>(victim) + 1; i < workers_.size(); ++i) {
        const std::string e = worker_error(i);
        if (e.find("peer_lost") == std::string::npos)
          missed.push_back("worker " + std::to_string(i) +
                           " (after the lost one) did not fail at once with peer_lost: '" + e + "'");
        else if (e.find(rank) == std::string::npos && i == static_cast<std::size_t>(victim) + 1)
          missed.push_back("worker " + std::to_string(i) + " did not name the lost " + rank + ": '" + e + "'");
      }
    } else if (kind == "chain_corrupt") {
      const std::string e = worker_error(0);
      if (e.find("integrity_error") == std::string::npos && e.find("protocol_error") == std::string::npos)
        missed.push_back("worker 0 did not report the corruption: '" + e + "'");
      for (std::size_t i = 1; i < workers_.size(); ++i)
        if (worker_error(i).empty())
          missed.push_back("worker " + std::to_string(i) + " (sent the corrupted byte) reported no error");
      if (trainer_error.empty()) missed.push_back(no_trainer_error());
    } else if (kind == "stall") {
      const std::string e = worker_error(target);
      if (e.find("timeout") == std::string::npos)
        missed.push_back("worker " + std::to_string(target) + " did not time out: '" + e + "'");
      if (trainer_error.empty()) missed.push_back(no_trainer_error());
    } else if (kind == "impostor") {
      if (trainer_error.find("auth_error") == std::string::npos)
        missed.push_back("the impostor trainer was not refused: '" + trainer_error + "'");
      // It gives up at the first worker that refuses it.
      bool recorded = false;
      for (std::size_t i = 0; i < workers_.size(); ++i)
        recorded |= after[i] && (*after[i])["last_refused_connection"].is_string() &&
                    (*after[i])["last_refused_connection"] != before[i]["last_refused_connection"];
      if (!recorded) missed.push_back("no worker recorded the refused connection");
    }
    if (result.exited && WIFEXITED(result.status) && WEXITSTATUS(result.status) == 0)
      missed.push_back("the trainer exited with success");
    detected = missed.empty();
    if (hang) ++r_.hangs;

    // Nothing lost: a worker that says clean holds its version's weights; where the
    // update failed, staged left the old weights intact and clean, and in_place
    // either did too or says dirty. (Where it completed but the trainer died before
    // finishing, the worker says "updating": new weights, not yet claimed.)
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      if (!after[i]) continue;
      // Exactly at the old version or the new one (not the new one where its
      // staged update failed), or, in_place only, dirty: claiming no version.
      const bool failed_here = !worker_error(i).empty();
      const bool staged_failure = failed_here && commit == "staged";
      std::string lost =
          not_at_a_version(i, *after[i], version_, staged_failure ? std::nullopt : std::optional<int>(round), commit);
      if (staged_failure && !lost.empty()) lost = "a failed staged update changed the weights: " + lost;
      if (!lost.empty()) {
        ++r_.lost;
        r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + lost);
      }
    }
    count_verdict(stats, name, missed);
    say(name + ": " + (detected ? "detected" : "MISSED: " + missed.front()) +
        (trainer_error.empty() ? "" : "; trainer: " + trainer_error.substr(0, 160)));

    // Recovery: restart a killed worker, then a full update everyone verifies.
    if (killed_worker) {
      wait_exit(workers_[victim].proc.pid, 5s);
      close(workers_[victim].proc.out);
      workers_[victim].client->close();
      workers_[victim] = start_worker(victim);
    }
    if (recover(name))
      ++r_.recoveries;
    else
      ++r_.recoveries_failed;
  }

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

}  // namespace
}  // namespace refit::fault

int main(int argc, char** argv) {
  using namespace refit::fault;
  using refit::json;
  signal(SIGPIPE, SIG_IGN);
  options o;
  o.seed = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) % 1000000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "suite: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--binary")
      o.binary = value();
    else if (a == "--rounds")
      o.rounds = std::max(1, std::atoi(value().c_str()));
    else if (a == "--seed")
      o.seed = std::strtoull(value().c_str(), nullptr, 10);
    else if (a == "--workers")
      o.workers = std::max(1, std::atoi(value().c_str()));
    else if (a == "--timeout-ms")
      o.timeout_ms = std::max(200, std::atoi(value().c_str()));
    else if (a == "--short")
      o.rounds = 1;
    else if (a == "--engine")
      o.engine = value();
    else {
      std::fprintf(stderr,
                   "usage: suite --binary PATH/weight_sync [--rounds N] [--seed S] [--workers N] [--timeout-ms MS] "
                   "[--short] [--engine tcp|ucx]\n");
      return 2;
    }
  }
  if (o.binary.empty()) {
    std::fprintf(stderr, "suite: --binary is required (bazel run //tests/fault:suite passes it)\n");
    return 2;
  }
  if (o.binary.find('/') != std::string::npos && o.binary[0] != '/') {
    char cwd[4096];
    if (getcwd(cwd, sizeof cwd)) o.binary = std::string(cwd) + "/" + o.binary;
  }
  say("seed " + std::to_string(o.seed) + ", " + std::to_string(o.rounds) + " round(s) of every fault, " +
      std::to_string(o.workers) + " workers, engine " + o.engine);
  try {
    suite s(o);
    json r = s.run();
    std::cout << r.dump() << std::endl;
    return r["passed"].get<bool>() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[fault] suite error: %s\n", e.what());
    std::cout << json{{"error", e.what()},  {"faults_injected", 0}, {"faults_detected", 0},
                      {"lost_updates", -1}, {"hangs", -1},          {"passed", false}}
                     .dump()
              << std::endl;
    return 1;
  }
}
