// The control plane under load while weights move: a worker process (the main
// job's, examples/weight_sync --role worker) receives 1 GiB updates over TCP from
// this process, first with nobody else talking to it (idle), then while 200
// clients poll its weight_info and one more pipelines requests without waiting
// for answers (loaded). Measured in the same run, medians of --rounds updates:
//
//   update_ratio   loaded update time / idle update time     (target <= 1.2)
//   answer p50/p99 of the polling clients' weight_info calls (target p99 < 5 ms)
//   rss_growth     the worker's RSS after the loaded rounds minus before (< 50 MiB)
//   loop lag       the worker's largest event-loop stall, idle and loaded
//
// Prints one JSON line.
//
//   control_bench --worker-bin PATH/weight_sync [--model-bytes 1G] [--rounds 3]
//                 [--clients 200] [--poll-ms 20] [--pipeline 64]
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/handshake.h>
#include <refit/backend/net.h>
#include <refit/control/client.h>
#include <refit/control/internal/frame.h>
#include <refit/control/worker_group.h>
#include <refit/engines/tcp/tcp.h>
#include "tests/support/wait.h"

namespace refit::bench {
namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string worker_bin;
  std::uint64_t model_bytes = 1ull << 30;
  int rounds = 3;
  int clients = 200;
  int poll_ms = 20;
  int pipeline = 64;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<std::size_t>(p * v.size()))];
}

std::uint64_t rss_of(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      std::uint64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

// Starts the worker; reads its port line.
pid_t start_worker(const std::string& bin, std::uint16_t* port) {
  int fds[2];
  if (pipe(fds) != 0) throw_error(errc::io_error, "pipe failed");
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    execl(bin.c_str(), bin.c_str(), "--role", "worker", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::string line;
  char c;
  while (read(fds[0], &c, 1) == 1 && c != '\n') line += c;
  close(fds[0]);
  unsigned p = 0;
  if (std::sscanf(line.c_str(), "REFIT_WORKER_PORT %u", &p) != 1) {
    kill(pid, SIGKILL);
    throw_error(errc::protocol_error, "the worker printed '" + line + "'");
  }
  *port = static_cast<std::uint16_t>(p);
  return pid;
}

struct trainer {
  asio::io_context& io;
  std::uint16_t port;
  options o;
  std::unique_ptr<control::worker_group> workers;  // the one worker
  std::unique_ptr<tcp::sender> sender;
  update_metadata meta;
  std::vector<std::vector<std::byte>> data;
  std::vector<tensor_view> views;
  int version = 0;

  asio::awaitable<void> setup() {
    std::vector<control::worker_endpoint> endpoints;
    endpoints.push_back({"127.0.0.1", port});
    workers = std::make_unique<control::worker_group>(io.get_executor(), 60s, "", std::move(endpoints));
    co_await workers->connect();
    weight_transfer_config config;
    config.timeout = 60s;
    sender = std::make_unique<tcp::sender>(config, trainer_context{io.get_executor(), {}});
    const int tensors = 64;
    const std::int64_t elems = static_cast<std::int64_t>(o.model_bytes / 2 / tensors);
    for (int i = 0; i < tensors; ++i) {
      meta.tensors.push_back({"layers." + std::to_string(i) + ".w", dtype::bfloat16, {elems}});
      data.emplace_back(static_cast<std::size_t>(elems * 2), std::byte(i));
    }
    for (std::size_t i = 0; i < data.size(); ++i) views.emplace_back(meta.tensors[i], data[i].data());
    json info = json::object();
    write_update_metadata(meta, info);
    co_await workers->call_all("load_model", info);  // the worker allocates its model once
    json args = {{"master_address", "127.0.0.1"},
                 {"master_port", 0},
                 {"world_size", 2},
                 {"buffer_bytes", 64 << 20},
                 {"num_buffers", 2}};
    co_await workers->init(*sender, args);
  }

  // One update (start, update_weights alongside the send, finish); returns its
  // seconds. Unverified: the bench times the transfer alone.
  asio::awaitable<double> update() {
    control::update_options unchecked;
    unchecked.verify = false;
    const auto result = co_await workers->update(*sender, meta, views, ++version, unchecked);
    co_return result.seconds;
  }

  asio::awaitable<json> call(std::string method) { co_return co_await workers->at(0).call(std::move(method)); }
};

// The load: polling clients (one weight_info at a time each, every poll_ms) and a
// pipelining client (keeps `pipeline` requests outstanding, never waits for one).
struct load {
  asio::io_context io;
  std::atomic<bool> stop{false};
  std::vector<double> latencies_ms;  // the polling clients' answers
  std::uint64_t flood_answers = 0, flood_sent = 0;
  std::shared_ptr<control::frame_stream> flood_stream;
  std::atomic<int> ready{0};  // pollers answered once, and the flood connected

  // From any thread: stops the load, the flood's pending read included.
  void finish() {
    asio::post(io, [this] {
      stop = true;
      if (flood_stream) flood_stream->close();
    });
  }
  std::uint64_t errors = 0;
  std::string first_error;

  asio::awaitable<void> poller(std::uint16_t port, int poll_ms, int offset_ms) {
    control::client c(io.get_executor(), 10s);
    try {
      co_await c.connect("127.0.0.1", port);
      asio::steady_timer t(io);
      t.expires_after(std::chrono::milliseconds(offset_ms));
      co_await t.async_wait(asio::use_awaitable);
      const std::string method = "weight_info";
      bool polling = false;
      while (!stop) {
        const auto t0 = clock_type::now();
        co_await c.call(method);
        latencies_ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
        if (!polling) {
          polling = true;
          ++ready;
        }
        t.expires_at(t0 + std::chrono::milliseconds(poll_ms));
        co_await t.async_wait(asio::use_awaitable);
      }
    } catch (const error& e) {
      ++errors;
      if (first_error.empty()) first_error = e.message();
    }
    c.close();
  }

  asio::awaitable<void> flood(std::uint16_t port, int pipeline) {
    try {
      auto s = co_await net::connect_with_retry("127.0.0.1", port, 10s, "flood");
      co_await auth::as_client(s, "", 10s, "flood");
      auto f = std::make_shared<control::frame_stream>(std::move(s));
      flood_stream = f;
      ++ready;
      std::string frame;
      {
        const std::string body = json{{"id", 1}, {"method", "weight_info"}}.dump();
        const auto n = static_cast<std::uint32_t>(body.size());
        frame = {char(n >> 24), char(n >> 16), char(n >> 8), char(n)};
        frame += body;
      }
      auto burst = std::make_shared<std::string>();
      for (int i = 0; i < pipeline; ++i) *burst += frame;
      // Keeps `pipeline` requests outstanding; `this` (the load) outlives its io.
      auto writer = [](std::shared_ptr<control::frame_stream> f, std::shared_ptr<std::string> burst, load* l,
                       int pipeline) -> asio::awaitable<void> {
        asio::steady_timer t(f->socket().get_executor());
        try {
          while (!l->stop) {
            if (l->flood_sent - l->flood_answers < static_cast<std::uint64_t>(pipeline)) {
              co_await asio::async_write(f->socket(), asio::buffer(*burst), asio::use_awaitable);
              l->flood_sent += pipeline;
            } else {
              t.expires_after(100us);
              co_await t.async_wait(asio::use_awaitable);
            }
          }
        } catch (const std::exception&) {  // closed at the end
        }
      };
      asio::co_spawn(io, writer(f, burst, this, pipeline), asio::detached);
      while (!stop) {
        co_await f->read(10s, false, "flood answer");
        ++flood_answers;
      }
      f->close();
    } catch (const error& e) {
      if (!stop) {
        ++errors;
        if (first_error.empty()) first_error = "flood: " + e.message();
      }
    }
  }
};

int run(const options& o) {
  std::uint16_t port = 0;
  const pid_t worker = start_worker(o.worker_bin, &port);
  asio::io_context io;
  trainer t{io, port, o};
  json result;
  auto run_sync = [&io](auto awaitable) {
    std::exception_ptr error;
    bool done = false;
    asio::co_spawn(io, std::move(awaitable), [&](std::exception_ptr e, auto...) {
      error = e;
      done = true;
    });
    io.restart();
    while (!done) io.run_one();
    if (error) std::rethrow_exception(error);
  };
  try {
    run_sync(t.setup());
    std::vector<double> idle, loaded;
    double warm = 0;
    run_sync([&]() -> asio::awaitable<void> { warm = co_await t.update(); }());  // first touch of the model
    (void)warm;
    run_sync([&]() -> asio::awaitable<void> { co_await t.call("loop_lag"); }());
    for (int r = 0; r < o.rounds; ++r)
      run_sync([&]() -> asio::awaitable<void> { idle.push_back(co_await t.update()); }());
    json lag_idle, lag_loaded;
    run_sync([&]() -> asio::awaitable<void> { lag_idle = co_await t.call("loop_lag"); }());
    const std::uint64_t rss_before = rss_of(worker);

    // The load runs on a thread of its own, so it competes for the worker, not for
    // this trainer's loop.
    load l;
    for (int i = 0; i < o.clients; ++i)
      asio::co_spawn(l.io, l.poller(port, o.poll_ms, (i * o.poll_ms) / std::max(1, o.clients)), asio::detached);
    asio::co_spawn(l.io, l.flood(port, o.pipeline), asio::detached);
    std::thread load_thread([&l] { l.io.run(); });
    // Every client connected and polling (a client that fails shows in the errors).
    testing::poll_until([&] { return l.ready.load() >= o.clients + 1; }, 10s);
    for (int r = 0; r < o.rounds; ++r)
      run_sync([&]() -> asio::awaitable<void> { loaded.push_back(co_await t.update()); }());
    run_sync([&]() -> asio::awaitable<void> { lag_loaded = co_await t.call("loop_lag"); }());
    const std::uint64_t rss_after = rss_of(worker);
    l.finish();
    load_thread.join();

    const double idle_s = median(idle), loaded_s = median(loaded);
    result = {{"bench", "control_plane_load"},
              {"model_bytes", o.model_bytes},
              {"rounds", o.rounds},
              {"clients", o.clients},
              {"poll_ms", o.poll_ms},
              {"pipeline", o.pipeline},
              {"idle_update_s",
               {{"median", idle_s},
                {"min", *std::min_element(idle.begin(), idle.end())},
                {"max", *std::max_element(idle.begin(), idle.end())}}},
              {"loaded_update_s",
               {{"median", loaded_s},
                {"min", *std::min_element(loaded.begin(), loaded.end())},
                {"max", *std::max_element(loaded.begin(), loaded.end())}}},
              {"update_ratio", idle_s > 0 ? loaded_s / idle_s : 0.0},
              {"answers", l.latencies_ms.size()},
              {"answer_p50_ms", percentile(l.latencies_ms, 0.5)},
              {"answer_p99_ms", percentile(l.latencies_ms, 0.99)},
              {"flood_answers", l.flood_answers},
              {"client_errors", l.errors},
              {"rss_growth_bytes", static_cast<std::int64_t>(rss_after) - static_cast<std::int64_t>(rss_before)},
              {"worker_loop_lag_ms", {{"idle", lag_idle["max_ms"]}, {"loaded", lag_loaded["max_ms"]}}},
              {"targets", {{"update_ratio", "<= 1.2"}, {"answer_p99_ms", "< 5"}, {"rss_growth_bytes", "< 50 MiB"}}}};
    if (!l.first_error.empty()) result["first_client_error"] = l.first_error;
    run_sync([&]() -> asio::awaitable<void> { co_await t.call("shutdown"); }());
  } catch (const std::exception& e) {
    result = {{"bench", "control_plane_load"}, {"error", e.what()}};
  }
  t.sender->shutdown();
  kill(worker, SIGTERM);
  std::printf("%s\n", result.dump().c_str());
  return result.contains("error") ? 1 : 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  refit::bench::options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--worker-bin")
      o.worker_bin = v;
    else if (a == "--model-bytes")
      o.model_bytes = std::stoull(v) << (v.back() == 'G' ? 30 : v.back() == 'M' ? 20 : 0);
    else if (a == "--rounds")
      o.rounds = std::stoi(v);
    else if (a == "--clients")
      o.clients = std::stoi(v);
    else if (a == "--poll-ms")
      o.poll_ms = std::stoi(v);
    else if (a == "--pipeline")
      o.pipeline = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (o.worker_bin.empty()) {
    std::fprintf(stderr, "usage: control_bench --worker-bin PATH/weight_sync [options]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  return refit::bench::run(o);
}
