#include "tools/simulate/sharded.h"

#include <simgrid/s4u.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <refit/error.h>
#include <refit/layout/transfer_plan.h>
#include "tools/simulate/simgrid.h"

namespace refit::sim {
namespace {
namespace sg4 = simgrid::s4u;

// The routed expert a checkpoint name belongs to ("...mlp.experts.17.up_proj..."),
// or -1.
long expert_of(const std::string& name) {
  const std::string key = ".mlp.experts.";
  const auto at = name.find(key);
  if (at == std::string::npos) return -1;
  return std::strtol(name.c_str() + at + key.size(), nullptr, 10);
}

// vLLM's dense tensor parallelism by checkpoint name (Llama, Qwen, DeepSeek's MLA).
// fp8's block scales (a 128x128 block each, 1/16384 of their weight's bytes) are
// counted whole on every rank: their blocks do not divide by the ranks.
tp_layout_options dense_rules() {
  tp_layout_options o;
  o.shards = {
      {R"((q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.(weight|bias)$)", parallel_style::column},
      {R"((o_proj|down_proj)\.weight$)", parallel_style::row},
      {R"((embed_tokens|lm_head)\.weight$)", parallel_style::vocab},
  };
  return o;
}

}  // namespace

std::vector<dest_layout> worker_layouts(const update_metadata& global, const worker_layout& w) {
  if (w.replicas < 1 || w.tp < 1) throw_error(errc::invalid_argument, "replicas and tp must be at least 1");
  update_metadata dense;
  std::vector<std::size_t> experts;
  for (std::size_t t = 0; t < global.tensors.size(); ++t) {
    if (expert_of(global.tensors[t].name) >= 0)
      experts.push_back(t);
    else
      dense.tensors.push_back(global.tensors[t]);
  }
  const tp_layout_options rules = dense_rules();
  std::vector<dest_layout> per_rank;
  for (int r = 0; r < w.tp; ++r) {
    dest_layout d = tensor_parallel_layout(dense, w.tp, r, rules);
    for (std::size_t t : experts) {
      const tensor_spec& s = global.tensors[t];
      if (expert_of(s.name) % w.tp != r) continue;
      d.tensors.push_back({s, {{s.name, whole(s.shape), std::vector<std::int64_t>(s.shape.size(), 0)}}});
    }
    per_rank.push_back(std::move(d));
  }
  std::vector<dest_layout> out;
  for (int k = 0; k < w.replicas; ++k)
    for (const dest_layout& d : per_rank) out.push_back(d);
  return out;
}

prediction simulate_sharded(const update_metadata& global, const trainer_layout& trainer, const worker_layout& workers,
                            const sharded_options& o, const cluster_platform& platform, const costs& c) {
  o.wire.validate();
  if (o.engine != "ucx_sharded" && o.engine != "tcp_sharded")
    throw_error(errc::invalid_argument, "sharded engine '" + o.engine + "' (ucx_sharded or tcp_sharded)");
  device_mesh mesh;
  mesh.shape = trainer.mesh;
  const source_layout source = source_layout::uniform(global, mesh, trainer.placements);
  const std::vector<dest_layout> dests = worker_layouts(global, workers);
  const transfer_plan plan = plan_transfer(source, dests);
  const int ranks = plan.ranks, n = plan.workers;
  const double efficiency = o.engine == "tcp_sharded" ? c.tcp_efficiency : c.ucx_efficiency;
  const double line = platform.nic_bits_per_s / 8;
  const double bucket = static_cast<double>(o.wire.buffer_bytes);
  if (o.delta_fraction < 0 || o.delta_fraction > 1 || o.codec_cores < 1)
    throw_error(errc::invalid_argument, "delta fraction in [0, 1] and codec cores at least 1");
  const bool delta = o.delta_fraction > 0;
  const delta_rates codec = delta ? c.delta_at(o.delta_fraction) : delta_rates{};
  const double wire_fraction = delta ? codec.wire_fraction : 1.0;
  // Per model byte a rank packs (a device copy; a delta is encoded on the CPU) and
  // a worker unpacks (decoded and hashed, for a delta).
  const double hash_s_per_byte = o.wire.checksums ? wire_fraction / (c.checksum_bytes_per_s * o.codec_cores) : 0;
  const double pack_s_per_byte = 1 / platform.device_copy_bytes_per_s +
                                 (delta ? 1 / (codec.encode_bytes_per_s * o.codec_cores) : 0) + hash_s_per_byte;
  const double unpack_s_per_byte =
      1 / platform.device_copy_bytes_per_s +
      (delta ? (1 / codec.decode_bytes_per_s + 1 / c.checksum_bytes_per_s) / o.codec_cores : 0) + hash_s_per_byte;

  sg4::Engine& e = *sg4::Engine::get_instance();
  std::vector<sg4::Host*> hosts;
  // Trainer ranks, then workers, numbered into nodes of gpus_per_node in order.
  const int per_node = platform.gpus_per_node;
  if (per_node < 1 || platform.oversubscription < 1)
    throw_error(errc::invalid_argument, "gpus per node must be at least 1 and oversubscription at least 1");
  const int trainer_nodes = (ranks + per_node - 1) / per_node;
  auto node_of = [&](int h) { return h < ranks ? h / per_node : trainer_nodes + (h - ranks) / per_node; };
  const bool oversubscribed = platform.file.empty() && platform.oversubscription > 1;
  const double uplink = per_node * line / platform.oversubscription;
  auto name_of = [&](int h) {
    return h < ranks ? "trainer" + std::to_string(h) : "worker" + std::to_string(h - ranks);
  };
  if (!platform.file.empty()) {
    e.load_platform(platform.file);
    for (int h = 0; h < ranks + n; ++h) {
      sg4::Host* host = sg4::Host::by_name_or_null(name_of(h));
      if (!host)
        throw_error(errc::invalid_argument, "platform " + platform.file + " has no host '" + name_of(h) +
                                                "' (it needs trainer0 .. trainer" + std::to_string(ranks - 1) +
                                                " and worker0 .. worker" + std::to_string(n - 1) + ")");
      hosts.push_back(host);
    }
  } else {
    auto* zone = grid::switch_zone("fabric");
    // An oversubscribed tree: each node's uplink.
    std::vector<sg4::SplitDuplexLink*> uplinks;
    auto uplink_of = [&](int h) {
      while (static_cast<int>(uplinks.size()) <= node_of(h))
        uplinks.push_back(
            zone->create_split_duplex_link("node" + std::to_string(uplinks.size()) + ".uplink", uplink * efficiency));
      return uplinks[node_of(h)];
    };
    for (int h = 0; h < ranks + n; ++h) {
      std::vector<sg4::LinkInRoute> also;
      if (oversubscribed) also.emplace_back(uplink_of(h), sg4::LinkInRoute::Direction::UP);
      hosts.push_back(grid::add_host(zone, name_of(h), line * efficiency, platform.latency_s, also));
    }
    zone->seal();
  }

  // Per pair: its buckets' sizes, by round.
  auto buckets_of = [&](double bytes) {
    std::vector<double> out;
    for (double left = bytes; left > 0; left -= bucket) out.push_back(std::min(left, bucket));
    return out;
  };
  std::vector<std::vector<std::vector<double>>> pairs(ranks, std::vector<std::vector<double>>(n));
  std::size_t rounds = 0;
  for (int r = 0; r < ranks; ++r)
    for (int w = 0; w < n; ++w) {
      pairs[r][w] = buckets_of(static_cast<double>(plan.pair(r, w).bytes));
      rounds = std::max(rounds, pairs[r][w].size());
    }
  auto mailbox = [&](int r, int w) { return sg4::Mailbox::by_name(std::to_string(r) + ">" + std::to_string(w)); };
  double pack_busy = 0, unpack_busy = 0, last_byte = 0, unpacked = 0, done = 0;
  static int token = 0;

  for (int r = 0; r < ranks; ++r) {
    sg4::Actor::create("rank" + std::to_string(r), hosts[r], [&, r] {
      double packed = 0;
      auto pack = [&](std::size_t k) {
        double bytes = 0;
        for (int w = 0; w < n; ++w)
          if (k < pairs[r][w].size()) bytes += pairs[r][w][k];
        const double cost = bytes * pack_s_per_byte;
        grid::run_for(cost);
        packed += cost;
        pack_busy = std::max(pack_busy, packed);
      };
      std::vector<sg4::CommPtr> flying;
      if (rounds) pack(0);
      for (std::size_t k = 0; k < rounds; ++k) {
        std::vector<sg4::CommPtr> now;
        for (int w = 0; w < n; ++w)
          if (k < pairs[r][w].size()) now.push_back(mailbox(r, w)->put_async(&token, pairs[r][w][k] * wire_fraction));
        if (k + 1 < rounds) pack(k + 1);  // the other slot, while this round moves
        for (auto& comm : now) comm->wait();
      }
    });
  }
  for (int w = 0; w < n; ++w) {
    sg4::Actor::create("worker" + std::to_string(w), hosts[ranks + w], [&, w] {
      double unpack_total = 0;
      for (std::size_t k = 0; k < rounds; ++k) {
        std::vector<sg4::CommPtr> now;
        std::vector<int*> got(ranks, nullptr);
        double bytes = 0;
        for (int r = 0; r < ranks; ++r)
          if (k < pairs[r][w].size()) {
            now.push_back(mailbox(r, w)->get_async<int>(&got[r]));
            bytes += pairs[r][w][k];
          }
        for (auto& comm : now) comm->wait();
        last_byte = std::max(last_byte, sg4::Engine::get_clock());
        const double cost = bytes * unpack_s_per_byte;
        grid::run_for(cost);
        unpack_total += cost;
      }
      unpack_busy = std::max(unpack_busy, unpack_total);
      unpacked = std::max(unpacked, sg4::Engine::get_clock());
      if (o.staged) grid::run_for(static_cast<double>(plan.ingress[w]) / platform.device_copy_bytes_per_s);
      done = std::max(done, sg4::Engine::get_clock());
    });
  }
  e.run();

  prediction out;
  out.seconds = done;
  out.payload_bytes = static_cast<double>(plan.total_bytes()) * wire_fraction;
  std::vector<double> node_bytes(node_of(ranks + n - 1) + 1, 0);
  for (int h = 0; h < ranks + n; ++h) {
    const double tx = h < ranks ? static_cast<double>(plan.egress[h]) * wire_fraction : 0;
    const double rx = h < ranks ? 0 : static_cast<double>(plan.ingress[h - ranks]) * wire_fraction;
    out.nics.push_back({hosts[h]->get_name(), tx, rx});
    out.consider(hosts[h]->get_name(), std::max(tx, rx), line);
    node_bytes[node_of(h)] += std::max(tx, rx);
  }
  // Oversubscribed: a node's uplink carries all its GPUs' bytes at a fraction of
  // their NICs' sum, and may be the limit instead.
  if (oversubscribed)
    for (std::size_t node = 0; node < node_bytes.size(); ++node)
      out.consider("node" + std::to_string(node) + ".uplink", node_bytes[node], uplink);
  out.phases = {
      {"trainer packing", pack_busy,
       "the busiest rank's device copies into its staging buckets (and delta encoding), all rounds"},
      {"wire", last_byte, "from the start until the last worker has its last bucket"},
      {"unpacking tail", unpacked - last_byte, "after the last bucket: its device copy into the model"},
      {"commit", done - unpacked, "a staged update's copy into the model"},
      {"unpacking", unpack_busy, "the busiest worker's device copies (and delta decoding), all rounds"},
  };
  return out;
}

}  // namespace refit::sim
