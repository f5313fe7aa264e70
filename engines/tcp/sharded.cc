// Sharded TCP: the worker side (connects to every trainer rank, receives each
// pair's frames straight into its tensors) and one trainer rank's sender.
#include <refit/engines/tcp/sharded.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/delta.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/shard_io.h>
#include <refit/internal/hex.h>
#include <refit/json_reader.h>

namespace refit::tcp {

namespace wire = links::wire;

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

std::vector<asio::mutable_buffer> mutable_buffers(const stream_frame& f) {
  std::vector<asio::mutable_buffer> out;
  out.reserve(f.runs.size());
  for (const auto& r : f.runs) out.emplace_back(r.data, r.bytes);
  return out;
}

// The element size a pair's frames are delta-encoded with: its items' dtype size
// when they all share one, else 1 (both sides compute it from the global metadata).
std::size_t pair_element_size(const sharded_layouts& l, const pair_plan& pair) {
  std::size_t elem = 0;
  for (const auto& it : pair.items) {
    const std::size_t e = element_size(l.global.tensors.at(it.source).dtype);
    if (elem != 0 && e != elem) return 1;
    elem = e;
  }
  return elem == 0 ? 1 : elem;
}

std::vector<asio::const_buffer> const_buffers(const stream_frame& f) {
  std::vector<asio::const_buffer> out;
  out.reserve(f.runs.size());
  for (const auto& r : f.runs) out.emplace_back(r.data, r.bytes);
  return out;
}

// Copies a frame's runs into `out` (f.bytes of room), in order.
void gather(const stream_frame& f, std::byte* out) {
  for (const auto& r : f.runs) {
    std::memcpy(out, r.data, r.bytes);
    out += r.bytes;
  }
}

// The delta fingerprint of a pair's bytes as they are now in `frames`.
std::uint64_t frames_fingerprint(std::uint64_t digest, const std::vector<stream_frame>& frames) {
  std::vector<std::uint64_t> hashes;
  hashes.reserve(frames.size());
  for (const auto& f : frames) hashes.push_back(checksum(std::span<const asio::const_buffer>(const_buffers(f))));
  return delta_fingerprint(digest, hashes);
}

}  // namespace

sharded_init_info sharded_init_info::read(json_reader& r) {
  sharded_init_info info;
  static_cast<backend::sharded_join_info&>(info) = backend::sharded_join_info::read(r);
  return info;
}

// ---------------------------------------------------------------- worker

sharded_engine::sharded_engine(const weight_transfer_config& config, const engine_context& context)
    : engine(config, context, capabilities_of()) {}

sharded_engine::~sharded_engine() { do_shutdown(); }

std::unique_ptr<refit::init_info> sharded_engine::parse_init_info(const json& j) const {
  json_reader r(j, "tcp_sharded init_info");
  auto info = std::make_unique<sharded_init_info>(sharded_init_info::read(r));
  r.finish();
  return info;
}

std::unique_ptr<refit::update_info> sharded_engine::parse_update_info(const json& j) const {
  return backend::read_sharded_update_info(j, "tcp_sharded", worker_, workers_, trainers_, layouts_);
}

asio::awaitable<void> sharded_engine::do_init(const refit::init_info& base) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  do_shutdown();
  timeout_ = info.timeout.value_or(config().timeout);
  wire_ = info.wire;
  workers_ = info.workers;
  trainers_ = static_cast<int>(info.trainers.size());
  worker_ = info.worker_number(context().ranks.tp_rank, "tcp_sharded");
  std::vector<socket_ptr> sockets(info.trainers.size());
  std::vector<asio::awaitable<void>> joins;
  for (std::size_t r = 0; r < info.trainers.size(); ++r)
    joins.push_back([](socket_ptr* out, backend::rank_endpoint e, int rank, wire_params wire, std::string secret,
                       std::chrono::milliseconds timeout, std::string who,
                       std::size_t buffers) -> asio::awaitable<void> {
      auto j = co_await links::join(e.address, e.port, rank, wire, std::move(secret), timeout, who);
      *out = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
      net::set_buffers(**out, buffers);
    }(&sockets[r], info.trainers[r], worker_ + 1, wire_, config().auth_secret, timeout_,
                                            who() + ": trainer rank " + std::to_string(r),
                                            config().socket_buffer_bytes));
  try {
    co_await async::all_of(std::move(joins));
  } catch (...) {
    for (auto& s : sockets)
      if (s) net::close(*s);
    throw;
  }
  sockets_ = std::move(sockets);
  last_seq_.assign(sockets_.size(), 0);
}

asio::awaitable<void> sharded_engine::do_receive(const refit::update_info& base, load_weights_fn load_weights) {
  const auto& info = downcast<backend::sharded_update_info>(base, "update_info");
  if (sockets_.empty())
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
  // Where each tensor lands: the model's own memory where it offers host memory,
  // else the engine's fallback area (load_weights then copies from it).
  model_target* target = receive_target();
  const bool staged = info.commit.value_or(config().commit) == commit_mode::staged;
  // Which version each pair holds is known only until this update changes it.
  held_.resize(sockets_.size());
  std::vector<std::optional<held_version>> held;
  for (auto& h : held_) held.push_back(h.take());
  auto placed =
      co_await backend::place_destination(dest, target, context().model, staged, fallback_, processing_executor());
  auto current = placed.current;
  const std::vector<std::byte*>& bases = placed.bases;
  // Told once the first pair's header is accepted: from then on bytes land in it.
  direct_target_ = placed.direct ? target : nullptr;

  // Every pair at once (the first failure cancels the others and tells every rank).
  std::vector<pair_state> states(sockets_.size());
  for (std::size_t r = 0; r < sockets_.size(); ++r) states[r] = {held[r], current, staged, std::nullopt, 0};
  std::vector<asio::awaitable<void>> pairs;
  for (std::size_t r = 0; r < sockets_.size(); ++r)
    pairs.push_back(receive_pair(sockets_[r], static_cast<int>(r), layouts, bases, &states[r]));
  std::exception_ptr failure;
  try {
    co_await backend::run_pairs(std::move(pairs), sockets_, last_seq_);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    do_shutdown();
    std::rethrow_exception(failure);
  }
  auto& stats = mutable_stats();
  stats.wire_bytes = 0;
  for (const auto& st : states) stats.wire_bytes += st.wire_bytes;
  co_await backend::load_sharded(dest, plan.ingress[worker_], bases, load_weights, processing_executor(), stats, start);
  // The pairs from ranks with deltas on now hold those ranks' versions (each
  // fingerprint hashes the bytes that arrived). A chunk staged in an open update
  // session holds them once the session commits.
  for (std::size_t r = 0; r < states.size(); ++r)
    if (const auto& now = states[r].now) held_[r].record(*now, receiving_into_open_session(), held[r]);
}

void sharded_engine::do_session_committed() {
  for (auto& h : held_) h.committed();
}

void sharded_engine::do_session_finished() {
  for (auto& h : held_) h.finished(weights_dirty());
}

std::string sharded_engine::base_refusal(const wire::delta_header& d, const pair_state& st,
                                         const sharded_layouts& layouts, int rank) const {
  const auto hex = [](std::uint64_t v) { return to_hex(v); };
  if (!st.held)
    return "this worker does not know which version its weights hold of trainer rank " + std::to_string(rank) +
           "'s bytes (no complete update from it with deltas on since this worker started, or the last one failed "
           "or was staged in a session)";
  if (st.held->version != d.base_version || st.held->fingerprint != d.base_fingerprint)
    return "this worker holds version " + std::to_string(st.held->version) + " (fingerprint " +
           hex(st.held->fingerprint) + ") of trainer rank " + std::to_string(rank) +
           "'s bytes, the deltas are against version " + std::to_string(d.base_version) + " (fingerprint " +
           hex(d.base_fingerprint) + ")";
  if (weights_dirty()) return "this worker's weights are dirty: " + dirty_reason();
  const auto& dest = layouts.workers.at(worker_);
  for (const auto& it : layouts.plan->pair(rank, worker_).items)
    if (it.bytes > 0 && (*st.current).at(it.dest) == nullptr)
      return "the model offers no host memory holding '" + dest.tensors.at(it.dest).spec.name +
             "' to decode a delta against (deltas need a model target with destination())";
  return {};
}

asio::awaitable<void> sharded_engine::receive_pair(socket_ptr socket, int rank,
                                                   std::shared_ptr<const sharded_layouts> layouts,
                                                   std::vector<std::byte*> bases, pair_state* state) {
  const std::string me = who() + ": trainer rank " + std::to_string(rank);
  const auto& plan = *layouts->plan;
  const auto& pair = plan.pair(rank, worker_);
  const auto& dest = layouts->workers[worker_];
  const std::uint64_t frame_bytes = wire_.buffer_bytes;
  const std::uint64_t digest = backend::pair_digest(plan.digest, rank, worker_);
  // The pair's runs over this worker's tensors, made off the loop (a row-parallel
  // shard is one run per row).
  const auto frames_over = [d = &dest, items = &pair.items, frame_bytes](const std::vector<std::byte*>& at) {
    const auto runs = pair_runs(*items, item_side::destination, [&](const transfer_item& it) {
      const auto& spec = d->tensors[it.dest].spec;
      return tensor_place{at[it.dest], spec.shape, element_size(spec.dtype)};
    });
    return cut_frames(runs, frame_bytes);
  };
  std::vector<stream_frame> frames;
  {
    auto* f = &frames;
    auto* b = &bases;
    co_await async::offload(processing_executor(), [f, b, &frames_over] { *f = frames_over(*b); });
  }
  // The pair's header: its plan digest first (a layout that differs between the
  // sides is named as such), then its size; with deltas on, the delta header; a
  // refusal is sent back before any byte.
  std::optional<wire::delta_header> delta;
  std::uint64_t seq = 0;
  {
    std::array<std::byte, sizeof(wire::update)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout_, me + ": waiting for the update header");
    const auto u = wire::decode<wire::update>(raw);
    if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, me + ": " + bad);
    std::string refusal;
    if ((u.flags & wire::update_flag_delta) != 0) {
      std::array<std::byte, sizeof(wire::delta_header)> raw_delta;
      co_await net::read_exact(*socket, asio::buffer(raw_delta), timeout_, me + ": reading the delta header");
      delta = wire::decode<wire::delta_header>(raw_delta);
      refusal = wire::check_delta_header(*delta);
    }
    if (!refusal.empty()) {
      // (the delta header is malformed)
    } else if ((u.flags & ~wire::update_flag_delta) != 0) {
      refusal = "unknown update flags " + std::to_string(u.flags);
    } else {
      refusal = backend::pair_header_refusal(u, last_seq_[rank], digest, plan.digest, pair, frames.size());
    }
    if (!refusal.empty()) {
      co_await links::send_status(*socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, refusal, timeout_,
                                  me + ": refusing the update");
      throw_error(errc::protocol_error, me + ": " + refusal);
    }
    co_await links::send_status(*socket, 0, u.seq, {}, timeout_, me + ": accepting the update");
    last_seq_[rank] = u.seq;
    seq = u.seq;
  }
  // Offered deltas: this worker says whether it holds the base (then frames may
  // arrive encoded) or not (then every frame comes full), before any byte changes.
  // The recorded version is not enough: the tensors' bytes are hashed (off the
  // loop), so bytes written outside refit since get the pair full.
  bool accepted = false;
  std::vector<stream_frame> base_frames;  // staged: the current bytes' frames (else `frames`)
  if (delta && (delta->flags & wire::delta_flag_has_base) != 0) {
    std::string why_full = base_refusal(*delta, *state, *layouts, rank);
    if (why_full.empty()) {
      const std::vector<stream_frame>* over = &frames;
      if (state->staged) {
        std::vector<std::byte*> at(state->current->size());
        for (std::size_t i = 0; i < at.size(); ++i) at[i] = const_cast<std::byte*>((*state->current)[i]);
        auto* bf = &base_frames;
        co_await async::offload(processing_executor(), [bf, &at, &frames_over] { *bf = frames_over(at); });
        over = &base_frames;
      }
      const std::uint64_t now =
          co_await async::offload(processing_executor(), [over, digest] { return frames_fingerprint(digest, *over); });
      if (now != delta->base_fingerprint)
        why_full = "this worker's tensors no longer hold version " + std::to_string(delta->base_version) +
                   " of trainer rank " + std::to_string(rank) + "'s bytes (their fingerprint is " + to_hex(now) +
                   ", the base's " + to_hex(delta->base_fingerprint) + "): written outside refit since that update";
    }
    accepted = why_full.empty();
    co_await links::send_status(*socket, accepted ? 0 : static_cast<std::uint32_t>(errc::invalid_state), seq, why_full,
                                timeout_, me + ": answering the delta offer");
  }
  if (auto* t = std::exchange(direct_target_, nullptr)) t->direct_write_begins();
  const std::size_t elem = pair_element_size(*layouts, pair);
  std::vector<std::uint64_t> hashes(frames.size(), 0);
  std::vector<std::byte> encoded, scratch;
  for (std::size_t k = 0; k < frames.size(); ++k) {
    const std::string what = me + ": frame " + std::to_string(k);
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout_, what + " header");
    const auto h = wire::decode<wire::bucket_header>(raw);
    const std::string bad = delta ? wire::check_delta_bucket_header(h, k, frames[k].bytes, wire_.checksums, accepted)
                                  : wire::check_bucket_header(h, k, frames[k].bytes, wire_.checksums);
    if (!bad.empty()) throw_error(errc::protocol_error, what + ": " + bad);
    auto buffers = mutable_buffers(frames[k]);
    const bool is_delta = (h.flags & wire::flag_delta) != 0;
    // At most a loop's budget of bytes per system call: the loop is shared.
    if (is_delta) {
      encoded.resize(h.payload_bytes);
      co_await net::read_exact(*socket, asio::buffer(encoded), timeout_, what, net::loop_bytes_per_call);
    } else {
      co_await net::read_exact(*socket, buffers, timeout_, what, net::loop_bytes_per_call);
    }
    state->wire_bytes += h.payload_bytes;
    if (!is_delta && !wire_.checksums && !delta) continue;
    // Decoded (a delta frame) and hashed on the processing executor: the checksum
    // covers the decoded bytes, and with deltas on every frame's hash is a part
    // of the fingerprint of the version this worker then holds.
    const stream_frame* out = &frames[k];
    const stream_frame* base = state->staged && !base_frames.empty() ? &base_frames[k] : out;
    const std::uint64_t at = k * frame_bytes;
    auto* b = &buffers;
    auto* e = &encoded;
    auto* sc = &scratch;
    const auto* named = &what;
    // (Only trivially destructible captures: GCC 12 destroys some temporaries of a
    // co_await expression twice.)
    const std::uint64_t got = co_await async::offload(processing_executor(), [=] {
      if (is_delta) {
        const std::size_t piece = backend::delta::piece_elem(elem, at, out->bytes);
        try {
          if (out->runs.size() == 1 && base->runs.size() == 1) {
            const backend::delta::piece_out p{std::span<const std::byte>(base->runs[0].data, base->bytes),
                                              std::span<std::byte>(out->runs[0].data, out->bytes), piece};
            backend::delta::decode_pieces(*e, std::span(&p, 1));
          } else {
            // Runs of several rows: decoded in one contiguous copy of the frame.
            sc->resize(out->bytes);
            gather(*base, sc->data());
            const backend::delta::piece_out p{std::span<const std::byte>(sc->data(), sc->size()),
                                              std::span<std::byte>(sc->data(), sc->size()), piece};
            backend::delta::decode_pieces(*e, std::span(&p, 1));
            const std::byte* from = sc->data();
            for (const auto& r : out->runs) {
              std::memcpy(r.data, from, r.bytes);
              from += r.bytes;
            }
          }
        } catch (const error& err) {
          throw_error(err.kind(), *named + ": " + err.message());
        }
      }
      return checksum(std::span<const asio::mutable_buffer>(*b));
    });
    if (wire_.checksums && got != h.checksum)
      throw_error(errc::integrity_error, what + ": payload checksum " + to_hex(got) + " differs from the trainer's " +
                                             to_hex(h.checksum) +
                                             (is_delta ? " after decoding its delta (corrupted in transit, or this "
                                                         "worker's tensors did not hold the base)"
                                                       : ""));
    hashes[k] = got;
  }
  co_await links::confirm_update(*socket, last_seq_[rank], timeout_, me);
  if (delta) state->now = held_version{delta->version, delta_fingerprint(digest, hashes)};
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
}

void sharded_engine::do_shutdown() {
  for (auto& s : sockets_)
    if (s) net::close(*s);
  sockets_.clear();
}

// ---------------------------------------------------------------- trainer rank

sharded_sender::sharded_sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sharded_sender::~sharded_sender() {
  shutdown();
  if (io_pool_) io_pool_->join();
}

json sharded_sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "tcp_sharded trainer_args");
  const auto args = backend::sharded_trainer_args::read(r, config_.timeout);
  const bool delta = r.optional<bool>("delta", false);
  const std::uint64_t delta_max = backend::read_delta_max_bytes(r);
  r.finish();
  shutdown();
  rank_ = args.rank;
  ranks_ = static_cast<int>(args.trainers.size());
  workers_ = args.workers;
  layout_spec_ = args.layout;
  wire_ = args.wire;
  timeout_ = args.timeout;
  delta_ = delta;
  delta_max_ = delta_max;
  if (!delta_) bases_.clear();  // no snapshot held without deltas
  if (!io_pool_) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    io_pool_ = std::make_unique<asio::thread_pool>(std::min<unsigned>(cores, static_cast<unsigned>(workers_)));
  }
  const auto& self = args.trainers[args.rank];
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, self.address, self.port));
  json info = args.worker_init_info(acceptor_->local_endpoint().port());
  init_info_ = info;
  return info;
}

asio::awaitable<void> sharded_sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "tcp_sharded trainer: connect_workers before prepare");
  fail_all();
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_);
  auto members = co_await links::accept_workers(*acceptor_, context_.executor, config_.auth_secret, timeout_, wire_,
                                                workers_ + 1, who);
  peers_.clear();
  for (auto& m : members) {
    auto strand = asio::make_strand(io_pool_->get_executor());
    const auto protocol = m.socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, m.socket->release());
    net::set_buffers(moved, config_.socket_buffer_bytes);
    peers_.push_back(std::make_shared<peer>(peer{m.rank - 1, strand, std::move(moved)}));
  }
  std::sort(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) { return a->worker < b->worker; });
  seq_ = 0;
}

void sharded_sender::fail_all() {
  for (auto& p : peers_) asio::post(p->strand, [p] { net::close(p->socket); });
  peers_.clear();
}

void sharded_sender::shutdown() {
  fail_all();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

asio::awaitable<void> sharded_sender::send_weights(const update_metadata& declared, tensor_source& source) {
  // set_next_send's choice holds for this send only, whatever becomes of it.
  const bool allow_base = std::exchange(next_delta_, std::nullopt).value_or(true);
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_);
  if (peers_.empty())
    throw_error(errc::invalid_state, who + ": send_weights before init (or after a failed update; call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  plan_s_ = 0;
  // Planned once per layout; a cache hit costs a digest of the spec and metadata.
  const auto plan_start = clock_type::now();
  const auto layouts = co_await backend::plan_for_rank(io_pool_->get_executor(), layouts_, declared, layout_spec_,
                                                       ranks_, workers_, who);
  plan_s_ = since(plan_start);
  const auto& plan = *layouts->plan;
  // This rank's shards, each checked against what its placement gives it, before
  // any byte leaves.
  const update_metadata local = layouts->source.local_metadata(rank_);
  const std::vector<std::byte*> bases = backend::local_shards(source, local, who);
  const std::uint64_t seq = ++seq_;
  sent_.assign(workers_, 0);
  // Deltas on: number this version; each pair whose snapshot holds the last
  // version of that same pair is offered deltas against it.
  delta_stats_ = {};
  // The snapshots hold this rank's egress: beyond the bound the update goes plain.
  const bool deltas = delta_ && (delta_max_ == 0 || plan.egress[rank_] <= delta_max_);
  if (delta_ && !deltas) {
    bases_.clear();
    delta_stats_.over_bound = true;
    delta_stats_.full_bytes = plan.egress[rank_];
  }
  if (deltas) {
    ++version_;
    delta_stats_.version = version_;
    delta_stats_.full_bytes = plan.egress[rank_];
    bases_.resize(workers_);
  }
  std::vector<asio::awaitable<void>> streams;
  for (int w = 0; w < workers_; ++w) {
    const auto& pair = plan.pair(rank_, w);
    auto runs = pair_runs(pair.items, item_side::source, [&](const transfer_item& it) {
      const auto& spec = local.tensors[it.source];
      return tensor_place{bases[it.source], spec.shape, element_size(spec.dtype)};
    });
    auto frames = std::make_shared<const std::vector<stream_frame>>(cut_frames(runs, wire_.buffer_bytes));
    const std::uint64_t digest = backend::pair_digest(plan.digest, rank_, w);
    auto header = links::update_header(seq, pair.items.size(), digest, frames->size(), pair.bytes);
    std::optional<pair_delta> delta;
    if (deltas) {
      pair_base& b = bases_[w];
      wire::update u = wire::decode<wire::update>(header);
      u.flags |= wire::update_flag_delta;
      header = wire::encode(u);
      wire::delta_header d;
      d.version = version_;
      delta.emplace();
      delta->offers_base = b.valid && b.digest == digest && b.size == pair.bytes && allow_base;
      if (delta->offers_base) {
        d.flags = wire::delta_flag_has_base;
        d.base_version = b.version;
        d.base_fingerprint = b.fingerprint;
        delta_stats_.base_version = b.version;
      }
      delta->header = wire::encode(d);
      delta->base = &b;
      delta->elem = pair_element_size(*layouts, pair);
      b.valid = false;  // a mix of two versions until this send completes
      b.digest = digest;
      b.size = pair.bytes;
      b.version = version_;
    }
    sent_[w] = pair.bytes;
    auto p = peers_.at(w);
    streams.push_back(
        asio::co_spawn(p->strand, stream_to(p, header, std::move(frames), seq, std::move(delta)), asio::use_awaitable));
  }
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(streams));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    fail_all();  // the workers fail at once; init again before the next update
    std::rethrow_exception(failure);
  }
  if (deltas) {
    // Every worker confirmed: each snapshot is this version's bytes of its pair,
    // the next update's base.
    for (int w = 0; w < workers_; ++w) {
      auto& b = bases_[w];
      const auto& p = *peers_[w];
      b.valid = true;
      b.fingerprint = delta_fingerprint(b.digest, p.hashes);
      auto& d = delta_stats_;
      d.delta_workers += p.took_delta ? 1 : 0;
      d.full_fallbacks += p.fell_back ? 1 : 0;
      d.encoded_buckets += p.encoded_frames;
      d.delta_bytes += p.delta_bytes;
      d.encoded_full += p.encoded_full;
      d.encode_s += p.encode_s;
      d.snapshot_bytes += b.capacity;
    }
  }
  stats_.bytes = plan.egress[rank_];
  stats_.tensors = local.tensors.size();
  stats_.wall_s = since(start);
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

asio::awaitable<void> sharded_sender::stream_to(std::shared_ptr<peer> p, std::array<std::byte, 48> header,
                                                std::shared_ptr<const std::vector<stream_frame>> frames,
                                                std::uint64_t seq, std::optional<pair_delta> delta) {
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_) + ": worker " + std::to_string(p->worker);
  p->took_delta = p->fell_back = false;
  p->encoded_frames = p->delta_bytes = p->encoded_full = 0;
  p->encode_s = 0;
  std::exception_ptr failure;
  try {
    bool deltas = false;
    if (!delta) {
      co_await links::announce_update(p->socket, header, timeout_, who);
    } else {
      // The update header and its delta header, then the worker's answers: it
      // accepts the update, then (when offered deltas) says whether it holds the base.
      std::vector<asio::const_buffer> headers{asio::buffer(header), asio::buffer(delta->header)};
      co_await net::write_all(p->socket, headers, timeout_, who + ": update header");
      links::throw_if_failed(
          co_await links::read_status(p->socket, timeout_,
                                      who + ": waiting for the worker to accept update " + std::to_string(seq)),
          who + " refused the update");
      if (delta->offers_base) {
        const auto answer =
            co_await links::read_status(p->socket, timeout_, who + ": waiting for its answer to the delta offer");
        if (answer.code == static_cast<std::uint32_t>(errc::invalid_state)) {
          p->fell_back = true;  // it does not hold the base: this update goes to it full
        } else {
          links::throw_if_failed(answer, who + " refused the delta offer");
          deltas = true;
          p->took_delta = true;
        }
      }
      // The snapshot grows here, on this I/O thread (its bytes are kept only when
      // they are this update's base, whose size is the same).
      pair_base& b = *delta->base;
      const std::uint64_t need = std::max<std::uint64_t>(b.size, 1);
      if (b.capacity < need) {
        b.bytes.reset();
        b.capacity = 0;
        b.bytes = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(need));
        b.capacity = need;
      }
      p->hashes.assign(frames->size(), 0);
    }
    std::vector<asio::const_buffer> buffers;
    std::vector<std::byte> next, encoded;
    std::uint64_t at = 0;  // the frame's place in the pair's stream
    for (std::size_t k = 0; k < frames->size(); at += (*frames)[k].bytes, ++k) {
      const auto& f = (*frames)[k];
      buffers = const_buffers(f);
      wire::bucket_header h;
      h.index = k;
      h.payload_bytes = f.bytes;
      if (wire_.checksums || delta) {
        const std::uint64_t sum = checksum(std::span<const asio::const_buffer>(buffers));  // on this I/O thread
        if (wire_.checksums) {
          h.flags |= wire::flag_checksum;
          h.checksum = sum;
        }
        if (delta) p->hashes[k] = sum;
      }
      bool encode = false;
      if (delta) {
        // The frame against the snapshot (taking deltas), then the snapshot takes
        // the frame's new bytes.
        std::byte* old = delta->base->bytes.get() + at;
        if (deltas) {
          const auto t0 = clock_type::now();
          const std::byte* now = f.runs.size() == 1 ? f.runs[0].data : nullptr;
          if (!now) {
            next.resize(f.bytes);
            gather(f, next.data());
            now = next.data();
          }
          const backend::delta::piece_in piece{std::span<const std::byte>(old, f.bytes),
                                               std::span<const std::byte>(now, f.bytes),
                                               backend::delta::piece_elem(delta->elem, at, f.bytes)};
          encoded.clear();
          const auto r = backend::delta::encode_pieces(std::span(&piece, 1), encoded);
          encode = r.bytes < f.bytes;  // else full: a delta was not smaller
          if (encode) {
            ++p->encoded_frames;
            p->delta_bytes += r.bytes;
            p->encoded_full += f.bytes;
          }
          std::memcpy(old, now, f.bytes);
          p->encode_s += since(t0);
        } else {
          gather(f, old);
        }
      }
      if (encode) {
        h.flags |= wire::flag_delta;
        h.payload_bytes = encoded.size();
        buffers.assign(1, asio::buffer(encoded));
      }
      const auto raw = wire::encode(h);
      buffers.insert(buffers.begin(), asio::buffer(raw));
      co_await net::write_all(p->socket, buffers, timeout_, who + ": frame " + std::to_string(k));
    }
    co_await links::await_confirmation(p->socket, seq, timeout_, who);
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes: that reason is the error.
  if (failure) co_await links::rethrow_with_peer_reason(p->socket, failure, who);
}

void sharded_sender::set_next_send(const send_options& options) {
  next_delta_ = backend::next_delta_choice(options, delta_, "tcp_sharded trainer rank " + std::to_string(rank_));
}

json sharded_sender::last_send_info() const {
  if (!delta_) return nullptr;
  return delta_send_info(delta_stats_);
}

}  // namespace refit::tcp
