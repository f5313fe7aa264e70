// simulate: one update predicted on SimGrid (./refit simulate; docs/scale.md). Its
// flags are kUsage below (simulate --help prints it); errors go to stderr with exit
// status 2. Prints a table, or with --json one JSON object.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <simgrid/s4u.hpp>

#include <refit/error.h>
#include <refit/json_reader.h>

#include "examples/weight_sync/model.h"
#include "tools/simulate/hf_model.h"
#include "tools/simulate/sharded.h"
#include "tools/simulate/stream.h"

namespace {

using namespace refit;

constexpr char kUsage[] =
    R"(usage: simulate (--metadata FILE | --hf-config FILE [--weights bf16|fp8] [--print-model])
                [--workers N] [--engine tcp|ucx] [--topology star|chain|tree:K]
                [--rate 1gbit] [--cores N] [--latency-us U] [--buffer-bytes 8M] [--num-buffers 2]
                [--checksums] [--staged] [--no-direct] [--delta F] [--costs FILE] [--json]
       sharded (M trainer ranks to N workers on a cluster of GPUs, one NIC each):
                (--fsdp M | --hsdp R,S) [--replicas R] [--tp T] [--rate 400gbit]
                [--device-copy-gbps 1000] [--engine ucx|tcp] [--buffer-bytes 64M]
                [--delta F [--codec-cores C]] [--gpus-per-node 8] [--oversubscription X]
                [--platform SIMGRID_PLATFORM_FILE]

One update predicted on SimGrid from refit's own bucket plans, relay topologies and
sharded transfer plans (docs/scale.md).

  --metadata FILE    the update's tensors as vLLM's metadata JSON (names, dtype_names,
                     shapes; the main job prints its model's with --print-layout)
  --hf-config FILE   a Hugging Face config.json (tools/simulate/models/ has
                     docs/scale.md's); its checkpoint's tensors in --weights bf16 or fp8;
                     --print-model prints their count and bytes
  --costs FILE       a JSON object of costs.h's members (tcp_efficiency, ucx_efficiency,
                     pack_gbps, checksum_gbps, commit_gbps, stack_gbps, delta:
                     [{fraction, encode_gbps, decode_gbps, wire_fraction}], sources:
                     [...]); tests/bench/sim_calibrate.py writes the calibrated one,
                     docs/bench/sim_costs.json
  --json             one JSON object instead of a table
  -h, --help         this text
)";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "simulate: %s (simulate --help lists the flags)\n", why.c_str());
  std::exit(2);
}

json read_json_file(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  if (!in) usage(flag + ": cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const std::exception& e) {
    usage(flag + ": " + path + " is not JSON: " + e.what());
  }
}

// "1gbit", "400gbit", "100mbit" or bits per second.
double parse_rate(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  const std::string unit = end ? end : "";
  if (v <= 0) usage("--rate: '" + text + "'");
  if (unit.empty() || unit == "bit") return v;
  if (unit == "kbit") return v * 1e3;
  if (unit == "mbit") return v * 1e6;
  if (unit == "gbit") return v * 1e9;
  usage("--rate: unit of '" + text + "' (bit, kbit, mbit, gbit)");
}

sim::costs read_costs(const json& j) {
  sim::costs c;
  auto gbps = [&](const char* key, double& into) {
    if (j.contains(key)) into = j.at(key).get<double>() * 1e9;
  };
  if (j.contains("tcp_efficiency")) c.tcp_efficiency = j.at("tcp_efficiency").get<double>();
  if (j.contains("ucx_efficiency")) c.ucx_efficiency = j.at("ucx_efficiency").get<double>();
  gbps("pack_gbps", c.pack_bytes_per_s);
  gbps("checksum_gbps", c.checksum_bytes_per_s);
  gbps("commit_gbps", c.commit_bytes_per_s);
  gbps("stack_gbps", c.stack_bytes_per_s);
  if (j.contains("delta"))
    for (const json& d : j.at("delta"))
      c.delta.push_back({d.at("fraction").get<double>(), d.at("encode_gbps").get<double>() * 1e9,
                         d.at("decode_gbps").get<double>() * 1e9, d.at("wire_fraction").get<double>()});
  if (j.contains("sources"))
    for (const json& s : j.at("sources")) c.sources.push_back(s.get<std::string>());
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  std::string metadata_path, costs_path, hf_config_path;
  dtype weights = dtype::bfloat16;
  bool print_model = false;
  int workers = 1;
  sim::stream_options options;
  options.topology = links::topology::parse("star", "--topology");
  sim::switch_platform platform;
  bool as_json = false;
  bool sharded = false;
  sim::trainer_layout trainer;
  sim::worker_layout inference;
  sim::cluster_platform cluster;
  int codec_cores = 1;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) usage(a + " needs a value");
      return args[++i];
    };
    try {
      if (a == "--metadata")
        metadata_path = value();
      else if (a == "--costs")
        costs_path = value();
      else if (a == "--hf-config")
        hf_config_path = value();
      else if (a == "--weights") {
        const std::string w = value();
        if (w != "bf16" && w != "fp8") usage("--weights: bf16 or fp8, not '" + w + "'");
        weights = w == "fp8" ? dtype::float8_e4m3fn : dtype::bfloat16;
      } else if (a == "--print-model")
        print_model = true;
      else if (a == "--workers")
        workers = std::stoi(value());
      else if (a == "--engine")
        options.engine = value();
      else if (a == "--topology")
        options.topology = links::topology::parse(value(), "--topology");
      else if (a == "--rate")
        platform.nic_bits_per_s = parse_rate(value());
      else if (a == "--cores")
        platform.cores = std::stoi(value());
      else if (a == "--latency-us")
        platform.latency_s = std::stod(value()) * 1e-6;
      else if (a == "--buffer-bytes")
        options.wire.buffer_bytes = example::parse_bytes(value(), "--buffer-bytes");
      else if (a == "--num-buffers")
        options.wire.num_buffers = static_cast<std::uint32_t>(std::stoul(value()));
      else if (a == "--checksums")
        options.wire.checksums = true;
      else if (a == "--staged")
        options.staged = true;
      else if (a == "--no-direct")
        options.direct_receive = false;
      else if (a == "--delta")
        options.delta_fraction = std::stod(value());
      else if (a == "--json")
        as_json = true;
      else if (a == "--fsdp") {
        sharded = true;
        trainer.mesh = {std::stol(value())};
        trainer.placements = {placement::shard(0)};
      } else if (a == "--hsdp") {
        // R,S: R replicas of S-way FSDP.
        sharded = true;
        const std::string v = value();
        const auto comma = v.find(',');
        if (comma == std::string::npos) usage("--hsdp R,S");
        trainer.mesh = {std::stol(v.substr(0, comma)), std::stol(v.substr(comma + 1))};
        trainer.placements = {placement::replicate(), placement::shard(0)};
      } else if (a == "--replicas") {
        sharded = true;
        inference.replicas = std::stoi(value());
      } else if (a == "--tp") {
        sharded = true;
        inference.tp = std::stoi(value());
      } else if (a == "--gpus-per-node")
        cluster.gpus_per_node = std::stoi(value());
      else if (a == "--oversubscription")
        cluster.oversubscription = std::stod(value());
      else if (a == "--platform")
        cluster.file = value();
      else if (a == "--codec-cores")
        codec_cores = std::stoi(value());
      else if (a == "--device-copy-gbps")
        cluster.device_copy_bytes_per_s = std::stod(value()) * 1e9;
      else
        usage("unknown argument '" + a + "'");
    } catch (const refit::error& e) {
      usage(e.what());
    } catch (const std::logic_error&) {
      usage(a + ": not a number");
    }
  }
  if (metadata_path.empty() == hf_config_path.empty()) usage("one of --metadata FILE and --hf-config FILE");
  try {
    update_metadata meta;
    if (!hf_config_path.empty()) {
      const sim::hf_model m = sim::read_hf_model(read_json_file(hf_config_path, "--hf-config"), weights);
      meta = m.meta;
      if (print_model) {
        std::printf("%s: %zu tensors, %.4g parameters, %.4g GB\n", m.architecture.c_str(), meta.tensors.size(),
                    m.parameters, static_cast<double>(meta.total_bytes()) / 1e9);
        return 0;
      }
    } else {
      const json meta_json = read_json_file(metadata_path, "--metadata");
      json_reader reader(meta_json, "--metadata " + metadata_path);
      meta = read_update_metadata(reader);
    }
    const sim::costs costs = costs_path.empty() ? sim::costs{} : read_costs(read_json_file(costs_path, "--costs"));
    // SimGrid's engine, quiet: its log goes to stderr only for errors.
    int sg_argc = 2;
    char arg0[] = "simulate";
    char arg1[] = "--log=root.thres:critical";
    char* sg_argv[] = {arg0, arg1, nullptr};
    simgrid::s4u::Engine engine(&sg_argc, sg_argv);
    sim::prediction p;
    if (sharded) {
      cluster.nic_bits_per_s = platform.nic_bits_per_s;
      if (platform.latency_s > 0) cluster.latency_s = platform.latency_s;
      sim::sharded_options so;
      so.wire = options.wire;
      so.engine = options.engine == "tcp" || options.engine == "tcp_sharded" ? "tcp_sharded" : "ucx_sharded";
      so.delta_fraction = options.delta_fraction;
      so.staged = options.staged;
      so.codec_cores = codec_cores;
      p = sim::simulate_sharded(meta, trainer, inference, so, cluster, costs);
    } else {
      p = sim::simulate_stream(meta, workers, options, platform, costs);
    }
    if (as_json) {
      json out = p.to_json();
      out["workers"] = workers;
      out["engine"] = options.engine;
      out["topology"] = options.topology.to_string();
      out["sources"] = costs.sources;
      std::cout << out.dump() << "\n";
    } else {
      std::cout << p.table();
      for (const std::string& s : costs.sources) std::cout << "  cost: " << s << "\n";
    }
  } catch (const refit::error& e) {
    std::fprintf(stderr, "simulate: %s\n", e.what());
    return 1;
  }
  return 0;
}
