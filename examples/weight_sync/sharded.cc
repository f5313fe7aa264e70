// The sharded job (--trainers M, --tp N): M trainer processes, each holding FSDP
// Shard(0) shards of the model, send N tensor-parallel workers (vLLM's layout)
// only what each keeps (tcp_sharded); with --broadcast one trainer sends the whole
// model and every worker slices it on arrival (today's tensor parallelism). Rank 0
// is this process; ranks 1.. are --role trainer-rank processes of this binary.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/control/worker_group.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/integrity/fingerprint.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include "examples/weight_sync/job.h"
#include "examples/weight_sync/verify.h"

namespace refit::example::weight_sync {
namespace {

using clock_type = std::chrono::steady_clock;

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
// ranges, so each is one byte range of the whole tensor). Each round they hold
// what the whole model (trainer_model) holds there, with --change-fraction too.
struct shard_model {
  update_metadata local;
  std::vector<std::uint64_t> global_offset;  // of each shard in its whole tensor
  std::vector<std::uint64_t> whole_bytes;    // of each whole tensor
  std::vector<std::vector<std::byte>> data;
  std::vector<tensor_view> views;
  double change_fraction = 0;
  bool filled = false;

  shard_model(const source_layout& source, int rank, double fraction)
      : local(source.local_metadata(rank)), change_fraction(fraction) {
    for (std::size_t i = 0; i < local.tensors.size(); ++i) {
      const auto& g = source.tensors[i].spec;
      const auto b = source.local_box(i, rank);
      std::uint64_t row = element_size(g.dtype);
      for (std::size_t d = 1; d < g.shape.size(); ++d) row *= static_cast<std::uint64_t>(g.shape[d]);
      global_offset.push_back(b.offset.empty() ? 0 : static_cast<std::uint64_t>(b.offset[0]) * row);
      whole_bytes.push_back(g.nbytes());
      data.emplace_back(local.tensors[i].nbytes());
      views.emplace_back(local.tensors[i], data.back().data());
    }
  }
  void step(int round) {
    for (std::size_t i = 0; i < data.size(); ++i) {
      if (change_fraction > 0 && filled) {
        change_elements(data[i], local.tensors[i].dtype, change_fraction, i, round, global_offset[i], whole_bytes[i]);
      } else {
        fill_pattern(data[i], i, round, global_offset[i]);
      }
    }
    filled = true;
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
  json args = {{"rank", rank},
               {"trainers", trainers},
               {"workers", o.tp},
               {"layout", layout_spec(o)},
               {"buffer_bytes", o.buffer_bytes},
               {"checksums", o.checksums},
               {"timeout_ms", o.timeout_ms}};
  if (o.delta) args["delta"] = true;  // tcp_sharded's (flags.cc refuses it elsewhere)
  return args;
}

// What worker w must hold after an update: every piece of its layout copied out of
// the whole tensors (`whole(i, out)` writes tensor i's bytes, made the way every
// rank makes its shards), as fingerprints. Independent of the planner: a wrong
// plan cannot agree with it.
std::vector<fingerprint_list> reference_fingerprints(
    const update_metadata& meta, const std::vector<dest_layout>& workers,
    const std::function<void(std::size_t, std::span<std::byte>)>& whole_tensor) {
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
    whole_tensor(i, whole);
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

// --delta: the trainer ranks' senders' figures, summed over updates (and ranks); a
// delta_worker or full_fallback is one (rank, worker) pair in one update.
struct delta_counts {
  std::uint64_t full_fallbacks = 0, encoded_buckets = 0, delta_workers = 0;
  // d: a sender's last_send_info()["delta"], or another delta_counts' json().
  void add(const json& d) {
    full_fallbacks += d.at("full_fallbacks").get<std::uint64_t>();
    encoded_buckets += d.at("encoded_buckets").get<std::uint64_t>();
    delta_workers += d.at("delta_workers").get<std::uint64_t>();
  }
  json to_json() const {
    return {{"full_fallbacks", full_fallbacks}, {"encoded_buckets", encoded_buckets}, {"delta_workers", delta_workers}};
  }
};

struct sharded_totals {
  std::vector<double> update_seconds;
  std::vector<std::uint64_t> bytes_per_worker;  // the last update's, by worker
  std::vector<std::uint64_t> egress;            // the last update's, by trainer rank
  // Each update's bytes and wire bytes (a delta's where one was sent), summed over
  // the workers.
  std::vector<std::uint64_t> worker_bytes, wire_bytes;
  json transports = json::array();  // what each worker's transport chose (ucx_sharded), the last update's
  delta_counts delta;               // --delta
  double plan_s = 0;
  verification check;
  std::uint64_t peak_rss = 0;
  // The workers' largest event-loop stalls: during the first update (which reads
  // and plans the layout) and during the later ones (max and p99).
  double lag_first_ms = 0, lag_update_ms = 0, lag_update_p99_ms = 0;
  // After a failed update: what each worker says it holds ({"state", "weight_version"}).
  json worker_states = json::array();
  // After the last update: how many workers hold an undo (--fleet-atomic: every one).
  int workers_holding_undo = 0;
};

asio::awaitable<void> sharded_rounds(const options& o, control::worker_group& workers, weight_sender& sender,
                                     const update_metadata& meta, const planned& p, sharded_totals& t);

asio::awaitable<void> sharded_main(const options& o, const std::vector<worker_process>& procs,
                                   const std::vector<worker_process>& ranks, const update_metadata& meta,
                                   const planned& p, sharded_totals& t) {
  auto ex = co_await asio::this_coro::executor;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  std::vector<control::worker_endpoint> endpoints;
  for (std::size_t i = 0; i < procs.size(); ++i) endpoints.push_back({host_of(o, i), procs[i].port});
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
    for (std::size_t r = 0; r < ranks.size(); ++r)
      trainers.push_back({{"address", host_of(o, procs.size() + r)}, {"port", ranks[r].port}});
    trainer_args = sharded_trainer_args(o, trainers, 0);
  }
  control::init_options init;
  init.adjust = [&o](std::size_t, json& info) {
    if (o.ucx_put_into_model) info["put_into_model"] = *o.ucx_put_into_model;  // ucx, ucx_sharded
  };
  co_await workers.init(*sender, trainer_args, init);
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
      } catch (const error&) {
        state["unreachable"] = describe(std::current_exception());
      }
      t.worker_states.push_back(std::move(state));
    }
    workers.close();
    std::rethrow_exception(failure);
  }
  for (const auto& s : co_await workers.call_all("worker_stats"))
    t.peak_rss = std::max(t.peak_rss, s["peak_rss_bytes"].get<std::uint64_t>());
  for (const auto& info : co_await workers.call_all("weight_info"))
    t.workers_holding_undo += info.value("holds_undo", false) ? 1 : 0;
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
  // Rank 0's own shards (the whole model when broadcasting). With
  // --change-fraction the reference needs the whole model's state too: kept here.
  std::optional<shard_model> shards;
  if (!o.broadcast) shards.emplace(p.source, 0, o.change_fraction);
  std::optional<trainer_model> whole;
  if (o.broadcast || o.change_fraction > 0)
    whole.emplace(make_layout(o.model_bytes, o.layers, o.vocab), o.change_fraction);
  control::update_options update;
  update.commit = o.commit;
  update.fleet_atomic = o.fleet_atomic;  // every worker holds its slices (load_model): each can undo
  update.verify = false;                 // each worker holds its own slice: checked below against the reference slicing
  if (!o.broadcast) update.update_info["layout"] = layout_spec(o);
  for (int round = o.first_round; round < o.first_round + o.updates; ++round) {
    if (shards) shards->step(round);
    if (whole) whole->step(round);
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
    t.transports = json::array();
    std::uint64_t got = 0, wire = 0;
    for (const auto& w : result.workers) {
      if (w.stats.contains("transport")) t.transports.push_back(w.stats["transport"]);
      t.bytes_per_worker.push_back(w.stats["bytes"].get<std::uint64_t>());
      got += w.stats["bytes"].get<std::uint64_t>();
      wire += w.stats["wire_bytes"].get<std::uint64_t>();
    }
    t.worker_bytes.push_back(got);
    t.wire_bytes.push_back(wire);
    if (o.delta) {
      const json info = sender->last_send_info();
      if (!info.is_object() || !info.contains("delta"))
        throw_error(errc::invalid_argument, "--delta: the " + o.engine + " sender reports no deltas");
      t.delta.add(info["delta"]);
    }
    // A broadcast's trainer sends one copy per direct child: each worker in a star
    // (refit's default for up to two), one in a chain, K in a tree.
    std::uint64_t copies = 1;
    if (o.broadcast) {
      const auto topo = o.topology.empty() ? (o.tp <= 2 ? std::string("star") : std::string("chain")) : o.topology;
      copies = topo == "star" ? o.tp : topo.starts_with("tree:") ? std::stoull(topo.substr(5)) : 1;
    }
    t.egress.assign(1, sender->last_send_stats().bytes * copies);
    // Every byte of every worker against the reference slicing of the whole model.
    auto expected = reference_fingerprints(meta, p.workers, [&](std::size_t i, std::span<std::byte> out) {
      if (whole) {
        const auto bytes = whole->views[i].bytes();
        std::copy(bytes.begin(), bytes.end(), out.begin());
      } else {
        fill_pattern(out, i, round, 0);
      }
    });
    const std::size_t bad = co_await verify_round(workers, std::move(expected), round, t.check);
    if (!o.quiet)
      std::fprintf(stderr, "[refit] update %d: %.2f GB model, %.3f GB to each worker in %.2f s, %s\n", round,
                   meta.total_bytes() / 1e9, t.bytes_per_worker.empty() ? 0.0 : t.bytes_per_worker[0] / 1e9,
                   result.seconds, verdict(bad).c_str());
  }
}

}  // namespace

// --role trainer-rank: rank o.rank of --trainers, started by rank 0. It prints its
// data port (as workers print theirs), accepts the workers and sends every round
// by itself, as an FSDP rank would after each optimizer step; its figures go to
// --stats-file.
int run_trainer_rank(const options& o) {
  die_with_trainer();
  const auto meta = make_layout(o.model_bytes, o.layers, o.vocab).meta;
  const auto p = plan_for(meta, layout_spec(o));
  shard_model shards(p.source, o.rank, o.change_fraction);
  asio::io_context io;
  auto sender = engine_factory::instance().create_sender(sharded_config(o), trainer_context{io.get_executor(), {}});
  json trainers = json::array();
  for (int r = 0; r < o.trainers; ++r) trainers.push_back({{"address", o.listen}, {"port", 0}});
  const json info = sender->prepare(sharded_trainer_args(o, trainers, o.rank));
  report_port(info["trainers"][o.rank]["port"].get<unsigned>());
  json stats = {{"rank", o.rank}, {"egress_bytes", json::array()}, {"send_seconds", json::array()}};
  delta_counts delta;  // --delta, written with the stats
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
          if (o.delta) delta.add(sender->last_send_info().at("delta"));
        }
      },
      [&](std::exception_ptr e) {
        if (e) failure = describe(e);
      });
  io.run();
  sender->shutdown();
  if (o.delta) stats["delta"] = delta.to_json();
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
                                       "--engine",
                                       o.engine,
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
                                       host_of(o, static_cast<std::size_t>(o.tp + r - 1)),
                                       "--stats-file",
                                       stats_files.back()};
      if (o.checksums) args.push_back("--checksums");
      if (o.delta) args.push_back("--delta");
      if (o.change_fraction > 0) {
        char fraction[32];
        std::snprintf(fraction, sizeof fraction, "%.17g", o.change_fraction);
        args.push_back("--change-fraction");
        args.push_back(fraction);
      }
      if (!o.secret_file.empty()) {
        args.push_back("--auth-secret-file");
        args.push_back(o.secret_file);
      }
      ranks.push_back(start_worker_process(args, std::chrono::milliseconds(o.timeout_ms),
                                           "trainer rank " + std::to_string(r),
                                           launcher_of(o, static_cast<std::size_t>(o.tp + r - 1))));
      std::fprintf(stderr, "[refit] pid of trainer rank %d: %d\n", r, static_cast<int>(ranks.back().pid));
    }
    asio::io_context io;
    std::exception_ptr error;
    asio::co_spawn(io, sharded_main(o, procs, ranks, meta, p, t), [&](std::exception_ptr e) { error = e; });
    io.run();
    if (error) std::rethrow_exception(error);
  } catch (...) {
    failure = describe(std::current_exception());
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
        if (s.contains("delta")) t.delta.add(s["delta"]);
      } catch (const std::exception&) {
      }
    } else if (failure.empty()) {
      failure = "trainer rank " + std::to_string(k + 1) + " left no stats (it died)";
    }
    t.egress.push_back(egress);
    std::remove(stats_files[k].c_str());
  }
  if (!failure.empty()) {
    t.check.verified = false;
    std::fprintf(stderr, "[refit] error: %s\n", failure.c_str());
  }
  if (!t.check.first_mismatch.empty())
    std::fprintf(stderr, "[refit] first mismatch: %s\n", t.check.first_mismatch.c_str());
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
                 {"worker_bytes", t.worker_bytes},
                 {"wire_bytes", t.wire_bytes},
                 {"trainer_egress_bytes", t.egress},
                 {"planned_bytes_per_worker_max", planned_bytes},
                 {"plan_s", t.plan_s},
                 {"checksums", o.checksums},
                 {"commit", to_string(o.commit)},
                 {"fleet_atomic", o.fleet_atomic},
                 {"workers_holding_undo", t.workers_holding_undo},
                 {"buffer_bytes", o.buffer_bytes},
                 {"rounds_verified", t.check.verified ? t.check.rounds_done : 0},
                 {"worker_peak_rss_bytes", t.peak_rss},
                 {"worker_loop_lag_ms",
                  {{"first_update", t.lag_first_ms}, {"update", t.lag_update_ms}, {"update_p99", t.lag_update_p99_ms}}},
                 {"verified", failure.empty() && t.check.verified && t.check.rounds_done == o.updates}};
  if (!t.worker_states.empty()) result["worker_states_after_failure"] = t.worker_states;
  if (o.change_fraction > 0) result["change_fraction"] = o.change_fraction;
  if (!t.transports.empty()) result["transports"] = t.transports;
  if (o.delta) result["delta"] = t.delta.to_json();
  if (!failure.empty()) result["error"] = failure;
  std::cout << result.dump() << std::endl;
  return failure.empty() && t.check.verified ? 0 : 1;
}

}  // namespace refit::example::weight_sync
