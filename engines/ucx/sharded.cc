// Sharded UCX: the worker (joins every trainer rank, offers its UCX address, then
// per pair and frame grants its own tensors: for puts, or a tagged receive) and one
// trainer rank's sender (per worker and frame, puts or a tagged send from its
// shards, then "done").
#include <refit/engines/ucx/sharded.h>

#include <algorithm>
#include <set>
#include <thread>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/hex.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/shard_io.h>
#include "downstream.h"  // private to this engine
#include "registry.h"    // private to this engine
#include "ucp.h"         // private to this engine
#include "upstream.h"    // private to this engine
#include "wire.h"        // private to this engine

namespace refit::ucx {

namespace {

using backend::buffers_of;

// A frame's tag: the update's sequence above (what send_bucket checks), the trainer
// rank below, so the pairs' receives on the worker's one UCX worker never match
// each other's messages (a pair has one frame in flight at a time).
std::uint64_t frame_tag(std::uint64_t seq, int rank) { return (seq << 32) | static_cast<std::uint32_t>(rank); }

}  // namespace

sharded_init_info sharded_init_info::read(json_reader& r) {
  sharded_init_info info;
  static_cast<backend::sharded_init_info&>(info) = backend::sharded_init_info::read(r);
  info.require_transports = r.optional<std::vector<std::string>>("require_transports", {});
  info.put_into_model = r.maybe<bool>("put_into_model");
  return info;
}

// ---------------------------------------------------------------- worker

sharded_engine::sharded_engine(const weight_transfer_config& config, const engine_context& context)
    : typed_init(config, context, capabilities_of()) {}

sharded_engine::~sharded_engine() { close(); }

json sharded_engine::transport_info() const {
  if (sockets().empty() || reports_.empty()) return nullptr;
  std::set<std::string> seen;
  json transports = json::array(), ranks = json::array();
  bool peer = true;
  std::string mode = reports_.front().mode;
  for (const auto& r : reports_) {
    if (r.mode != mode) mode = "mixed";
    for (const auto& t : r.transports)
      if (seen.insert(t).second) transports.push_back(t);
    peer = peer && r.peer_failure_handling;
    ranks.push_back(r.to_json());
  }
  return {{"worker", worker()},
          {"transports", std::move(transports)},
          {"mode", mode},
          {"peer_failure_handling", peer},
          {"trainer_ranks", std::move(ranks)}};
}

asio::awaitable<void> sharded_engine::joining(const backend::sharded_init_info& base) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  put_into_model_ = info.put_into_model;
  // UCX's context (it loads its transport modules) is made once, off the loop.
  if (!ucp_) ucp_ = co_await async::offload(processing_executor(), [] { return std::make_shared<ucx::context>(); });
  worker_ucx_ = ucx::worker::create(ucp_, context().executor);
  reports_.assign(info.trainers.size(), {});
}

asio::awaitable<void> sharded_engine::joined_rank(const backend::sharded_init_info& base, int rank,
                                                  asio::ip::tcp::socket& socket) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  ucx::worker::engaged progressing(worker_ucx_);
  // No regions yet: the tensors are registered per update (puts), or each frame
  // comes as a tagged message. The report's mode says which.
  auto choose = [asked = put_into_model_](endpoint_report& rep) {
    if (!puts_into_model(rep, asked)) rep.mode = "tag";
  };
  const std::string to = "trainer rank " + std::to_string(rank);
  reports_.at(static_cast<std::size_t>(rank)) =
      co_await offer_and_agree(socket, *worker_ucx_, {}, info.require_transports, choose, timeout(), who(), to);
}

asio::awaitable<std::uint64_t> sharded_engine::receive_pairs(const backend::sharded_update& u) {
  const auto& dest = u.layouts->workers.at(worker());
  const std::vector<std::byte*>& bases = u.placed.bases;
  auto w = worker_ucx_;
  ucx::worker::engaged progressing(w);
  // Pairs whose frames come by puts write straight into these tensors: each one
  // registered whole for this update, off the loop, before the first grant.
  std::unique_ptr<update_registry> registry;
  last_put_regions_ = 0;
  if (std::any_of(reports_.begin(), reports_.end(), [](const endpoint_report& r) { return r.mode == "put"; })) {
    if (!registrar_) registrar_ = std::make_unique<registrar>();
    registry = registrar_->open(ucp_);
    std::vector<asio::mutable_buffer> tensors;
    for (std::size_t i = 0; i < dest.tensors.size(); ++i)
      if (dest.tensors[i].spec.nbytes() > 0) tensors.emplace_back(bases[i], dest.tensors[i].spec.nbytes());
    std::exception_ptr failure;
    try {
      co_await registry->cover(tensors);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      co_await tell_all(failure);  // every rank hears why now rather than at its deadline
      std::rethrow_exception(failure);
    }
    last_put_regions_ = registry->size();
  }
  // Every pair at once on the one UCX worker (the first failure cancels the others
  // and tells every rank).
  std::vector<std::uint64_t> wire_bytes(sockets().size(), 0);
  std::vector<asio::awaitable<void>> pairs;
  for (std::size_t r = 0; r < sockets().size(); ++r)
    pairs.push_back(receive_pair(sockets()[r], w, static_cast<int>(r), u.layouts, bases, &wire_bytes[r],
                                 reports_[r].mode == "put" ? registry.get() : nullptr));
  std::exception_ptr failure;
  try {
    co_await all_pairs(std::move(pairs));
  } catch (...) {
    failure = std::current_exception();
  }
  // Every put completed (each done came after its flush) or the update failed.
  if (registry) co_await registrar_->close(std::move(registry));
  if (failure) std::rethrow_exception(failure);
  std::uint64_t total = 0;
  for (auto b : wire_bytes) total += b;
  co_return total;
}

asio::awaitable<void> sharded_engine::receive_pair(socket_ptr socket, std::shared_ptr<ucx::worker> w, int rank,
                                                   std::shared_ptr<const backend::sharded_layouts> layouts,
                                                   std::vector<std::byte*> bases, std::uint64_t* wire_bytes,
                                                   update_registry* registry) {
  const std::string me = who() + ": trainer rank " + std::to_string(rank);
  const bool checksums = wire().checksums;
  const std::vector<stream_frame> frames = co_await pair_frames(*layouts, rank, bases);
  // The pair's header; a refusal goes back before any byte (ucx_sharded takes no
  // deltas).
  const std::uint64_t seq = co_await accept_pair(*socket, rank, *layouts, frames.size(), me);
  direct_write_begins();
  std::set<std::uint32_t> keyed;  // regions whose keys this rank got in this update
  for (std::size_t k = 0; k < frames.size(); ++k) {
    const std::string what = me + ": frame " + std::to_string(k);
    auto dest_buffers = buffers_of<asio::mutable_buffer>(frames[k]);
    wire::grant g;
    g.index = k;
    g.payload_bytes = frames[k].bytes;
    std::vector<std::byte> pieces;
    std::unique_ptr<tag_receive> posted;
    if (registry) {
      // Puts into the runs, each within a tensor registered for this update; a
      // region's key goes to this rank the first time it is named.
      const auto regions = co_await registry->cover(dest_buffers);
      pieces = put_pieces_grant(
          dest_buffers, regions, [&keyed](update_registry::region& r) { return keyed.insert(r.id).second; }, g);
    } else {
      // Posted before the grant: the trainer's message always finds its receive.
      g.mode = wire::mode_tag;
      g.tag = frame_tag(seq, rank);
      posted = std::make_unique<tag_receive>(w, dest_buffers, g.tag, what + " (tagged receive)");
    }
    const auto raw = wire::encode(g);
    std::vector<asio::const_buffer> grant{asio::buffer(raw)};
    if (!pieces.empty()) grant.push_back(asio::buffer(pieces));
    co_await net::write_all(*socket, grant, timeout(), what + ": granting its destination");
    const std::uint64_t expected = co_await read_done(*socket, k, checksums, timeout(), what);
    if (posted) co_await posted->wait(timeout());
    *wire_bytes += frames[k].bytes;
    if (!checksums) continue;
    // Verified where the bytes landed, on the processing executor.
    auto* b = &dest_buffers;
    const std::uint64_t got = co_await async::offload(
        processing_executor(), [b] { return checksum(std::span<const asio::mutable_buffer>(*b)); });
    if (got != expected)
      throw_error(errc::integrity_error,
                  what + ": payload checksum " + to_hex(got) + " differs from the trainer's " + to_hex(expected));
  }
  co_await links::confirm_update(*socket, seq, timeout(), me);
}

void sharded_engine::close_transport() noexcept {
  reports_.clear();
  if (worker_ucx_) {
    worker_ucx_->close();
    worker_ucx_.reset();
  }
}

// ---------------------------------------------------------------- trainer rank

sharded_sender::sharded_sender(const weight_transfer_config& config, const trainer_context& context)
    : sharded_sender_base(config, context) {}

sharded_sender::~sharded_sender() { shutdown(); }

asio::awaitable<void> sharded_sender::connected(std::vector<links::member> members) {
  if (!ucp_) ucp_ = co_await async::offload(pool().get_executor(), [] { return std::make_shared<ucx::context>(); });
  worker_ = worker::create(ucp_, context_.executor);
  worker::engaged progressing(worker_);
  for (auto& m : members) {
    auto p = std::make_shared<downstream>();
    p->rank = m.rank;
    p->name = who() + ": worker " + std::to_string(m.rank - 1);
    p->socket = m.socket;
    peers_.push_back(std::move(p));
  }
  std::vector<asio::awaitable<void>> ops;
  for (auto& p : peers_) ops.push_back(connect_downstream(p, worker_, args().timeout));
  co_await async::all_of(std::move(ops));
}

json sharded_sender::transport_info() const {
  json out = json::object();
  for (const auto& p : peers_) out[std::to_string(p->rank - 1)] = p->report.to_json();
  return out;
}

void sharded_sender::close_transport() noexcept {
  // Keys and endpoints before their worker (downstream::close), then the worker.
  for (auto& p : peers_) p->close();
  peers_.clear();
  if (worker_) {
    worker_->close();
    worker_.reset();
  }
}

asio::awaitable<void> sharded_sender::send_pairs(const backend::sharded_send& s) {
  const auto& plan = *s.layouts->plan;
  const int rank = this->rank(), workers = args().workers;
  const std::uint64_t seq = s.seq;
  // Each pair's frames over the shards, and (checksums on) each frame's checksum,
  // made on the pool.
  std::vector<std::vector<stream_frame>> frames(workers);
  std::vector<std::vector<std::uint64_t>> sums(workers);
  {
    auto* f = &frames;
    auto* sm = &sums;
    const auto* in = &s;
    const bool checksums = args().wire.checksums;
    co_await async::offload(pool().get_executor(), [this, f, sm, in, checksums] {
      for (std::size_t w = 0; w < f->size(); ++w) {
        (*f)[w] = frames_to(*in, static_cast<int>(w));
        if (!checksums) continue;
        for (const auto& frame : (*f)[w]) {
          const auto buffers = buffers_of<asio::const_buffer>(frame);
          (*sm)[w].push_back(checksum(std::span<const asio::const_buffer>(buffers)));
        }
      }
    });
  }
  for (auto& p : peers_) p->forget_update_regions();  // each update's grants bring the keys of its regions
  auto w = worker_;
  ucx::worker::engaged progressing(w);
  std::vector<asio::awaitable<void>> streams;
  for (int k = 0; k < workers; ++k) {
    const auto& pair = plan.pair(rank, k);
    auto header = links::update_header(seq, pair.items.size(), backend::pair_digest(plan.digest, rank, k),
                                       frames[k].size(), pair.bytes);
    auto stream = [](std::shared_ptr<ucx::worker> w, std::shared_ptr<downstream> p, std::array<std::byte, 48> header,
                     const std::vector<stream_frame>* frames, const std::vector<std::uint64_t>* sums, std::uint64_t seq,
                     std::chrono::milliseconds timeout) -> asio::awaitable<void> {
      co_await links::announce_update(*p->socket, header, timeout, p->name);
      for (std::size_t i = 0; i < frames->size(); ++i) {
        const auto buffers = buffers_of<asio::const_buffer>((*frames)[i]);
        std::optional<std::uint64_t> sum;
        if (!sums->empty()) sum = (*sums)[i];
        co_await send_bucket(w, p, i, buffers, seq, sum, timeout);
      }
      co_await links::await_confirmation(*p->socket, seq, timeout, p->name);
    };
    auto p = peers_.at(k);
    streams.push_back(with_peer_reason(stream(w, p, header, &frames[k], &sums[k], seq, args().timeout), p));
  }
  co_await async::all_of(std::move(streams));
}

}  // namespace refit::ucx
