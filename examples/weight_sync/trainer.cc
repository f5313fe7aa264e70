// The one-trainer job: starts --workers worker processes of this binary (or
// drives running ones, --connect), sends --updates rounds of changed weights
// through the control plane and a refit backend, verifies every tensor on every
// worker after each round, and prints one JSON line. The fault suite and the
// benchmarks drive it with --connect, --first-round, --hold-before-finish-ms.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/control/worker_group.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/integrity/fingerprint.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>
#include "examples/weight_sync/job.h"
#include "examples/weight_sync/verify.h"

namespace refit::example::weight_sync {

std::string host_of(const options& o, std::size_t child) {
  return child < o.spawn_hosts.size() ? o.spawn_hosts[child] : o.listen;
}

std::vector<std::string> launcher_of(const options& o, std::size_t child) {
  std::vector<std::string> words;
  std::size_t at = 0;
  while (at < o.spawn_via.size()) {
    const auto space = o.spawn_via.find(' ', at);
    const auto end = space == std::string::npos ? o.spawn_via.size() : space;
    if (end > at) words.push_back(o.spawn_via.substr(at, end - at));
    at = end + 1;
  }
  if (!words.empty()) words.push_back(host_of(o, child));
  return words;
}

// Starts this binary as a worker and reads the control port it prints.
worker_process start_worker(const options& o, int index) {
  std::vector<std::string> args = {"weight_sync",
                                   "--role",
                                   "worker",
                                   "--engine",
                                   o.engine,
                                   "--timeout-ms",
                                   std::to_string(o.timeout_ms),
                                   "--process-cost",
                                   std::to_string(o.process_cost),
                                   "--commit",
                                   std::string(to_string(o.commit)),
                                   "--listen",
                                   host_of(o, static_cast<std::size_t>(index))};
  if (o.no_direct) args.push_back("--no-direct");
  if (o.sharded_job() && o.broadcast) {  // today's tensor parallelism: the whole stream, sliced on arrival
    args.push_back("--slice-tp");
    args.push_back(std::to_string(o.tp));
    args.push_back("--tp-rank");
    args.push_back(std::to_string(index));
  }
  if (!o.secret_file.empty()) {
    args.push_back("--auth-secret-file");
    args.push_back(o.secret_file);
  }
  return start_worker_process(args, std::chrono::milliseconds(o.timeout_ms), "worker " + std::to_string(index),
                              launcher_of(o, static_cast<std::size_t>(index)));
}

namespace {

// --replay: DIR/step-NNNN.bin, the trajectory's state for the update numbered `i`
// from 0.
std::string replay_step(const options& o, int i) {
  char name[32];
  std::snprintf(name, sizeof name, "/step-%04d.bin", i);
  return o.replay + name;
}

struct totals {
  double seconds = 0, receive_s = 0, process_s = 0, overlap = 0;
  double lag_init_ms = 0, lag_update_ms = 0;  // workers' largest event-loop stalls
  double lag_update_p99_ms = 0;
  int overlap_samples = 0;
  std::vector<double> update_seconds;  // each update's time (the first pays for first touches)
  // Each update's payload bytes to one worker: with --delta what the sender
  // sent a worker that took the deltas (headers not counted), else the model's bytes.
  std::vector<std::uint64_t> wire_bytes;
  std::uint64_t full_fallbacks = 0, encoded_buckets = 0;  // --delta: summed over the updates
  double encode_s = 0;
  // The whole worker_group::update call: also its update_info JSON before the
  // workers are called (what a Python trainer's figure includes).
  std::vector<double> update_call_seconds;
  std::uint64_t peak_rss = 0;
  // Each update's worker CPU seconds (user + system, every thread), averaged over
  // the workers: from just before the update to its end (verification not
  // included). Only with workers of this binary (worker_stats).
  std::vector<double> worker_cpu_s;
  json transports = json::array();  // what each worker's transport chose (ucx), from the last update's stats
  verification check;
};

asio::awaitable<void> trainer_main(const options& o, const std::vector<worker_process>& procs, trainer_model& model,
                                   totals& t) {
  auto ex = co_await asio::this_coro::executor;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  std::vector<control::worker_endpoint> endpoints;
  for (std::size_t i = 0; i < procs.size(); ++i) {
    const std::string host = i < o.connect.size() && !o.connect[i].host.empty() ? o.connect[i].host : o.listen;
    endpoints.push_back({host, procs[i].port});
  }
  // Errors name the worker by index and data rank.
  control::worker_group workers(ex, timeout, o.secret, std::move(endpoints), [](std::size_t i) {
    return "worker " + std::to_string(i) + " (rank " + std::to_string(i + 1) + ")";
  });
  co_await workers.connect();

  weight_transfer_config config;
  config.backend = o.engine;
  config.timeout = timeout;
  config.auth_secret = o.secret;
  auto sender = engine_factory::instance().create_sender(config, trainer_context{ex, {}});
  json trainer_args = {{"master_address", o.listen},     {"master_port", o.master_port}, {"world_size", o.workers + 1},
                       {"buffer_bytes", o.buffer_bytes}, {"num_buffers", o.num_buffers}, {"checksums", o.checksums},
                       {"timeout_ms", o.timeout_ms}};
  if (!o.topology.empty()) trainer_args["topology"] = o.topology;
  if (o.delta) trainer_args["delta"] = true;  // (flags checked the engine is tcp or ucx)
  // Each worker is its own inference engine here, so each gets its own rank (the
  // group's default); proxies in front of the trainer are advertised instead.
  control::init_options init;
  init.adjust = [&o](std::size_t i, json& info) {
    if (!o.advertise.empty()) {
      // The proxies learn where to forward from this line (the port is bound by
      // now, before any worker hears of it): a port picked for the trainer
      // beforehand can be taken by another process in between.
      if (i == 0) {
        std::printf("REFIT_MASTER_PORT %u\n", info["master_port"].get<unsigned>());
        std::fflush(stdout);
      }
      info["master_port"] = o.advertise[o.advertise.size() == 1 ? 0 : i];
    }
    if (o.ucx_put_into_model) info["put_into_model"] = *o.ucx_put_into_model;
  };
  const json empty = json::object();
  // Workers of this binary answer loop_lag (their event loop's largest stall);
  // other workers (--connect) may not.
  bool probed = true;
  try {
    co_await workers.call_all("loop_lag", empty);
  } catch (const error&) {
    probed = false;
  }
  co_await workers.init(*sender, trainer_args, init);
  if (probed)
    for (const auto& lag : co_await workers.call_all("loop_lag", empty))
      t.lag_init_ms = std::max(t.lag_init_ms, lag["max_ms"].get<double>());
  if (!o.quiet) std::fprintf(stderr, "[refit] %d workers connected over %s\n", o.workers, o.engine.c_str());

  json layout_info = json::object();
  write_update_metadata(model.layout.meta, layout_info);
  if (o.load_model) co_await workers.call_all("load_model", layout_info);
  control::update_options update;
  update.commit = o.commit;
  update.fleet_atomic = o.fleet_atomic;
  update.verify = false;  // checked below, after the loop-lag probe, counting every difference
  update.hold_before_finish = std::chrono::milliseconds(o.hold_before_finish_ms);
  const std::uint64_t bytes = model.layout.meta.total_bytes();
  // A fleet-atomic update keeps each worker's previous version: workers that hold
  // none yet (never updated) get their first update staged, not fleet-atomic.
  bool first_without_undo = false;
  if (o.fleet_atomic)
    for (const auto& info : co_await workers.call_all("weight_info", empty))
      first_without_undo = first_without_undo || info["weight_version"].is_null();
  for (int round = o.first_round; round < o.first_round + o.updates; ++round) {
    update.fleet_atomic = o.fleet_atomic && !(first_without_undo && round == o.first_round);
    if (o.replay.empty())
      model.step(round);
    else
      model.load(replay_step(o, round - o.first_round));
    auto expected = fingerprint_all(model.views);
    if (probed) co_await workers.call_all("loop_lag", empty);
    std::vector<json> cpu_before;  // (no co_await inside ?: with GCC 12: it destroys a temporary twice)
    if (probed) cpu_before = co_await workers.call_all("worker_stats", empty);
    const auto call_start = std::chrono::steady_clock::now();
    const auto result = co_await workers.update(*sender, model.layout.meta, model.views, round, update);
    t.update_call_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count());
    const double seconds = result.seconds;
    t.seconds += seconds;
    t.update_seconds.push_back(seconds);
    std::uint64_t wire = bytes;
    if (o.delta) {
      // What the sender did with deltas (its last_send_info()).
      const json info = sender->last_send_info();
      if (!info.is_object() || !info.contains("delta"))
        throw_error(errc::invalid_argument, "--delta: the " + o.engine + " sender reports no deltas");
      const json& d = info["delta"];
      const auto u64 = [&d](const char* k) { return d.at(k).get<std::uint64_t>(); };
      // A worker that took the deltas got them and the buckets no delta made smaller.
      if (u64("base_version") != 0 && u64("delta_workers") > 0)
        wire = u64("full_bytes") - u64("encoded_full") + u64("delta_bytes");
      t.full_fallbacks += u64("full_fallbacks");
      t.encoded_buckets += u64("encoded_buckets");
      t.encode_s += d.at("encode_s").get<double>();
    }
    t.wire_bytes.push_back(wire);
    if (probed) {
      const auto cpu_after = co_await workers.call_all("worker_stats", empty);
      double sum = 0;
      for (std::size_t i = 0; i < cpu_after.size(); ++i)
        sum += cpu_after[i]["cpu_seconds"].get<double>() - cpu_before.at(i)["cpu_seconds"].get<double>();
      t.worker_cpu_s.push_back(sum / static_cast<double>(cpu_after.size()));
    }
    if (probed)
      for (const auto& lag : co_await workers.call_all("loop_lag", empty)) {
        t.lag_update_ms = std::max(t.lag_update_ms, lag["max_ms"].get<double>());
        t.lag_update_p99_ms = std::max(t.lag_update_p99_ms, lag["p99_ms"].get<double>());
      }
    t.transports = json::array();
    for (const auto& w : result.workers) {
      const json& s = w.stats;
      if (s.contains("transport")) t.transports.push_back(s["transport"]);
      t.receive_s += s["receive_s"].get<double>() / o.workers;
      t.process_s += s["process_s"].get<double>() / o.workers;
      t.overlap += s["overlap"].get<double>();
      ++t.overlap_samples;
    }
    // Every tensor on every worker against the trainer's own.
    const std::size_t bad = co_await verify_round(workers, std::move(expected), round, t.check);
    if (!o.quiet)
      std::fprintf(stderr, "[refit] update %d (%d/%d): %.2f GB -> %d workers in %.2f s (%.2f GB/s per worker), %s\n",
                   round, round - o.first_round + 1, o.updates, bytes / 1e9, o.workers, seconds, bytes / seconds / 1e9,
                   verdict(bad).c_str());
  }
  const auto stats = co_await workers.call_all("worker_stats", empty);
  for (const auto& s : stats) t.peak_rss = std::max(t.peak_rss, s["peak_rss_bytes"].get<std::uint64_t>());
  if (o.connect.empty()) {  // workers this trainer started end with it
    try {
      co_await workers.call_all("shutdown", empty);
    } catch (const error&) {
    }
  }
  sender->shutdown();
  workers.close();
}

model_layout layout_for(const options& o) {
  if (!o.replay.empty()) {
    std::ifstream in(o.replay + "/layout.json");
    if (!in) throw_error(errc::invalid_argument, "--replay: no " + o.replay + "/layout.json");
    json j = json::parse(in, nullptr, false);
    if (j.is_discarded()) throw_error(errc::invalid_argument, "--replay: " + o.replay + "/layout.json is not JSON");
    json_reader r(j, o.replay + "/layout.json");
    model_layout l;
    l.meta = read_update_metadata(r);
    r.finish();
    for (int i = 0; i < o.updates; ++i)
      if (!std::ifstream(replay_step(o, i)))
        throw_error(errc::invalid_argument, "--replay: " + std::to_string(o.updates) + " updates need " +
                                                replay_step(o, i) + " (the trajectory has fewer states)");
    return l;
  }
  if (!o.one_tensor) return make_layout(o.model_bytes, o.layers, o.vocab);
  if (o.model_bytes < 2) throw_error(errc::invalid_argument, "--one-tensor: --model-bytes must be at least 2");
  model_layout l;
  l.layers = 0;
  l.meta.tensors.push_back({"weight", dtype::bfloat16, {static_cast<std::int64_t>(o.model_bytes / 2)}});
  return l;
}

}  // namespace

int run_trainer(const options& o) {
  if (o.print_layout) {
    json layout = json::object();
    write_update_metadata(layout_for(o).meta, layout);
    std::cout << layout.dump() << std::endl;
    return 0;
  }
  trainer_model model(layout_for(o), o.change_fraction);
  const auto& meta = model.layout.meta;
  if (!o.quiet)
    std::fprintf(stderr, "[refit] model: %zu tensors, %.2f GB bf16 (hidden %lld, %d layers); %d workers, engine %s\n",
                 meta.tensors.size(), meta.total_bytes() / 1e9, static_cast<long long>(model.layout.hidden), o.layers,
                 o.workers, o.engine.c_str());
  std::vector<worker_process> procs;
  totals t;
  std::string failure;
  try {
    if (o.connect.empty())
      for (int i = 0; i < o.workers; ++i) procs.push_back(start_worker(o, i));
    else
      for (const auto& e : o.connect) procs.push_back(worker_process{-1, e.port});
    asio::io_context io;
    std::exception_ptr error;
    asio::co_spawn(io, trainer_main(o, procs, model, t), [&](std::exception_ptr e) { error = e; });
    io.run();
    if (error) std::rethrow_exception(error);
  } catch (...) {
    failure = describe(std::current_exception());
  }
  if (!failure.empty()) {
    t.check.verified = false;
    std::fprintf(stderr, "[refit] error: %s\n", failure.c_str());
  }
  for (auto& p : procs) {
    if (p.pid < 0) continue;  // --connect: not ours
    if (!failure.empty()) kill(p.pid, SIGTERM);
    reap_worker(p.pid, std::chrono::milliseconds(o.timeout_ms));  // killed if it does not exit in time
  }
  if (!t.check.first_mismatch.empty())
    std::fprintf(stderr, "[refit] first mismatch: %s\n", t.check.first_mismatch.c_str());
  const double bytes = static_cast<double>(meta.total_bytes());
  json result = {{"engine", o.engine},
                 {"workers", o.workers},
                 {"tensors", meta.tensors.size()},
                 {"bytes", meta.total_bytes()},
                 {"updates", o.updates},
                 {"seconds", t.seconds},
                 {"update_seconds", t.update_seconds},
                 {"wire_bytes", t.wire_bytes},
                 {"update_call_seconds", t.update_call_seconds},
                 {"gbps", t.seconds > 0 ? bytes * o.updates / t.seconds / 1e9 : 0.0},
                 {"receive_s", t.receive_s},
                 {"process_s", t.process_s},
                 {"overlap", t.overlap_samples ? t.overlap / t.overlap_samples : 0.0},
                 {"buffer_bytes", o.buffer_bytes},
                 {"num_buffers", o.num_buffers},
                 {"process_cost", o.process_cost},
                 {"direct_receive", !o.no_direct && o.commit == commit_mode::in_place},
                 {"checksums", o.checksums},
                 {"commit", to_string(o.commit)},
                 {"fleet_atomic", o.fleet_atomic},
                 {"authenticated", !o.secret.empty()},
                 {"first_round", o.first_round},
                 {"rounds_verified", t.check.verified ? t.check.rounds_done : 0},
                 {"worker_peak_rss_bytes", t.peak_rss},
                 {"worker_loop_lag_ms",
                  {{"init", t.lag_init_ms}, {"update", t.lag_update_ms}, {"update_p99", t.lag_update_p99_ms}}},
                 {"verified", failure.empty() && t.check.verified}};
  if (!t.transports.empty()) result["transports"] = t.transports;
  if (!t.worker_cpu_s.empty()) result["worker_cpu_seconds"] = t.worker_cpu_s;
  if (o.delta)
    result["delta"] = {
        {"full_fallbacks", t.full_fallbacks}, {"encoded_buckets", t.encoded_buckets}, {"encode_s", t.encode_s}};
  if (o.change_fraction > 0) result["change_fraction"] = o.change_fraction;
  if (!failure.empty()) result["error"] = failure;
  std::cout << result.dump() << std::endl;
  return failure.empty() && t.check.verified ? 0 : 1;
}

}  // namespace refit::example::weight_sync
