#include "tools/simulate/stream.h"

#include <simgrid/s4u.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <refit/backend/net.h>
#include <refit/error.h>
#include "tools/simulate/simgrid.h"

namespace refit::sim {
namespace {
namespace sg4 = simgrid::s4u;

// A value actors wait on (SimGrid's own mutex and condition variable: actors are
// not threads).
class counter {
 public:
  counter() : mutex_(sg4::Mutex::create()), cv_(sg4::ConditionVariable::create()) {}
  void add() {
    std::unique_lock lock(*mutex_);
    ++value_;
    cv_->notify_all();
  }
  void wait_for(std::uint64_t v) {
    std::unique_lock lock(*mutex_);
    while (value_ < v) cv_->wait(lock);
  }

 private:
  sg4::MutexPtr mutex_;
  sg4::ConditionVariablePtr cv_;
  std::uint64_t value_ = 0;
};

// The stream as the wire carries it: pieces in order, each of one bucket.
struct stream_pieces {
  std::vector<double> bytes;
  std::vector<std::uint64_t> bucket_end;  // per bucket: one past its last piece
  std::vector<double> bucket_wire;        // per bucket: bytes on the wire
  std::vector<double> bucket_model;       // per bucket: model bytes it carries
};

stream_pieces cut(const bucket_plan& plan, double wire_fraction, std::uint64_t piece_bytes) {
  stream_pieces s;
  for (const bucket& b : plan.buckets) {
    const double wire = static_cast<double>(b.payload_bytes) * wire_fraction;
    double left = wire;
    do {
      const double take = piece_bytes ? std::min<double>(left, static_cast<double>(piece_bytes)) : left;
      s.bytes.push_back(take);
      left -= take;
    } while (left > 0);
    s.bucket_end.push_back(s.bytes.size());
    s.bucket_wire.push_back(wire);
    s.bucket_model.push_back(static_cast<double>(b.payload_bytes));
  }
  return s;
}

}  // namespace

prediction simulate_stream(const update_metadata& meta, int workers, const stream_options& o,
                           const switch_platform& platform, const costs& c) {
  if (workers < 1) throw_error(errc::invalid_argument, "workers must be at least 1");
  if (o.engine != "tcp" && o.engine != "ucx")
    throw_error(errc::invalid_argument, "stream engine '" + o.engine + "' (tcp or ucx)");
  if (o.delta_fraction < 0 || o.delta_fraction > 1)
    throw_error(errc::invalid_argument, "delta fraction must be in [0, 1]");
  o.wire.validate();
  const bucket_plan plan = plan_buckets(meta, o.wire);
  const bool delta = o.delta_fraction > 0;
  const delta_rates codec = delta ? c.delta_at(o.delta_fraction) : delta_rates{};
  // tcp forwards what it has read (one read of at most net::loop_bytes_per_call);
  // ucx's relay forwards a bucket once it is whole.
  const bool cut_through = o.engine == "tcp";
  const stream_pieces s = cut(plan, delta ? codec.wire_fraction : 1.0, cut_through ? net::loop_bytes_per_call : 0);
  const std::uint64_t buckets = plan.buckets.size();
  const std::uint64_t slots = o.wire.num_buffers;
  const double efficiency = o.engine == "tcp" ? c.tcp_efficiency : c.ucx_efficiency;
  const double line = platform.nic_bits_per_s / 8;

  sg4::Engine& e = *sg4::Engine::get_instance();
  auto* zone = grid::switch_zone("switch");
  std::vector<sg4::Host*> hosts;
  for (int h = 0; h <= workers; ++h) {
    const std::string name = h == 0 ? "trainer" : "worker" + std::to_string(h);
    hosts.push_back(
        grid::add_host(zone, name, line * efficiency, platform.latency_s)->set_core_count(platform.cores > 0 ? 1 : 64));
  }
  // Processes that share one machine's cores compute there.
  sg4::Host* shared_cpu =
      platform.cores > 0 ? zone->create_host("cpu", grid::core_flops)->set_core_count(platform.cores) : nullptr;
  // And a staged commit (the model's and the stage's bytes swapped) is bound by
  // the memory system, not a core: the calibrated rate is one commit alone on the
  // machine, so commits at once share it.
  sg4::Host* shared_memory = platform.cores > 0 ? zone->create_host("memory", grid::core_flops) : nullptr;
  zone->seal();
  auto cpu_of = [&](int h) { return shared_cpu ? shared_cpu : hosts[h]; };

  // Per host: pieces it has (the trainer: packed). Per worker: buckets received
  // and processed. Per edge (the child's rank): buckets sent to it.
  std::vector<std::unique_ptr<counter>> have, received, processed, sent;
  for (int h = 0; h <= workers; ++h) {
    have.push_back(std::make_unique<counter>());
    received.push_back(std::make_unique<counter>());
    processed.push_back(std::make_unique<counter>());
    sent.push_back(std::make_unique<counter>());
  }
  const std::vector<int> trainer_children = o.topology.children(0, workers);
  double pack_busy = 0, last_byte = 0, processing_done = 0, commit_done = 0;
  std::vector<double> tx(workers + 1, 0), rx(workers + 1, 0);

  // The trainer: each bucket packed (hashed, encoded) into a free staging slot.
  sg4::Actor::create("pack", cpu_of(0), [&] {
    for (std::uint64_t b = 0; b < buckets; ++b) {
      if (b >= slots)
        for (int child : trainer_children) sent[child]->wait_for(b - slots + 1);
      const double model = s.bucket_model[b];
      double cost = model / c.pack_bytes_per_s;
      if (o.wire.checksums) cost += s.bucket_wire[b] / c.checksum_bytes_per_s;
      if (delta) cost += model / codec.encode_bytes_per_s;
      grid::run_for(cost);
      pack_busy += cost;
      for (std::uint64_t p = b ? s.bucket_end[b - 1] : 0; p < s.bucket_end[b]; ++p) have[0]->add();
    }
  });

  // One sender per edge, in stream order: a piece goes once the parent has it
  // (store and forward: once the parent has its whole bucket), and into a worker
  // that receives through staging only while it has a free slot.
  static int token = 0;
  for (int child = 1; child <= workers; ++child) {
    const int parent = o.topology.parent(child);
    for (double bytes : s.bytes) {
      tx[parent] += bytes;
      rx[child] += bytes;
    }
    sg4::Actor::create("send-" + std::to_string(child), hosts[parent], [&, parent, child] {
      auto* mailbox = sg4::Mailbox::by_name("edge-" + std::to_string(child));
      std::uint64_t p = 0;
      for (std::uint64_t b = 0; b < buckets; ++b) {
        if (!o.direct_receive && !o.staged && b >= slots) processed[child]->wait_for(b - slots + 1);
        if (!cut_through && parent != 0) have[parent]->wait_for(s.bucket_end[b]);
        for (; p < s.bucket_end[b]; ++p) {
          have[parent]->wait_for(p + 1);
          mailbox->put(&token, s.bytes[p]);
        }
        sent[child]->add();
      }
    });
    // The receiver takes its pieces in order; the host's network stack (the
    // kernel's copies, on the shared cores) makes each available behind it: under
    // load that, not the wire, sets when a piece can be forwarded and processed.
    auto arrived = std::make_shared<counter>();
    sg4::Actor::create("receive-" + std::to_string(child), hosts[child], [&, child, arrived] {
      auto* mailbox = sg4::Mailbox::by_name("edge-" + std::to_string(child));
      for (std::uint64_t p = 0; p < s.bytes.size(); ++p) {
        mailbox->get<int>();
        arrived->add();
      }
    });
    sg4::Actor::create("stack-" + std::to_string(child), cpu_of(child), [&, child, arrived] {
      const bool forwards = !o.topology.children(child, workers).empty();
      std::uint64_t p = 0;
      for (std::uint64_t b = 0; b < buckets; ++b) {
        for (; p < s.bucket_end[b]; ++p) {
          arrived->wait_for(p + 1);
          grid::run_for(s.bytes[p] * (forwards ? 2 : 1) / c.stack_bytes_per_s);
          have[child]->add();
        }
        received[child]->add();
        last_byte = std::max(last_byte, sg4::Engine::get_clock());
      }
    });
    // Per bucket: checksum verified, payload copied from staging, delta decoded;
    // then a staged update's commit.
    sg4::Actor::create("process-" + std::to_string(child), cpu_of(child), [&, child] {
      for (std::uint64_t b = 0; b < buckets; ++b) {
        received[child]->wait_for(b + 1);
        double cost = 0;
        if (o.wire.checksums) cost += s.bucket_wire[b] / c.checksum_bytes_per_s;
        if (!o.direct_receive) cost += s.bucket_model[b] / c.pack_bytes_per_s;
        // A worker that takes deltas decodes, and hashes what it holds then (the
        // fingerprint of its version).
        if (delta) cost += s.bucket_model[b] / codec.decode_bytes_per_s + s.bucket_model[b] / c.checksum_bytes_per_s;
        grid::run_for(cost);
        processed[child]->add();
      }
      processing_done = std::max(processing_done, sg4::Engine::get_clock());
      if (o.staged) {
        if (shared_memory) sg4::this_actor::set_host(shared_memory);
        grid::run_for(static_cast<double>(plan.payload_bytes) / c.commit_bytes_per_s);
      }
      commit_done = std::max(commit_done, sg4::Engine::get_clock());
    });
  }
  e.run();

  prediction out;
  out.seconds = commit_done;
  double wire_total = 0;
  for (double w : s.bucket_wire) wire_total += w;
  out.payload_bytes = wire_total;
  for (int h = 0; h <= workers; ++h) {
    out.nics.push_back({hosts[h]->get_name(), tx[h], rx[h]});
    out.consider(hosts[h]->get_name(), std::max(tx[h], rx[h]), line);
  }
  out.phases = {
      {"trainer packing", pack_busy, "CPU the trainer spends packing, hashing and encoding buckets"},
      {"wire", last_byte, "from the start until the last worker has its last byte"},
      {"processing tail", processing_done - last_byte, "after the last byte: the last buckets' checks and copies"},
      {"commit", commit_done - processing_done, "a staged update's copy into the model"},
  };
  return out;
}

}  // namespace refit::sim
