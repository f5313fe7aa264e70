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
#include <refit/backend/links/links.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/shard_io.h>
#include <refit/internal/hex.h>
#include "downstream.h"  // private to this engine
#include "registry.h"    // private to this engine
#include "ucp.h"         // private to this engine
#include "upstream.h"    // private to this engine
#include "wire.h"        // private to this engine

namespace refit::ucx {

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

template <class Buffer>
std::vector<Buffer> buffers_of(const stream_frame& f) {
  std::vector<Buffer> out;
  out.reserve(f.runs.size());
  for (const auto& r : f.runs) out.emplace_back(r.data, r.bytes);
  return out;
}

// A frame's tag: the update's sequence above (what send_bucket checks), the trainer
// rank below, so the pairs' receives on the worker's one UCX worker never match
// each other's messages (a pair has one frame in flight at a time).
std::uint64_t frame_tag(std::uint64_t seq, int rank) { return (seq << 32) | static_cast<std::uint32_t>(rank); }

}  // namespace

sharded_init_info sharded_init_info::read(json_reader& r) {
  sharded_init_info info;
  static_cast<backend::sharded_join_info&>(info) = backend::sharded_join_info::read(r);
  info.require_transports = r.optional<std::vector<std::string>>("require_transports", {});
  info.put_into_model = r.maybe<bool>("put_into_model");
  return info;
}

// ---------------------------------------------------------------- worker

sharded_engine::sharded_engine(const weight_transfer_config& config, const engine_context& context)
    : engine(config, context, capabilities_of()) {}

sharded_engine::~sharded_engine() { close(); }

std::unique_ptr<refit::init_info> sharded_engine::parse_init_info(const json& j) const {
  json_reader r(j, "ucx_sharded init_info");
  auto info = std::make_unique<sharded_init_info>(sharded_init_info::read(r));
  r.finish();
  return info;
}

std::unique_ptr<refit::update_info> sharded_engine::parse_update_info(const json& j) const {
  return backend::read_sharded_update_info(j, "ucx_sharded", worker_, workers_, trainers_, layouts_);
}

json sharded_engine::transport_info() const {
  if (sockets_.empty() || reports_.empty()) return nullptr;
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
  return {{"worker", worker_},
          {"transports", std::move(transports)},
          {"mode", mode},
          {"peer_failure_handling", peer},
          {"trainer_ranks", std::move(ranks)}};
}

asio::awaitable<void> sharded_engine::do_init(const refit::init_info& base) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  close();
  timeout_ = info.timeout.value_or(config().timeout);
  wire_ = info.wire;
  workers_ = info.workers;
  trainers_ = static_cast<int>(info.trainers.size());
  worker_ = info.worker_number(context().ranks.tp_rank, "ucx_sharded");
  put_into_model_ = info.put_into_model;
  // UCX's context (it loads its transport modules) is made once, off the loop.
  if (!ucp_) ucp_ = co_await async::offload(processing_executor(), [] { return std::make_shared<ucx::context>(); });
  auto w = ucx::worker::create(ucp_, context().executor);
  ucx::worker::engaged progressing(w);
  std::vector<socket_ptr> sockets(info.trainers.size());
  std::vector<endpoint_report> reports(info.trainers.size());
  std::vector<asio::awaitable<void>> joins;
  for (std::size_t r = 0; r < info.trainers.size(); ++r)
    joins.push_back([](sharded_engine* self, socket_ptr* out, endpoint_report* report, std::shared_ptr<ucx::worker> w,
                       backend::rank_endpoint e, int rank, const std::vector<std::string>* required,
                       std::optional<bool> asked) -> asio::awaitable<void> {
      const std::string to = "trainer rank " + std::to_string(rank);
      auto j = co_await links::join(e.address, e.port, self->worker_ + 1, self->wire_, self->config().auth_secret,
                                    self->timeout_, self->who() + ": " + to);
      *out = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
      // No regions yet: the tensors are registered per update (puts), or each frame
      // comes as a tagged message. The report's mode says which.
      auto choose = [asked](endpoint_report& rep) {
        if (!puts_into_model(rep, asked)) rep.mode = "tag";
      };
      *report = co_await offer_and_agree(**out, *w, {}, *required, choose, self->timeout_, self->who(), to);
    }(this, &sockets[r], &reports[r], w, info.trainers[r], static_cast<int>(r), &info.require_transports,
                                                  info.put_into_model));
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(joins));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    for (auto& s : sockets)
      if (s) net::close(*s);
    w->close();
    std::rethrow_exception(failure);
  }
  worker_ucx_ = std::move(w);
  sockets_ = std::move(sockets);
  reports_ = std::move(reports);
  last_seq_.assign(sockets_.size(), 0);
}

asio::awaitable<void> sharded_engine::do_receive(const refit::update_info& base, load_weights_fn load_weights) {
  const auto& info = downcast<backend::sharded_update_info>(base, "update_info");
  if (sockets_.empty() || !worker_ucx_)
    throw_error(errc::invalid_state, who() +
                                         ": the connections to the trainer ranks were closed by an earlier "
                                         "failure; call init_transfer_engine again");
  const auto start = clock_type::now();
  auto layouts = info.layouts;
  const auto& plan = *layouts->plan;
  const auto& dest = layouts->workers.at(worker_);
  if (plan.ranks != static_cast<int>(sockets_.size()))
    throw_error(errc::invalid_argument, who() + ": the layout's mesh has " + std::to_string(plan.ranks) +
                                            " trainer ranks, this worker connected to " +
                                            std::to_string(sockets_.size()));
  model_target* target = receive_target();
  const bool staged = info.commit.value_or(config().commit) == commit_mode::staged;
  auto placed =
      co_await backend::place_destination(dest, target, context().model, staged, fallback_, processing_executor());
  const std::vector<std::byte*>& bases = placed.bases;
  direct_target_ = placed.direct ? target : nullptr;

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
      // Every rank hears why now rather than at its deadline.
      for (std::size_t r = 0; r < sockets_.size(); ++r) {
        try {
          co_await links::tell_failure(*sockets_[r], failure, last_seq_[r]);
        } catch (...) {
        }
      }
      close();
      std::rethrow_exception(failure);
    }
    last_put_regions_ = registry->size();
  }
  // Every pair at once on the one UCX worker (the first failure cancels the others
  // and tells every rank).
  std::vector<std::uint64_t> wire_bytes(sockets_.size(), 0);
  std::vector<asio::awaitable<void>> pairs;
  for (std::size_t r = 0; r < sockets_.size(); ++r)
    pairs.push_back(receive_pair(sockets_[r], w, static_cast<int>(r), layouts, bases, &wire_bytes[r],
                                 reports_[r].mode == "put" ? registry.get() : nullptr));
  std::exception_ptr failure;
  try {
    co_await backend::run_pairs(std::move(pairs), sockets_, last_seq_);
  } catch (...) {
    failure = std::current_exception();
  }
  // Every put completed (each done came after its flush) or the update failed.
  if (registry) co_await registrar_->close(std::move(registry));
  if (failure) {
    close();
    std::rethrow_exception(failure);
  }
  auto& stats = mutable_stats();
  stats.wire_bytes = 0;
  for (auto b : wire_bytes) stats.wire_bytes += b;
  co_await backend::load_sharded(dest, plan.ingress[worker_], bases, load_weights, processing_executor(), stats, start);
}

asio::awaitable<void> sharded_engine::receive_pair(socket_ptr socket, std::shared_ptr<ucx::worker> w, int rank,
                                                   std::shared_ptr<const backend::sharded_layouts> layouts,
                                                   std::vector<std::byte*> bases, std::uint64_t* wire_bytes,
                                                   update_registry* registry) {
  namespace lw = links::wire;
  const std::string me = who() + ": trainer rank " + std::to_string(rank);
  const auto& plan = *layouts->plan;
  const auto& pair = plan.pair(rank, worker_);
  const auto& dest = layouts->workers[worker_];
  const std::uint64_t digest = backend::pair_digest(plan.digest, rank, worker_);
  // The pair's runs over this worker's tensors, made off the loop (a row-parallel
  // shard is one run per row).
  std::vector<stream_frame> frames;
  {
    auto* f = &frames;
    auto* b = &bases;
    auto* d = &dest;
    auto* items = &pair.items;
    const std::uint64_t frame_bytes = wire_.buffer_bytes;
    co_await async::offload(processing_executor(), [f, b, d, items, frame_bytes] {
      const auto runs = pair_runs(*items, item_side::destination, [&](const transfer_item& it) {
        const auto& spec = d->tensors[it.dest].spec;
        return tensor_place{(*b)[it.dest], spec.shape, element_size(spec.dtype)};
      });
      *f = cut_frames(runs, frame_bytes);
    });
  }
  // The pair's header: its plan digest (a layout that differs between the sides is
  // named as such) and its size; a refusal goes back before any byte.
  std::uint64_t seq = 0;
  {
    std::array<std::byte, sizeof(lw::update)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout_, me + ": waiting for the update header");
    const auto u = lw::decode<lw::update>(raw);
    if (auto bad = lw::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, me + ": " + bad);
    std::string refusal =
        u.flags != 0 ? "update flags " + std::to_string(u.flags) +
                           " (deltas, or a newer refit): ucx_sharded takes plain updates only"
                     : backend::pair_header_refusal(u, last_seq_[rank], digest, plan.digest, pair, frames.size());
    if (!refusal.empty()) {
      co_await links::send_status(*socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, refusal, timeout_,
                                  me + ": refusing the update");
      throw_error(errc::protocol_error, me + ": " + refusal);
    }
    co_await links::send_status(*socket, 0, u.seq, {}, timeout_, me + ": accepting the update");
    last_seq_[rank] = u.seq;
    seq = u.seq;
  }
  if (auto* t = std::exchange(direct_target_, nullptr)) t->direct_write_begins();
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
    co_await net::write_all(*socket, grant, timeout_, what + ": granting its destination");
    const std::uint64_t expected = co_await read_done(*socket, k, wire_.checksums, timeout_, what);
    if (posted) co_await posted->wait(timeout_);
    *wire_bytes += frames[k].bytes;
    if (!wire_.checksums) continue;
    // Verified where the bytes landed, on the processing executor.
    auto* b = &dest_buffers;
    const std::uint64_t got = co_await async::offload(
        processing_executor(), [b] { return checksum(std::span<const asio::mutable_buffer>(*b)); });
    if (got != expected)
      throw_error(errc::integrity_error,
                  what + ": payload checksum " + to_hex(got) + " differs from the trainer's " + to_hex(expected));
  }
  co_await links::confirm_update(*socket, seq, timeout_, me);
}

void sharded_engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  // Every trainer rank is told at once, so its send fails now naming the reason.
  try {
    for (std::size_t r = 0; r < sockets_.size(); ++r)
      asio::co_spawn(context().executor,
                     links::refuse_update(sockets_[r], last_seq_[r] + 1, kind, reason,
                                          std::min(timeout_, std::chrono::milliseconds(2000)), who()),
                     asio::detached);
  } catch (...) {
  }
  sockets_.clear();
  if (worker_ucx_) {
    worker_ucx_->close();
    worker_ucx_.reset();
  }
}

void sharded_engine::close() noexcept {
  for (auto& s : sockets_)
    if (s) net::close(*s);
  sockets_.clear();
  reports_.clear();
  if (worker_ucx_) {
    worker_ucx_->close();
    worker_ucx_.reset();
  }
}

// ---------------------------------------------------------------- trainer rank

sharded_sender::sharded_sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sharded_sender::~sharded_sender() {
  shutdown();
  if (pool_) pool_->join();
}

json sharded_sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "ucx_sharded trainer_args");
  auto args = backend::sharded_trainer_args::read(r, config_.timeout);
  r.finish();
  shutdown();
  args_ = std::move(args);
  if (!pool_) pool_ = std::make_unique<asio::thread_pool>(1);
  const auto& self = args_.trainers[args_.rank];
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, self.address, self.port));
  return args_.worker_init_info(acceptor_->local_endpoint().port());
}

asio::awaitable<void> sharded_sender::connect_workers() {
  const std::string who = "ucx_sharded trainer rank " + std::to_string(args_.rank);
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, who + ": connect_workers before prepare");
  close();
  auto members = co_await links::accept_workers(*acceptor_, context_.executor, config_.auth_secret, args_.timeout,
                                                args_.wire, args_.workers + 1, who);
  if (!ucp_) {
    auto* pool = pool_.get();
    ucp_ = co_await async::offload(pool->get_executor(), [] { return std::make_shared<ucx::context>(); });
  }
  worker_ = worker::create(ucp_, context_.executor);
  worker::engaged progressing(worker_);
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  for (auto& m : members) {
    auto p = std::make_shared<downstream>();
    p->rank = m.rank;
    p->name = who + ": worker " + std::to_string(m.rank - 1);
    p->socket = m.socket;
    peers_.push_back(std::move(p));
  }
  std::vector<asio::awaitable<void>> ops;
  for (auto& p : peers_) ops.push_back(connect_downstream(p, worker_, args_.timeout));
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(ops));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();
    std::rethrow_exception(failure);
  }
  seq_ = 0;
}

json sharded_sender::transport_info() const {
  json out = json::object();
  for (const auto& p : peers_) out[std::to_string(p->rank - 1)] = p->report.to_json();
  return out;
}

void sharded_sender::close() noexcept {
  // Keys and endpoints before their worker (downstream::close), then the worker.
  for (auto& p : peers_) p->close();
  peers_.clear();
  if (worker_) {
    worker_->close();
    worker_.reset();
  }
}

void sharded_sender::shutdown() {
  close();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

asio::awaitable<void> sharded_sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const std::string who = "ucx_sharded trainer rank " + std::to_string(args_.rank);
  if (peers_.empty() || !worker_)
    throw_error(errc::invalid_state, who + ": send_weights before init (or after a failed update; call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  // Planned once per layout (a cache hit costs a digest of the spec and metadata),
  // on the pool, not the loop.
  const int rank = args_.rank, workers = args_.workers;
  const auto layouts = co_await backend::plan_for_rank(pool_->get_executor(), layouts_, declared, args_.layout,
                                                       static_cast<int>(args_.trainers.size()), workers, who);
  const auto& plan = *layouts->plan;
  // This rank's shards, each checked against what its placement gives it, before
  // any byte leaves.
  const update_metadata local = layouts->source.local_metadata(rank);
  const std::vector<std::byte*> bases = backend::local_shards(source, local, who);
  const std::uint64_t seq = ++seq_;
  // Each pair's frames over the shards, and (checksums on) each frame's checksum,
  // made on the pool.
  std::vector<std::vector<stream_frame>> frames(workers);
  std::vector<std::vector<std::uint64_t>> sums(workers);
  {
    auto* f = &frames;
    auto* sm = &sums;
    auto* b = &bases;
    auto* l = &local;
    auto* p = &plan;
    const std::uint64_t frame_bytes = args_.wire.buffer_bytes;
    const bool checksums = args_.wire.checksums;
    co_await async::offload(pool_->get_executor(), [f, sm, b, l, p, frame_bytes, checksums, rank] {
      for (std::size_t w = 0; w < f->size(); ++w) {
        const auto runs =
            pair_runs(p->pair(rank, static_cast<int>(w)).items, item_side::source, [&](const transfer_item& it) {
              const auto& spec = l->tensors[it.source];
              return tensor_place{(*b)[it.source], spec.shape, element_size(spec.dtype)};
            });
        (*f)[w] = cut_frames(runs, frame_bytes);
        if (!checksums) continue;
        for (const auto& frame : (*f)[w]) {
          const auto buffers = buffers_of<asio::const_buffer>(frame);
          (*sm)[w].push_back(checksum(std::span<const asio::const_buffer>(buffers)));
        }
      }
    });
  }
  sent_.assign(workers, 0);
  for (auto& p : peers_) p->forget_update_regions();  // each update's grants bring the keys of its regions
  auto w = worker_;
  ucx::worker::engaged progressing(w);
  std::vector<asio::awaitable<void>> streams;
  for (int k = 0; k < workers; ++k) {
    const auto& pair = plan.pair(rank, k);
    sent_[k] = pair.bytes;
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
    streams.push_back(with_peer_reason(stream(w, p, header, &frames[k], &sums[k], seq, args_.timeout), p));
  }
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(streams));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();  // the workers fail at once; init again before the next update
    std::rethrow_exception(failure);
  }
  stats_.bytes = plan.egress[rank];
  stats_.tensors = local.tensors.size();
  stats_.wall_s = since(start);
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

}  // namespace refit::ucx
