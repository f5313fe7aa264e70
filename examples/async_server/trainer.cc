// The trainer of the async server example: drives an async_server's control port
// with refit's worker group (init with 4 x 256 MiB staging, then updates of the
// whole model), while a client on a thread of its own sends the server requests at
// a steady pace and records their latency by phase: idle (before init), init,
// update (start to finish), verify (the fingerprint check), between (the trainer's
// next step). Every answer is checked against the weights of the version it
// names: the server must never mix two versions.
//
//   async_trainer --server HOST:CONTROL_PORT --serve-port N [--model-bytes 1G]
//                 [--updates 3] [--buffer-bytes 256M] [--num-buffers 4]
//                 [--request-interval-us 1000] [--idle-ms 2000] [--between-ms 500]
//                 [--master-address ADDR] [--timeout-ms MS] [--auth-secret-file PATH] [--shutdown]
//
// The last line on stdout is one JSON object (latency in ms per phase, the
// updates' times, mismatches); exit status 0 when every update was verified and
// no answer mixed versions.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/connect.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include <refit/control/worker_group.h>
#include <refit/refit.h>

#include "examples/async_server/flags.h"
#include "examples/async_server/protocol.h"
#include "examples/weight_sync/model.h"

namespace refit::example {
namespace {

using clock_type = std::chrono::steady_clock;
using asio::ip::tcp;

struct trainer_options {
  std::string host = "127.0.0.1";
  std::string master_address = "127.0.0.1";  // where the server reaches this trainer's data port
  std::uint16_t control_port = 0;
  std::uint16_t serve_port = 0;
  std::uint64_t model_bytes = 1ull << 30;
  int layers = 16;
  std::int64_t vocab = 32000;
  int updates = 3;
  std::uint64_t buffer_bytes = 256ull << 20;
  std::uint32_t num_buffers = 4;
  std::int64_t interval_us = 1000;
  std::int64_t idle_ms = 2000;
  std::int64_t between_ms = 500;
  std::int64_t timeout_ms = 60000;
  bool shutdown = false;
  std::string secret;
};

trainer_options parse(int argc, char** argv) {
  trainer_options o;
  flag_parser f(argc, argv,
                "usage: async_trainer --server HOST:PORT --serve-port N [--model-bytes SIZE] [--layers N]\n"
                "                     [--vocab N] [--updates N] [--buffer-bytes SIZE] [--num-buffers N]\n"
                "                     [--request-interval-us US] [--idle-ms MS] [--between-ms MS]\n"
                "                     [--master-address ADDRESS] [--timeout-ms MS] [--auth-secret-file PATH]\n"
                "                     [--shutdown]  (stop the server at the end)\n");
  bool server = false;
  while (f.next()) {
    if (f.is("--server")) {
      const std::string v = f.value();
      const auto colon = v.rfind(':');
      if (colon == std::string::npos || colon == 0)
        throw_error(errc::invalid_argument, "--server: expected HOST:PORT, got '" + v + "'");
      o.host = v.substr(0, colon);
      char* end = nullptr;
      const long port = std::strtol(v.c_str() + colon + 1, &end, 10);
      if (!end || *end || port < 1 || port > 65535)
        throw_error(errc::invalid_argument, "--server: expected HOST:PORT, got '" + v + "'");
      o.control_port = static_cast<std::uint16_t>(port);
      server = true;
    } else if (f.is("--master-address"))
      o.master_address = f.value();
    else if (f.is("--serve-port"))
      o.serve_port = static_cast<std::uint16_t>(f.integer(1, 65535));
    else if (f.is("--model-bytes"))
      o.model_bytes = parse_bytes(f.value(), "--model-bytes");
    else if (f.is("--layers"))
      o.layers = static_cast<int>(f.integer(1, 1000));
    else if (f.is("--vocab"))
      o.vocab = f.integer(1, 1 << 22);
    else if (f.is("--updates"))
      o.updates = static_cast<int>(f.integer(1, 100000));
    else if (f.is("--buffer-bytes"))
      o.buffer_bytes = parse_bytes(f.value(), "--buffer-bytes");
    else if (f.is("--num-buffers"))
      o.num_buffers = static_cast<std::uint32_t>(f.integer(1, 64));
    else if (f.is("--request-interval-us"))
      o.interval_us = f.integer(10, 10000000);
    else if (f.is("--idle-ms"))
      o.idle_ms = f.integer(0, 600000);
    else if (f.is("--between-ms"))
      o.between_ms = f.integer(0, 600000);
    else if (f.is("--timeout-ms"))
      o.timeout_ms = f.integer(1, 86400000);
    else if (f.is("--auth-secret-file"))
      o.secret = auth::read_secret_file(f.value());
    else if (f.is("--shutdown"))
      o.shutdown = true;
    else
      f.unknown();
  }
  if (!server || !o.serve_port) throw_error(errc::invalid_argument, "--server HOST:PORT and --serve-port are required");
  return o;
}

enum phase : int { idle, init, update, verify, between, phase_count };
const char* phase_names[] = {"idle", "init", "update", "verify", "between"};

// The trainer's weights: one arena, tensors back to back; round r's weights are a
// cheap pattern of (tensor, r).
struct trainer_model {
  update_metadata meta;
  std::vector<std::byte> arena;
  std::vector<tensor_view> views;

  explicit trainer_model(update_metadata m) : meta(std::move(m)), arena(meta.total_bytes()) {
    std::uint64_t at = 0;
    for (const auto& t : meta.tensors) {
      views.emplace_back(t, arena.data() + at);
      at += t.nbytes();
    }
  }
  void step(int round) {
    for (std::size_t i = 0; i < views.size(); ++i) {
      auto bytes = views[i].bytes();
      const std::uint64_t x = (0x9E3779B97F4A7C15ull * (i + 1)) ^ (static_cast<std::uint64_t>(round) << 40);
      auto* words = reinterpret_cast<std::uint64_t*>(bytes.data());
      const std::size_t n = bytes.size() / 8;
      for (std::size_t k = 0; k < n; ++k) words[k] = x + k * 0xBF58476D1CE4E5B9ull;
      for (std::size_t k = n * 8; k < bytes.size(); ++k) bytes[k] = static_cast<std::byte>(x >> (k % 8));
    }
  }
  std::vector<std::uint64_t> digests() const {
    std::vector<std::uint64_t> out;
    for (const auto& v : views) out.push_back(serving::slice_digest(v.bytes()));
    return out;
  }
};

// The request load: one connection, one request every interval (closed loop: the
// next is sent when both the answer is in and its time has come), on its own
// thread and event loop, so the trainer's work does not delay it.
class load_client {
 public:
  struct sample {
    double latency_ms;
    int phase;
    std::uint32_t tensor;
    std::int64_t version;
    std::uint64_t digest;
  };

  load_client(std::string host, std::uint16_t port, std::chrono::microseconds interval, std::size_t tensors)
      : host_(std::move(host)), port_(port), interval_(interval), tensors_(tensors) {}

  void start() {
    thread_ = std::thread([this] {
      asio::co_spawn(io_, run(), [this](std::exception_ptr e) {
        if (e) {
          try {
            std::rethrow_exception(e);
          } catch (const std::exception& x) {
            error_ = x.what();
          }
        }
      });
      io_.run();
    });
  }
  void set_phase(int p) { phase_.store(p); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  const std::vector<sample>& samples() const { return samples_; }
  const std::string& error() const { return error_; }

 private:
  asio::awaitable<void> run() {
    tcp::socket socket(io_);
    tcp::resolver resolver(io_);
    co_await asio::async_connect(socket, resolver.resolve(host_, std::to_string(port_)), asio::use_awaitable);
    socket.set_option(tcp::no_delay(true));
    asio::steady_timer timer(io_);
    auto next = clock_type::now();
    std::byte request[serving::request_bytes] = {};
    std::byte answer[serving::answer_bytes];
    for (std::uint64_t id = 0; !stop_.load(); ++id) {
      next += interval_;
      if (next > clock_type::now()) {
        timer.expires_at(next);
        co_await timer.async_wait(asio::use_awaitable);
      } else {
        next = clock_type::now();  // late: do not send a burst to catch up
      }
      const auto tensor = static_cast<std::uint32_t>(id % tensors_);
      std::memcpy(request, &id, 8);
      std::memcpy(request + 8, &tensor, 4);
      const int p = phase_.load();
      const auto t0 = clock_type::now();
      co_await asio::async_write(socket, asio::buffer(request), asio::use_awaitable);
      co_await asio::async_read(socket, asio::buffer(answer), asio::use_awaitable);
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      std::uint64_t got_id, digest;
      std::int64_t version;
      std::memcpy(&got_id, answer, 8);
      std::memcpy(&version, answer + 8, 8);
      std::memcpy(&digest, answer + 16, 8);
      if (got_id != id)
        throw_error(errc::protocol_error,
                    "answer for request " + std::to_string(got_id) + ", expected " + std::to_string(id));
      samples_.push_back({ms, p, tensor, version, digest});
    }
  }

  std::string host_;
  std::uint16_t port_;
  std::chrono::microseconds interval_;
  std::size_t tensors_;
  asio::io_context io_;
  std::thread thread_;
  std::atomic<int> phase_{idle};
  std::atomic<bool> stop_{false};
  std::vector<sample> samples_;
  std::string error_;
};

json latency_summary(std::vector<double> ms) {
  if (ms.empty()) return json{{"requests", 0}};
  std::sort(ms.begin(), ms.end());
  auto rank = [&](double q) { return ms[std::min(ms.size() - 1, static_cast<std::size_t>(q * ms.size()))]; };
  return json{{"requests", ms.size()}, {"p50_ms", rank(0.50)}, {"p99_ms", rank(0.99)}, {"max_ms", ms.back()}};
}

asio::awaitable<void> sleep_ms(std::int64_t ms) {
  asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(ms));
  co_await t.async_wait(asio::use_awaitable);
}

struct outcome {
  double init_seconds = 0;
  std::vector<double> update_seconds;
  int verified = 0;
  json server;
  json loop_lag;
};

asio::awaitable<void> drive(const trainer_options& o, trainer_model& model, load_client& client,
                            std::map<std::int64_t, std::vector<std::uint64_t>>& expected, std::mutex& expected_mutex,
                            outcome& out) {
  auto ex = co_await asio::this_coro::executor;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  control::worker_group workers(ex, timeout, o.secret, {{o.host, o.control_port}});
  co_await workers.connect();

  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = timeout;
  config.auth_secret = o.secret;
  auto sender = engine_factory::instance().create_sender(config, trainer_context{ex, {}});
  json args = {{"master_address", o.master_address},
               {"master_port", 0},
               {"world_size", 2},
               {"buffer_bytes", o.buffer_bytes},
               {"num_buffers", o.num_buffers},
               {"timeout_ms", o.timeout_ms}};

  client.set_phase(idle);
  co_await sleep_ms(o.idle_ms);
  co_await workers.call_all("loop_lag");  // the server's stalls from here on
  client.set_phase(init);
  auto t0 = clock_type::now();
  co_await workers.init(*sender, args);
  out.init_seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  client.set_phase(between);
  co_await sleep_ms(o.between_ms);

  for (int v = 1; v <= o.updates; ++v) {
    model.step(v);
    {
      std::lock_guard lock(expected_mutex);
      expected[v] = model.digests();
    }
    const fingerprint_list want = fingerprint_all(model.views);
    control::update_options options;
    options.verify = false;  // checked below, in a phase of its own
    client.set_phase(update);
    auto result = co_await workers.update(*sender, model.meta, model.views, v, options);
    out.update_seconds.push_back(result.seconds);
    client.set_phase(verify);
    co_await workers.verify(want, v);
    ++out.verified;
    client.set_phase(between);
    std::fprintf(stderr, "[trainer] update %d: %.2f GB in %.3f s, verified\n", v, model.meta.total_bytes() / 1e9,
                 result.seconds);
    co_await sleep_ms(o.between_ms);
  }
  out.loop_lag = (co_await workers.call_all("loop_lag"))[0];
  out.server = (co_await workers.call_all("serving_stats"))[0];
  if (o.shutdown) {
    client.stop();  // the requests end before the server does
    co_await workers.call_all("shutdown");
  }
  workers.close();
  sender->shutdown();
}

int run(const trainer_options& o) {
  const model_layout layout = make_layout(o.model_bytes, o.layers, o.vocab);
  trainer_model model(layout.meta);
  std::map<std::int64_t, std::vector<std::uint64_t>> expected;
  std::mutex expected_mutex;
  {
    std::vector<std::byte> zeros(serving::slice_bytes);
    std::vector<std::uint64_t> initial;
    for (const auto& v : model.views)
      initial.push_back(serving::slice_digest(
          std::span<const std::byte>(zeros.data(), std::min<std::size_t>(zeros.size(), v.bytes().size()))));
    expected[0] = std::move(initial);
  }

  load_client client(o.host, o.serve_port, std::chrono::microseconds(o.interval_us), model.views.size());
  client.start();
  outcome out;
  std::string failure;
  try {
    asio::io_context io;
    std::exception_ptr error;
    asio::co_spawn(io, drive(o, model, client, expected, expected_mutex, out),
                   [&](std::exception_ptr e) { error = e; });
    io.run();
    if (error) std::rethrow_exception(error);
  } catch (const refit::error& e) {
    failure = std::string(errc_name(e.kind())) + ": " + e.message();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  client.stop();
  if (failure.empty() && !client.error().empty()) failure = "request client: " + client.error();

  std::vector<double> by_phase[phase_count];
  std::uint64_t mismatches = 0, busy = 0, unversioned = 0;
  std::string first_mismatch;
  for (const auto& s : client.samples()) {
    by_phase[s.phase].push_back(s.latency_ms);
    if (s.version == serving::version_busy) {
      ++busy;
      continue;
    }
    if (s.version == serving::version_none) {
      ++unversioned;
      continue;
    }
    auto it = expected.find(s.version);
    if (it == expected.end() || it->second.at(s.tensor) != s.digest) {
      if (first_mismatch.empty())
        first_mismatch = "tensor " + std::to_string(s.tensor) + " answered as version " + std::to_string(s.version) +
                         (it == expected.end() ? " (never sent)" : " with other bytes");
      ++mismatches;
    }
  }
  json phases = json::object();
  for (int p = 0; p < phase_count; ++p) phases[phase_names[p]] = latency_summary(by_phase[p]);
  const bool ok = failure.empty() && mismatches == 0 && out.verified == o.updates;
  json result = {{"bytes", model.meta.total_bytes()},
                 {"tensors", model.meta.tensors.size()},
                 {"buffer_bytes", o.buffer_bytes},
                 {"num_buffers", o.num_buffers},
                 {"request_interval_us", o.interval_us},
                 {"latency", phases},
                 {"init_seconds", out.init_seconds},
                 {"update_seconds", out.update_seconds},
                 {"updates_verified", out.verified},
                 {"answers_mismatched", mismatches},
                 {"answers_busy", busy},
                 {"answers_unversioned", unversioned},
                 {"server", out.server},
                 {"server_loop_lag", out.loop_lag},
                 {"ok", ok}};
  if (!first_mismatch.empty()) result["first_mismatch"] = first_mismatch;
  if (!failure.empty()) {
    result["error"] = failure;
    std::fprintf(stderr, "[trainer] error: %s\n", failure.c_str());
  }
  std::cout << result.dump() << std::endl;
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace refit::example

int main(int argc, char** argv) {
  try {
    return refit::example::run(refit::example::parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "async_trainer: %s\n", e.what());
    return 2;
  }
}
