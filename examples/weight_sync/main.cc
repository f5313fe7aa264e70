// The main job: a trainer pushes several rounds of changed weights of a synthetic
// LLM to N worker processes on loopback, through the control plane and a refit
// backend, and verifies every tensor on every worker against its own checksums.
// Progress goes to stderr; the LAST line on stdout is one JSON object.
//
//   bazel run //examples/weight_sync -- --workers 2 --model-bytes 1G --updates 3
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/adapters/vllm.h>
#include <refit/backend/infos.h>
#include <refit/control/worker_group.h>
#include <refit/control/worker_host.h>
#include <refit/factory.h>
#include <refit/integrity/auth.h>
#include <refit/integrity/fingerprint.h>
#include <refit/internal/lag_probe.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include "examples/common/worker_process.h"
#include "examples/weight_sync/model.h"

namespace refit::example {
namespace {

using clock_type = std::chrono::steady_clock;

struct endpoint {
  std::string host;  // empty: --listen's address
  std::uint16_t port = 0;
};

struct options {
  std::string role = "trainer";
  std::string engine = "tcp";
  int workers = 2;
  std::uint64_t model_bytes = 1ull << 30;
  int layers = 16;
  std::int64_t vocab = 32000;
  int updates = 3;
  std::uint64_t buffer_bytes = 64ull << 20;
  std::uint32_t num_buffers = 2;
  double process_cost = 0;  // seconds of simulated post-processing per GB
  std::int64_t timeout_ms = 60000;
  bool quiet = false;
  bool print_layout = false;
  bool no_direct = false;  // receive through staging even where the model offers memory
  bool checksums = false;
  commit_mode commit = commit_mode::in_place;
  std::string listen = "127.0.0.1";        // workers' control address; the trainer's data address
  std::vector<endpoint> connect;           // trainer: use running workers instead of starting them
  bool load_model = false;                 // trainer: have --connect workers allocate the model first
  bool one_tensor = false;                 // the model is one bf16 tensor of --model-bytes
  std::uint16_t master_port = 0;           // trainer: data port (0: any free port)
  std::vector<std::uint16_t> advertise;    // trainer: data ports workers are told (proxies in front), one or one each
  int first_round = 1;                     // trainer: number of the first update (its weights)
  std::int64_t hold_before_finish_ms = 0;  // trainer: pause between update_weights and finish (fault suite)
  std::string topology;                    // trainer: tcp's "star", "chain" or "tree:K" (empty: the engine's default)
  // Sharded transfers: M trainer ranks with FSDP Shard(0) shards, N workers in
  // vLLM's tensor-parallel layout (fused qkv/gate_up, column/row, vocab-parallel).
  int trainers = 1;
  int tp = 1;
  bool broadcast = false;  // --tp N: today's broadcast, each worker slicing on arrival
  bool workers_given = false;
  int rank = 0;                              // trainer-rank: this rank
  std::vector<std::uint16_t> trainer_ports;  // trainer-rank: (unused ports of the others are 0)
  int slice_tp = 0, tp_rank = 0;             // worker: slice a broadcast to tp rank tp_rank of slice_tp
  std::string stats_file;                    // trainer-rank: where its JSON stats go

  bool sharded_job() const { return trainers > 1 || tp > 1; }
  std::string secret_file;  // shared secret for every connection
  std::string secret;       // loaded from secret_file
};

const char* usage =
    "usage: weight_sync [--engine tcp] [--workers N] [--model-bytes SIZE] [--layers N]\n"
    "                   [--vocab N] [--updates N] [--buffer-bytes SIZE] [--num-buffers N]\n"
    "                   [--process-cost SECONDS_PER_GB] [--timeout-ms MS] [--quiet]\n"
    "                   [--no-direct]  (receive through staging, not into the model's memory)\n"
    "                   [--checksums]  (per-bucket XXH3 checksums verified by every worker)\n"
    "                   [--commit in_place|staged]  (how updates reach the model; default in_place)\n"
    "                   [--auth-secret-file PATH]  (authenticate every connection; mode 0600;\n"
    "                                              default $REFIT_AUTH_SECRET_FILE)\n"
    "                   [--listen ADDRESS]  (address workers and the trainer listen on; 127.0.0.1)\n"
    "                   [--connect [HOST:]PORT,...]  (trainer: drive running workers, do not start any;\n"
    "                                                HOST defaults to --listen's address)\n"
    "                   [--load-model]  (trainer: have --connect workers allocate the model first)\n"
    "                   [--one-tensor]  (the model is one bf16 tensor of --model-bytes)\n"
    "                   [--master-port N] [--advertise-port N[,N...]] [--first-round N]  (trainer)\n"
    "                   [--hold-before-finish-ms MS]  (trainer: a window between update and finish)\n"
    "                   [--topology star|chain|tree:K]  (tcp: how the stream reaches the workers)\n"
    "                   [--role worker]  (serve the control verbs; prints REFIT_WORKER_PORT <port>)\n"
    "                   [--trainers M] [--tp N]  (M trainer processes with FSDP Shard(0) shards send N\n"
    "                                             tensor-parallel workers only what each keeps: tcp_sharded)\n"
    "                   [--broadcast]  (with --tp N: one trainer broadcasts, every worker slices on arrival)\n"
    "                   [--print-layout]  (print the model's update_info JSON and exit)\n"
    "SIZE: bytes with an optional K/M/G suffix (powers of 1024), e.g. 1G or 512M.\n";

// "4001,10.0.0.2:4002" -> endpoints (hosts only where `hosts` allows them).
std::vector<endpoint> endpoint_list(const std::string& flag, const std::string& list, bool hosts) {
  std::vector<endpoint> out;
  std::size_t at = 0;
  for (;;) {
    auto comma = list.find(',', at);
    std::string item = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    endpoint e;
    bool bad_host = false;
    if (auto colon = item.rfind(':'); hosts && colon != std::string::npos) {
      e.host = item.substr(0, colon);
      item = item.substr(colon + 1);
      bad_host = e.host.empty();
    }
    char* end = nullptr;
    long port = std::strtol(item.c_str(), &end, 10);
    if (bad_host || item.empty() || !end || *end || port < 1 || port > 65535)
      throw_error(errc::invalid_argument, flag +
                                              (hosts ? ": expected [HOST:]PORT entries like 4001,10.0.0.2:4002, got '"
                                                     : ": expected ports like 4001,4002, got '") +
                                              list + "'");
    e.port = static_cast<std::uint16_t>(port);
    out.push_back(std::move(e));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

std::vector<std::uint16_t> port_list(const std::string& flag, const std::string& list) {
  std::vector<std::uint16_t> out;
  for (const auto& e : endpoint_list(flag, list, false)) out.push_back(e.port);
  return out;
}

options parse_args(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (!value.empty()) return value;
      if (i + 1 >= argc) throw_error(errc::invalid_argument, a + " needs a value");
      return argv[++i];
    };
    auto integer = [&](long lo, long hi) {
      std::string v = next();
      char* end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (!end || *end || n < lo || n > hi)
        throw_error(errc::invalid_argument, a + ": expected an integer in [" + std::to_string(lo) + ", " +
                                                std::to_string(hi) + "], got '" + v + "'");
      return n;
    };
    if (a == "--role")
      o.role = next();
    else if (a == "--engine")
      o.engine = next();
    else if (a == "--workers")
      o.workers = static_cast<int>(integer(1, 64)), o.workers_given = true;
    else if (a == "--trainers")
      o.trainers = static_cast<int>(integer(1, 64));
    else if (a == "--tp")
      o.tp = static_cast<int>(integer(1, 64));
    else if (a == "--broadcast")
      o.broadcast = true;
    else if (a == "--rank")
      o.rank = static_cast<int>(integer(0, 63));
    else if (a == "--slice-tp")
      o.slice_tp = static_cast<int>(integer(1, 64));
    else if (a == "--tp-rank")
      o.tp_rank = static_cast<int>(integer(0, 63));
    else if (a == "--stats-file")
      o.stats_file = next();
    else if (a == "--model-bytes")
      o.model_bytes = parse_bytes(next(), a);
    else if (a == "--layers")
      o.layers = static_cast<int>(integer(1, 4096));
    else if (a == "--vocab")
      o.vocab = integer(1, 1 << 22);
    else if (a == "--updates")
      o.updates = static_cast<int>(integer(1, 100000));
    else if (a == "--buffer-bytes")
      o.buffer_bytes = parse_bytes(next(), a);
    else if (a == "--num-buffers")
      o.num_buffers = static_cast<std::uint32_t>(integer(1, 64));
    else if (a == "--process-cost") {
      std::string v = next();
      char* end = nullptr;
      o.process_cost = std::strtod(v.c_str(), &end);
      if (!end || *end || o.process_cost < 0 || o.process_cost > 1000)
        throw_error(errc::invalid_argument, "--process-cost: expected seconds per GB in [0, 1000], got '" + v + "'");
    } else if (a == "--timeout-ms")
      o.timeout_ms = integer(1, 86400000);
    else if (a == "--quiet")
      o.quiet = true;
    else if (a == "--print-layout")
      o.print_layout = true;
    else if (a == "--no-direct")
      o.no_direct = true;
    else if (a == "--commit") {
      std::string v = next();
      if (v == "staged")
        o.commit = commit_mode::staged;
      else if (v == "in_place")
        o.commit = commit_mode::in_place;
      else
        throw_error(errc::invalid_argument, "--commit: expected in_place or staged, got '" + v + "'");
    } else if (a == "--auth-secret-file")
      o.secret_file = next();
    else if (a == "--listen")
      o.listen = next();
    else if (a == "--master-port")
      o.master_port = static_cast<std::uint16_t>(integer(0, 65535));
    else if (a == "--advertise-port")
      o.advertise = port_list(a, next());
    else if (a == "--first-round")
      o.first_round = static_cast<int>(integer(1, 1 << 30));
    else if (a == "--hold-before-finish-ms")
      o.hold_before_finish_ms = integer(0, 600000);
    else if (a == "--connect")
      o.connect = endpoint_list(a, next(), true);
    else if (a == "--load-model")
      o.load_model = true;
    else if (a == "--one-tensor")
      o.one_tensor = true;
    else if (a == "--checksums")
      o.checksums = true;
    else if (a == "--topology")
      o.topology = next();
    else if (a == "--help" || a == "-h") {
      std::cout << usage;
      std::exit(0);
    } else
      throw_error(errc::invalid_argument, "unknown flag '" + a + "'\n" + usage);
  }
  if (o.role != "trainer" && o.role != "worker" && o.role != "trainer-rank")
    throw_error(errc::invalid_argument, "--role: expected trainer or worker, got '" + o.role + "'");
  if (o.sharded_job()) {
    if (o.workers_given && o.workers != o.tp)
      throw_error(errc::invalid_argument, "--workers " + std::to_string(o.workers) + " and --tp " +
                                              std::to_string(o.tp) +
                                              ": with --tp the workers are the tp ranks of one engine (give one)");
    o.workers = o.tp;
    if (o.broadcast && o.trainers != 1)
      throw_error(errc::invalid_argument, "--broadcast: one trainer sends the whole model (drop --trainers)");
    if (!o.connect.empty() || o.one_tensor || !o.advertise.empty() || o.commit == commit_mode::staged)
      throw_error(errc::invalid_argument,
                  "--trainers/--tp: --connect, --one-tensor, --advertise-port "
                  "and --commit staged are for the one-trainer job");
    if (!o.topology.empty() && !o.broadcast)
      throw_error(errc::invalid_argument,
                  "--topology: sharded transfers connect every worker to every rank (use it with --broadcast)");
    o.engine = o.broadcast ? "tcp" : "tcp_sharded";
  }
  if (o.secret_file.empty())
    if (const char* env = std::getenv("REFIT_AUTH_SECRET_FILE")) o.secret_file = env;
  if (!o.secret_file.empty()) o.secret = auth::read_secret_file(o.secret_file);
  if (!o.connect.empty()) o.workers = static_cast<int>(o.connect.size());
  if (o.connect.empty()) o.load_model = true;  // workers this trainer starts always get the model
  if (o.advertise.size() > 1 && o.advertise.size() != static_cast<std::size_t>(o.workers))
    throw_error(errc::invalid_argument,
                "--advertise-port: give one port, or one per worker (" + std::to_string(o.workers) + ")");
  return o;
}

// Simulated post-processing: spins for `bytes` at `cost` seconds per GB, like a
// dtype conversion or a layout transform would keep a core busy.
void burn(std::uint64_t bytes, double cost) {
  if (cost <= 0) return;
  auto until = clock_type::now() + std::chrono::duration<double>(static_cast<double>(bytes) * cost / 1e9);
  while (clock_type::now() < until) {
  }
}

// ---------------------------------------------------------------- worker

// The worker's "model": one buffer per tensor. It offers its buffers as receive
// destinations (the engine writes weights straight into them); load_weights copies
// only what came through staging, then runs the simulated post-processing.
class worker_model final : public model_target {
 public:
  worker_model(double process_cost, bool direct, int slice_tp = 0, int tp_rank = 0)
      : process_cost_(process_cost), direct_(direct && slice_tp == 0), slice_tp_(slice_tp), tp_rank_(tp_rank) {}

  // Slicing a broadcast (--slice-tp): the worker keeps its tp rank's part of each
  // full tensor, in vLLM's layout, as a tensor-parallel worker does today.
  void begin_update(const update_metadata& meta) override {
    if (slice_tp_ == 0) return;
    const auto digest = metadata_digest(meta);
    std::lock_guard lock(mutex_);
    if (digest == sliced_digest_) return;
    slice_ = tensor_parallel_layout(meta, slice_tp_, tp_rank_, vllm_llama_layout());
    pieces_.clear();
    for (std::size_t d = 0; d < slice_.tensors.size(); ++d) {
      const auto& t = slice_.tensors[d];
      auto& slot = tensors_[t.spec.name];
      slot.spec = t.spec;
      if (slot.bytes.size() != t.spec.nbytes()) slot.bytes.assign(t.spec.nbytes(), std::byte{0});
      for (std::size_t k = 0; k < t.pieces.size(); ++k) pieces_[t.pieces[k].source].emplace_back(d, k);
    }
    sliced_digest_ = digest;
  }

  void load_weights(std::span<const tensor_view> views) override {
    if (slice_tp_ > 0) {
      for (const auto& v : views) {
        std::lock_guard lock(mutex_);
        auto it = pieces_.find(std::string(v.name));
        if (it == pieces_.end()) continue;  // nothing of it is kept here
        for (auto [d, k] : it->second) {
          const auto& t = slice_.tensors[d];
          const auto& piece = t.pieces[k];
          copy_box(v.data, v.shape, piece.from, tensors_[t.spec.name].bytes.data(), t.spec.shape, piece.at,
                   element_size(t.spec.dtype));
        }
        burn(v.nbytes(), process_cost_);
      }
      return;
    }
    for (const auto& v : views) {
      auto bytes = v.bytes();
      std::lock_guard lock(mutex_);
      auto& slot = tensors_[std::string(v.name)];
      slot.spec = tensor_spec{std::string(v.name), v.dtype, std::vector<std::int64_t>(v.shape.begin(), v.shape.end())};
      if (slot.bytes.size() != bytes.size()) slot.bytes.assign(bytes.size(), std::byte{0});
      if (slot.bytes.data() != bytes.data()) std::memcpy(slot.bytes.data(), bytes.data(), bytes.size());
      burn(bytes.size(), process_cost_);
    }
  }

  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    if (!direct_) return std::nullopt;
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    if (it == tensors_.end() || it->second.bytes.size() != spec.nbytes()) return std::nullopt;
    return tensor_view(spec, it->second.bytes.data());
  }

  // A server has its model resident before any update: allocate and touch it.
  void allocate(const update_metadata& meta) {
    std::lock_guard lock(mutex_);
    for (const auto& t : meta.tensors) {
      tensors_[t.name].bytes.assign(t.nbytes(), std::byte{0});
      tensors_[t.name].spec = t;
    }
  }

  // What the worker's weight_fingerprint call answers: computed on request from the
  // model's own memory (after the update, outside its timing).
  fingerprint_list fingerprint(const std::vector<std::string>& names) override {
    std::lock_guard lock(mutex_);
    std::vector<tensor_view> views;
    for (auto& [name, t] : tensors_) views.emplace_back(t.spec, t.bytes.data());
    return fingerprint_all(views, names);
  }

 private:
  struct tensor {
    tensor_spec spec;
    std::vector<std::byte> bytes;
  };
  double process_cost_;
  bool direct_;
  int slice_tp_, tp_rank_;
  std::uint64_t sliced_digest_ = 0;
  dest_layout slice_;
  std::map<std::string, std::vector<std::pair<std::size_t, std::size_t>>> pieces_;  // source -> (tensor, piece)
  mutable std::mutex mutex_;
  std::map<std::string, tensor> tensors_;
};

std::uint64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
}

int run_worker(const options& o) {
  die_with_trainer();  // never outlive the trainer
  asio::io_context io;
  // How late this loop runs its work (the inference server's view of refit).
  async::lag_probe lag(io.get_executor());
  worker_model model(o.process_cost, !o.no_direct, o.slice_tp, o.tp_rank);
  weight_transfer_config config;
  config.backend = o.engine;
  config.timeout = std::chrono::milliseconds(o.timeout_ms);
  config.commit = o.commit;
  config.auth_secret = o.secret;
  control::worker_host host(config, engine_context{io.get_executor(), {}, {}, &model}, model.as_load_weights());
  const auto port = host.listen(o.listen, 0);
  host.add_method("load_model", [&model](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "load_model params");
    auto meta = read_update_metadata(r);
    r.finish();
    model.allocate(meta);
    co_return json::object();
  });
  host.add_method("worker_stats", [](const json&) -> asio::awaitable<json> {
    co_return json{{"peak_rss_bytes", peak_rss_bytes()}};
  });
  // The event loop's largest stall since the last call (and its p99).
  host.add_method("loop_lag", [&lag](const json&) -> asio::awaitable<json> { co_return lag.take().to_json(); });
  return serve_worker(io, host, port, [&lag] { lag.stop(); });
}

// ---------------------------------------------------------------- trainer

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
                                   o.listen};
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
  return start_worker_process(args, std::chrono::milliseconds(o.timeout_ms), "worker " + std::to_string(index));
}

// Bytes [offset, offset + out.size()) of tensor `index`'s weights in round `round`:
// 64-bit words x + k * C (k the word's index in the whole tensor), so a rank that
// holds a shard of a tensor makes exactly the bytes the whole tensor has there.
void fill_pattern(std::span<std::byte> out, std::size_t index, int round, std::uint64_t offset) {
  const std::uint64_t x = 0x9E3779B97F4A7C15ull * (index + 1) ^ (static_cast<std::uint64_t>(round) << 40);
  auto word = [x](std::uint64_t k) { return x + k * 0xBF58476D1CE4E5B9ull; };
  std::size_t i = 0;
  const std::size_t n = out.size();
  for (; i < n && (offset + i) % 8 != 0; ++i)
    out[i] = static_cast<std::byte>(word((offset + i) / 8) >> (8 * ((offset + i) % 8)));
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t w = word((offset + i) / 8);
    std::memcpy(out.data() + i, &w, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<std::byte>(word((offset + i) / 8) >> (8 * ((offset + i) % 8)));
}

// The trainer's copy of the model: one arena, tensors back to back.
struct trainer_model {
  model_layout layout;
  std::vector<std::byte> arena;
  std::vector<tensor_view> views;

  explicit trainer_model(model_layout l) : layout(std::move(l)) {
    arena.resize(layout.meta.total_bytes());
    std::uint64_t at = 0;
    for (const auto& t : layout.meta.tensors) {
      views.emplace_back(t, arena.data() + at);
      at += t.nbytes();
    }
  }

  // New weights for round `r`: a cheap pattern that differs per tensor and round.
  void step(int r) {
    for (std::size_t i = 0; i < views.size(); ++i) fill_pattern(views[i].bytes(), i, r, 0);
  }
};

struct totals {
  double seconds = 0, receive_s = 0, process_s = 0, overlap = 0;
  double lag_init_ms = 0, lag_update_ms = 0;  // workers' largest event-loop stalls
  double lag_update_p99_ms = 0;
  int overlap_samples = 0;
  int rounds_done = 0;
  std::vector<double> update_seconds;  // each update's time (the first pays for first touches)
  // The whole worker_group::update call: also its update_info JSON before the
  // workers are called (what a Python trainer's figure includes).
  std::vector<double> update_call_seconds;
  bool verified = true;
  std::uint64_t peak_rss = 0;
  std::string first_mismatch;
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
  // Each worker is its own inference engine here, so each gets its own rank (the
  // group's default); proxies in front of the trainer are advertised instead.
  control::init_options init;
  if (!o.advertise.empty())
    init.adjust = [&o](std::size_t i, json& info) {
      info["master_port"] = o.advertise[o.advertise.size() == 1 ? 0 : i];
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
  update.verify = false;  // checked below, after the loop-lag probe, counting every difference
  update.hold_before_finish = std::chrono::milliseconds(o.hold_before_finish_ms);
  const std::uint64_t bytes = model.layout.meta.total_bytes();
  for (int round = o.first_round; round < o.first_round + o.updates; ++round) {
    model.step(round);
    auto expected = fingerprint_all(model.views);
    if (probed) co_await workers.call_all("loop_lag", empty);
    const auto call_start = std::chrono::steady_clock::now();
    const auto result = co_await workers.update(*sender, model.layout.meta, model.views, round, update);
    t.update_call_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count());
    const double seconds = result.seconds;
    t.seconds += seconds;
    t.update_seconds.push_back(seconds);
    if (probed)
      for (const auto& lag : co_await workers.call_all("loop_lag", empty)) {
        t.lag_update_ms = std::max(t.lag_update_ms, lag["max_ms"].get<double>());
        t.lag_update_p99_ms = std::max(t.lag_update_p99_ms, lag["p99_ms"].get<double>());
      }
    for (const auto& w : result.workers) {
      const json& s = w.stats;
      t.receive_s += s["receive_s"].get<double>() / o.workers;
      t.process_s += s["process_s"].get<double>() / o.workers;
      t.overlap += s["overlap"].get<double>();
      ++t.overlap_samples;
    }
    // Every tensor on every worker against the trainer's own: the workers'
    // weight_fingerprint call hashes what their models hold now.
    const auto differences = co_await workers.fingerprint_differences(std::move(expected), round);
    std::size_t bad = 0;
    for (std::size_t w = 0; w < differences.size(); ++w) {
      const auto& diff = differences[w];
      if (!diff.empty() && t.first_mismatch.empty())
        t.first_mismatch = "worker " + std::to_string(w) + " after update " + std::to_string(round) + ": " + diff[0];
      bad += diff.size();
    }
    if (bad) t.verified = false;
    ++t.rounds_done;
    if (!o.quiet)
      std::fprintf(stderr, "[refit] update %d (%d/%d): %.2f GB -> %d workers in %.2f s (%.2f GB/s per worker), %s\n",
                   round, round - o.first_round + 1, o.updates, bytes / 1e9, o.workers, seconds, bytes / seconds / 1e9,
                   bad ? ("MISMATCH in " + std::to_string(bad) + " tensors").c_str() : "verified");
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

// ---------------------------------------------------------------- sharded job

// The layout both sides plan with: FSDP's Shard(0) over the trainer ranks, vLLM's
// Llama/Qwen tensor-parallel layout on the workers.
json layout_spec(const options& o) {
  return {{"source", {{"mesh", {o.trainers}}, {"placements", {"shard(0)"}}}},
          {"destination", {{"preset", "vllm_llama"}, {"tp_size", o.tp}}}};
}

struct planned {
  source_layout source;
  std::vector<dest_layout> workers;
  transfer_plan plan;
};

planned plan_for(const update_metadata& meta, const json& spec) {
  planned p;
  json_reader r(spec, "weight_sync layout");
  auto src = r.object("source");
  p.source = read_source_layout(src, meta);
  src.finish();
  auto dst = r.object("destination");
  p.workers = read_dest_layouts(dst, meta);
  dst.finish();
  r.finish();
  p.plan = plan_transfer(p.source, p.workers);
  return p;
}

// One trainer rank's shards: contiguous local tensors (Shard(0) boxes are row
// ranges, so each is one byte range of the whole tensor).
struct shard_model {
  update_metadata local;
  std::vector<std::uint64_t> global_offset;  // of each shard in its whole tensor
  std::vector<std::vector<std::byte>> data;
  std::vector<tensor_view> views;

  shard_model(const source_layout& source, int rank) : local(source.local_metadata(rank)) {
    for (std::size_t i = 0; i < local.tensors.size(); ++i) {
      const auto& g = source.tensors[i].spec;
      const auto b = source.local_box(i, rank);
      std::uint64_t row = element_size(g.dtype);
      for (std::size_t d = 1; d < g.shape.size(); ++d) row *= static_cast<std::uint64_t>(g.shape[d]);
      global_offset.push_back(b.offset.empty() ? 0 : static_cast<std::uint64_t>(b.offset[0]) * row);
      data.emplace_back(local.tensors[i].nbytes());
      views.emplace_back(local.tensors[i], data.back().data());
    }
  }
  void step(int round) {
    for (std::size_t i = 0; i < data.size(); ++i) fill_pattern(data[i], i, round, global_offset[i]);
  }
};

weight_transfer_config sharded_config(const options& o) {
  weight_transfer_config config;
  config.backend = o.engine;
  config.timeout = std::chrono::milliseconds(o.timeout_ms);
  config.auth_secret = o.secret;
  return config;
}

json sharded_trainer_args(const options& o, const json& trainers, int rank) {
  return {{"rank", rank},
          {"trainers", trainers},
          {"workers", o.tp},
          {"layout", layout_spec(o)},
          {"buffer_bytes", o.buffer_bytes},
          {"checksums", o.checksums},
          {"timeout_ms", o.timeout_ms}};
}

// --role trainer-rank: rank o.rank of --trainers, started by rank 0. It prints its
// data port (as workers print theirs), accepts the workers and sends every round
// by itself, as an FSDP rank would after each optimizer step; its figures go to
// --stats-file.
int run_trainer_rank(const options& o) {
  die_with_trainer();
  const auto meta = make_layout(o.model_bytes, o.layers, o.vocab).meta;
  const auto p = plan_for(meta, layout_spec(o));
  shard_model shards(p.source, o.rank);
  asio::io_context io;
  auto sender = engine_factory::instance().create_sender(sharded_config(o), trainer_context{io.get_executor(), {}});
  json trainers = json::array();
  for (int r = 0; r < o.trainers; ++r) trainers.push_back({{"address", o.listen}, {"port", 0}});
  const json info = sender->prepare(sharded_trainer_args(o, trainers, o.rank));
  std::printf("REFIT_WORKER_PORT %d\n", info["trainers"][o.rank]["port"].get<int>());
  std::fflush(stdout);
  json stats = {{"rank", o.rank}, {"egress_bytes", json::array()}, {"send_seconds", json::array()}};
  std::string failure;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        co_await sender->connect_workers();
        for (int round = o.first_round; round < o.first_round + o.updates; ++round) {
          shards.step(round);
          co_await trainer_send_weights(*sender, meta, shards.views);
          stats["egress_bytes"].push_back(sender->last_send_stats().bytes);
          stats["send_seconds"].push_back(sender->last_send_stats().wall_s);
        }
      },
      [&](std::exception_ptr e) {
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const error& x) {
          failure = std::string(errc_name(x.kind())) + ": " + x.message();
        } catch (const std::exception& x) {
          failure = x.what();
        }
      });
  io.run();
  sender->shutdown();
  if (!failure.empty()) {
    stats["error"] = failure;
    std::fprintf(stderr, "[refit] trainer rank %d: %s\n", o.rank, failure.c_str());
  }
  if (!o.stats_file.empty()) {
    FILE* f = std::fopen(o.stats_file.c_str(), "w");
    if (f) {
      std::fprintf(f, "%s\n", stats.dump().c_str());
      std::fclose(f);
    }
  }
  return failure.empty() ? 0 : 1;
}

// What worker w must hold after `round`: every piece of its layout copied out of
// the whole tensors (made here the way every rank makes its shards), as
// fingerprints. Independent of the planner: a wrong plan cannot agree with it.
std::vector<fingerprint_list> reference_fingerprints(const update_metadata& meta,
                                                     const std::vector<dest_layout>& workers, int round) {
  std::vector<std::vector<std::vector<std::byte>>> held(workers.size());
  std::map<std::string, std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>>
      uses;  // source -> (w, t, piece)
  for (std::size_t w = 0; w < workers.size(); ++w)
    for (std::size_t t = 0; t < workers[w].tensors.size(); ++t) {
      held[w].emplace_back(workers[w].tensors[t].spec.nbytes(), std::byte{0});
      for (std::size_t k = 0; k < workers[w].tensors[t].pieces.size(); ++k)
        uses[workers[w].tensors[t].pieces[k].source].emplace_back(w, t, k);
    }
  std::vector<std::byte> whole;
  for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
    auto it = uses.find(meta.tensors[i].name);
    if (it == uses.end()) continue;
    whole.resize(meta.tensors[i].nbytes());
    fill_pattern(whole, i, round, 0);
    for (auto [w, t, k] : it->second) {
      const auto& dt = workers[w].tensors[t];
      copy_box(whole.data(), meta.tensors[i].shape, dt.pieces[k].from, held[w][t].data(), dt.spec.shape,
               dt.pieces[k].at, element_size(dt.spec.dtype));
    }
  }
  std::vector<fingerprint_list> out(workers.size());
  for (std::size_t w = 0; w < workers.size(); ++w) {
    std::vector<tensor_view> views;
    for (std::size_t t = 0; t < workers[w].tensors.size(); ++t)
      views.emplace_back(workers[w].tensors[t].spec, held[w][t].data());
    out[w] = fingerprint_all(views);
  }
  return out;
}

struct sharded_totals {
  std::vector<double> update_seconds;
  std::vector<std::uint64_t> bytes_per_worker;  // the last update's, by worker
  std::vector<std::uint64_t> egress;            // the last update's, by trainer rank
  double plan_s = 0;
  int rounds_done = 0;
  bool verified = true;
  std::string first_mismatch;
  std::uint64_t peak_rss = 0;
  // The workers' largest event-loop stalls: during the first update (which reads
  // and plans the layout) and during the later ones (max and p99).
  double lag_first_ms = 0, lag_update_ms = 0, lag_update_p99_ms = 0;
  // After a failed update: what each worker says it holds ({"state", "weight_version"}).
  json worker_states = json::array();
};

asio::awaitable<void> sharded_rounds(const options& o, control::worker_group& workers, weight_sender& sender,
                                     const update_metadata& meta, const planned& p, sharded_totals& t);

asio::awaitable<void> sharded_main(const options& o, const std::vector<worker_process>& procs,
                                   const std::vector<worker_process>& ranks, const update_metadata& meta,
                                   const planned& p, sharded_totals& t) {
  auto ex = co_await asio::this_coro::executor;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  std::vector<control::worker_endpoint> endpoints;
  for (const auto& w : procs) endpoints.push_back({o.listen, w.port});
  control::worker_group workers(ex, timeout, o.secret, std::move(endpoints), [](std::size_t i) {
    return "worker " + std::to_string(i) + " (tp rank " + std::to_string(i) + ")";
  });
  co_await workers.connect();
  auto sender = engine_factory::instance().create_sender(sharded_config(o), trainer_context{ex, {}});
  json trainer_args;
  if (o.broadcast) {
    trainer_args = {{"master_address", o.listen},     {"master_port", o.master_port}, {"world_size", o.tp + 1},
                    {"buffer_bytes", o.buffer_bytes}, {"num_buffers", o.num_buffers}, {"checksums", o.checksums},
                    {"timeout_ms", o.timeout_ms}};
    if (!o.topology.empty()) trainer_args["topology"] = o.topology;
  } else {
    json trainers = json::array();
    trainers.push_back({{"address", o.listen}, {"port", o.master_port}});
    for (const auto& r : ranks) trainers.push_back({{"address", o.listen}, {"port", r.port}});
    trainer_args = sharded_trainer_args(o, trainers, 0);
  }
  co_await workers.init(*sender, trainer_args);
  // Each worker holds its own tensors before any update, as a server does.
  co_await workers.call_each("load_model", [&](std::size_t w) {
    json j = json::object();
    write_update_metadata(p.workers[w].metadata(), j);
    return j;
  });
  if (!o.quiet)
    std::fprintf(stderr, "[refit] %d trainer ranks -> %d tp workers over %s connected\n", o.trainers, o.tp,
                 o.engine.c_str());
  std::exception_ptr failure;
  try {
    co_await sharded_rounds(o, workers, *sender, meta, p, t);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // What every worker that still answers says it holds now: a failed update must
    // not leave a worker claiming weights it does not have (checked by the fault test).
    sender->shutdown();
    for (std::size_t w = 0; w < procs.size(); ++w) {
      json state = {{"worker", w}};
      try {
        const json a =
            co_await workers.at(w).call("weight_fingerprint", json::object(), std::chrono::milliseconds(3000));
        state["state"] = a.value("state", std::string("?"));
        state["weight_version"] = a.contains("weight_version") ? a["weight_version"] : json(nullptr);
      } catch (const error& e) {
        state["unreachable"] = std::string(errc_name(e.kind())) + ": " + e.message();
      }
      t.worker_states.push_back(std::move(state));
    }
    workers.close();
    std::rethrow_exception(failure);
  }
  for (const auto& s : co_await workers.call_all("worker_stats"))
    t.peak_rss = std::max(t.peak_rss, s["peak_rss_bytes"].get<std::uint64_t>());
  try {
    co_await workers.call_all("shutdown");
  } catch (const error&) {
  }
  sender->shutdown();
  workers.close();
}

asio::awaitable<void> sharded_rounds(const options& o, control::worker_group& workers, weight_sender& sender_ref,
                                     const update_metadata& meta, const planned& p, sharded_totals& t) {
  weight_sender* sender = &sender_ref;
  // Rank 0's own shards (the whole model when broadcasting).
  std::optional<shard_model> shards;
  if (!o.broadcast) shards.emplace(p.source, 0);
  std::optional<trainer_model> whole;
  if (o.broadcast) whole.emplace(make_layout(o.model_bytes, o.layers, o.vocab));
  control::update_options update;
  update.verify = false;  // each worker holds its own slice: checked below against the reference slicing
  if (!o.broadcast) update.update_info["layout"] = layout_spec(o);
  for (int round = o.first_round; round < o.first_round + o.updates; ++round) {
    if (shards)
      shards->step(round);
    else
      whole->step(round);
    const auto& views = shards ? shards->views : whole->views;
    co_await workers.call_all("loop_lag");  // restarts each worker's probe
    const auto result = co_await workers.update(*sender, meta, views, round, update);
    t.update_seconds.push_back(result.seconds);
    for (const auto& lag : co_await workers.call_all("loop_lag")) {
      const double max_ms = lag["max_ms"].get<double>();
      if (round == o.first_round) {
        t.lag_first_ms = std::max(t.lag_first_ms, max_ms);
      } else {
        t.lag_update_ms = std::max(t.lag_update_ms, max_ms);
        t.lag_update_p99_ms = std::max(t.lag_update_p99_ms, lag["p99_ms"].get<double>());
      }
    }
    t.bytes_per_worker.clear();
    for (const auto& w : result.workers) t.bytes_per_worker.push_back(w.stats["bytes"].get<std::uint64_t>());
    // A broadcast's trainer sends one copy per direct child: each worker in a star
    // (refit's default for up to two), one in a chain, K in a tree.
    std::uint64_t copies = 1;
    if (o.broadcast) {
      const auto topo = o.topology.empty() ? (o.tp <= 2 ? std::string("star") : std::string("chain")) : o.topology;
      copies = topo == "star" ? o.tp : topo.starts_with("tree:") ? std::stoull(topo.substr(5)) : 1;
    }
    t.egress.assign(1, sender->last_send_stats().bytes * copies);
    // Every byte of every worker against the reference slicing of the whole model.
    auto expected = reference_fingerprints(meta, p.workers, round);
    const auto differences = co_await workers.fingerprint_differences(std::move(expected), round);
    std::size_t bad = 0;
    for (std::size_t w = 0; w < differences.size(); ++w) {
      const auto& diff = differences[w];
      if (!diff.empty() && t.first_mismatch.empty())
        t.first_mismatch = "worker " + std::to_string(w) + " after update " + std::to_string(round) + ": " + diff[0];
      bad += diff.size();
    }
    if (bad) t.verified = false;
    ++t.rounds_done;
    if (!o.quiet)
      std::fprintf(stderr, "[refit] update %d: %.2f GB model, %.3f GB to each worker in %.2f s, %s\n", round,
                   meta.total_bytes() / 1e9, t.bytes_per_worker.empty() ? 0.0 : t.bytes_per_worker[0] / 1e9,
                   result.seconds, bad ? ("MISMATCH in " + std::to_string(bad) + " tensors").c_str() : "verified");
  }
}

int run_sharded_trainer(const options& o) {
  const auto meta = make_layout(o.model_bytes, o.layers, o.vocab).meta;
  const auto plan_start = clock_type::now();
  const planned p = plan_for(meta, layout_spec(o));
  sharded_totals t;
  t.plan_s = std::chrono::duration<double>(clock_type::now() - plan_start).count();
  if (!o.quiet)
    std::fprintf(stderr,
                 "[refit] model: %zu tensors, %.2f GB bf16; %d trainer ranks (Shard(0)) -> %d workers (vLLM tp)%s; "
                 "planned in %.3f s\n",
                 meta.tensors.size(), meta.total_bytes() / 1e9, o.trainers, o.tp,
                 o.broadcast ? " by broadcast, sliced on arrival" : "", t.plan_s);
  std::vector<worker_process> procs, ranks;
  std::vector<std::string> stats_files;
  std::string failure;
  try {
    for (int i = 0; i < o.tp; ++i) {
      procs.push_back(start_worker(o, i));
      std::fprintf(stderr, "[refit] pid of worker %d: %d\n", i, static_cast<int>(procs.back().pid));
    }
    for (int r = 1; r < o.trainers; ++r) {
      stats_files.push_back("/tmp/refit-weight-sync-" + std::to_string(getpid()) + "-rank" + std::to_string(r) +
                            ".json");
      std::vector<std::string> args = {"weight_sync",
                                       "--role",
                                       "trainer-rank",
                                       "--rank",
                                       std::to_string(r),
                                       "--trainers",
                                       std::to_string(o.trainers),
                                       "--tp",
                                       std::to_string(o.tp),
                                       "--model-bytes",
                                       std::to_string(o.model_bytes),
                                       "--layers",
                                       std::to_string(o.layers),
                                       "--vocab",
                                       std::to_string(o.vocab),
                                       "--updates",
                                       std::to_string(o.updates),
                                       "--first-round",
                                       std::to_string(o.first_round),
                                       "--buffer-bytes",
                                       std::to_string(o.buffer_bytes),
                                       "--timeout-ms",
                                       std::to_string(o.timeout_ms),
                                       "--listen",
                                       o.listen,
                                       "--stats-file",
                                       stats_files.back()};
      if (o.checksums) args.push_back("--checksums");
      if (!o.secret_file.empty()) {
        args.push_back("--auth-secret-file");
        args.push_back(o.secret_file);
      }
      ranks.push_back(
          start_worker_process(args, std::chrono::milliseconds(o.timeout_ms), "trainer rank " + std::to_string(r)));
      std::fprintf(stderr, "[refit] pid of trainer rank %d: %d\n", r, static_cast<int>(ranks.back().pid));
    }
    asio::io_context io;
    std::exception_ptr error;
    asio::co_spawn(io, sharded_main(o, procs, ranks, meta, p, t), [&](std::exception_ptr e) { error = e; });
    io.run();
    if (error) std::rethrow_exception(error);
  } catch (const error& e) {
    failure = std::string(errc_name(e.kind())) + ": " + e.message();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  for (auto* list : {&procs, &ranks})
    for (auto& w : *list) {
      if (!failure.empty()) kill(w.pid, SIGTERM);
      reap_worker(w.pid, std::chrono::milliseconds(o.timeout_ms));
    }
  // The other ranks' figures (and errors: a rank that failed says why).
  for (std::size_t k = 0; k < stats_files.size(); ++k) {
    std::ifstream in(stats_files[k]);
    std::string line;
    std::uint64_t egress = 0;
    if (std::getline(in, line)) {
      try {
        const json s = json::parse(line);
        if (s.contains("error") && failure.empty())
          failure = "trainer rank " + std::to_string(k + 1) + ": " + s["error"].get<std::string>();
        if (!s["egress_bytes"].empty()) egress = s["egress_bytes"].back().get<std::uint64_t>();
      } catch (const std::exception&) {
      }
    } else if (failure.empty()) {
      failure = "trainer rank " + std::to_string(k + 1) + " left no stats (it died)";
    }
    t.egress.push_back(egress);
    std::remove(stats_files[k].c_str());
  }
  if (!failure.empty()) {
    t.verified = false;
    std::fprintf(stderr, "[refit] error: %s\n", failure.c_str());
  }
  if (!t.first_mismatch.empty()) std::fprintf(stderr, "[refit] first mismatch: %s\n", t.first_mismatch.c_str());
  double seconds = 0;
  for (double s : t.update_seconds) seconds += s;
  std::uint64_t planned_bytes = 0;
  for (auto b : p.plan.ingress) planned_bytes = std::max(planned_bytes, b);
  json result = {{"engine", o.engine},
                 {"trainers", o.trainers},
                 {"tp", o.tp},
                 {"workers", o.tp},
                 {"mode", o.broadcast ? "broadcast" : "sharded"},
                 {"tensors", meta.tensors.size()},
                 {"bytes", meta.total_bytes()},
                 {"updates", o.updates},
                 {"seconds", seconds},
                 {"update_seconds", t.update_seconds},
                 {"bytes_per_worker", t.bytes_per_worker},
                 {"trainer_egress_bytes", t.egress},
                 {"planned_bytes_per_worker_max", planned_bytes},
                 {"plan_s", t.plan_s},
                 {"checksums", o.checksums},
                 {"buffer_bytes", o.buffer_bytes},
                 {"rounds_verified", t.verified ? t.rounds_done : 0},
                 {"worker_peak_rss_bytes", t.peak_rss},
                 {"worker_loop_lag_ms",
                  {{"first_update", t.lag_first_ms}, {"update", t.lag_update_ms}, {"update_p99", t.lag_update_p99_ms}}},
                 {"verified", failure.empty() && t.verified && t.rounds_done == o.updates}};
  if (!t.worker_states.empty()) result["worker_states_after_failure"] = t.worker_states;
  if (!failure.empty()) result["error"] = failure;
  std::cout << result.dump() << std::endl;
  return failure.empty() && t.verified ? 0 : 1;
}

model_layout layout_for(const options& o) {
  if (!o.one_tensor) return make_layout(o.model_bytes, o.layers, o.vocab);
  if (o.model_bytes < 2) throw_error(errc::invalid_argument, "--one-tensor: --model-bytes must be at least 2");
  model_layout l;
  l.layers = 0;
  l.meta.tensors.push_back({"weight", dtype::bfloat16, {static_cast<std::int64_t>(o.model_bytes / 2)}});
  return l;
}

int run_trainer(const options& o) {
  if (o.print_layout) {
    json layout = json::object();
    write_update_metadata(layout_for(o).meta, layout);
    std::cout << layout.dump() << std::endl;
    return 0;
  }
  trainer_model model(layout_for(o));
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
  } catch (const error& e) {
    failure = std::string(errc_name(e.kind())) + ": " + e.message();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!failure.empty()) {
    t.verified = false;
    std::fprintf(stderr, "[refit] error: %s\n", failure.c_str());
  }
  for (auto& p : procs) {
    if (p.pid < 0) continue;  // --connect: not ours
    if (!failure.empty()) kill(p.pid, SIGTERM);
    reap_worker(p.pid, std::chrono::milliseconds(o.timeout_ms));  // killed if it does not exit in time
  }
  if (!t.first_mismatch.empty()) std::fprintf(stderr, "[refit] first mismatch: %s\n", t.first_mismatch.c_str());
  const double bytes = static_cast<double>(meta.total_bytes());
  json result = {{"engine", o.engine},
                 {"workers", o.workers},
                 {"tensors", meta.tensors.size()},
                 {"bytes", meta.total_bytes()},
                 {"updates", o.updates},
                 {"seconds", t.seconds},
                 {"update_seconds", t.update_seconds},
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
                 {"authenticated", !o.secret.empty()},
                 {"first_round", o.first_round},
                 {"rounds_verified", t.verified ? t.rounds_done : 0},
                 {"worker_peak_rss_bytes", t.peak_rss},
                 {"worker_loop_lag_ms",
                  {{"init", t.lag_init_ms}, {"update", t.lag_update_ms}, {"update_p99", t.lag_update_p99_ms}}},
                 {"verified", failure.empty() && t.verified}};
  if (!failure.empty()) result["error"] = failure;
  std::cout << result.dump() << std::endl;
  return failure.empty() && t.verified ? 0 : 1;
}

}  // namespace
}  // namespace refit::example

int main(int argc, char** argv) {
  using namespace refit::example;
  options o;
  try {
    o = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_sync: %s\n", e.what());
    return 2;
  }
  try {
    if (o.role == "worker") return run_worker(o);
    if (o.role == "trainer-rank") return run_trainer_rank(o);
    return o.sharded_job() ? run_sharded_trainer(o) : run_trainer(o);
  } catch (const refit::error& e) {
    // Startup failures (no descriptors for the event loop, an address that is not
    // one): one line and a non-zero status, not an abort.
    std::fprintf(stderr, "weight_sync %s: %s: %s\n", o.role.c_str(), std::string(refit::errc_name(e.kind())).c_str(),
                 e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_sync %s: %s\n", o.role.c_str(), e.what());
    return 1;
  }
}
