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
#include <refit/backend/hex.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/shard_io.h>
#include <refit/json_reader.h>

namespace refit::tcp {

namespace wire = links::wire;

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

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
  for (const auto& f : frames)
    hashes.push_back(checksum(std::span<const asio::const_buffer>(backend::buffers_of<asio::const_buffer>(f))));
  return delta_fingerprint(digest, hashes);
}

}  // namespace

// ---------------------------------------------------------------- worker

sharded_engine::sharded_engine(const weight_transfer_config& config, const engine_context& context)
    : typed_init(config, context, capabilities_of()) {}

// Each side channel carries its pair's frames.
asio::awaitable<void> sharded_engine::joined_rank(const backend::sharded_init_info&, int,
                                                  asio::ip::tcp::socket& socket) {
  net::set_buffers(socket, config().socket_buffer_bytes);
  co_return;
}

asio::awaitable<std::uint64_t> sharded_engine::receive_pairs(const backend::sharded_update& u) {
  const std::size_t ranks = sockets().size();
  // Which version each pair holds is known only until this update changes it.
  held_.resize(ranks);
  states_.assign(ranks, {});
  for (std::size_t r = 0; r < ranks; ++r) states_[r] = {held_[r].take(), u.placed.current, u.staged, std::nullopt, 0};
  // Every pair at once (the first failure cancels the others and tells every rank).
  std::vector<asio::awaitable<void>> pairs;
  for (std::size_t r = 0; r < ranks; ++r)
    pairs.push_back(receive_pair(sockets()[r], static_cast<int>(r), u.layouts, u.placed.bases, &states_[r]));
  co_await all_pairs(std::move(pairs));
  std::uint64_t wire_bytes = 0;
  for (const auto& st : states_) wire_bytes += st.wire_bytes;
  co_return wire_bytes;
}

// The pairs from ranks with deltas on now hold those ranks' versions (each
// fingerprint hashes the bytes that arrived). A chunk staged in an open update
// session holds them once the session commits.
void sharded_engine::loaded() {
  for (std::size_t r = 0; r < states_.size(); ++r)
    if (const auto& now = states_[r].now) held_[r].record(*now, receiving_into_open_session(), states_[r].held);
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
  const auto& dest = layouts.workers.at(worker());
  for (const auto& it : layouts.plan->pair(rank, worker()).items)
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
  const auto& pair = plan.pair(rank, worker());
  const std::uint64_t frame_bytes = wire().buffer_bytes;
  const std::uint64_t digest = backend::pair_digest(plan.digest, rank, worker());
  const bool checksums = wire().checksums;
  const std::vector<stream_frame> frames = co_await pair_frames(*layouts, rank, bases);
  // The pair's header (with deltas on, and its delta header); a refusal is sent
  // back before any byte.
  std::optional<wire::delta_header> delta;
  const std::uint64_t seq = co_await accept_pair(*socket, rank, *layouts, frames.size(), me, &delta);
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
        base_frames = co_await pair_frames(*layouts, rank, at);
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
                                timeout(), me + ": answering the delta offer");
  }
  direct_write_begins();
  const std::size_t elem = pair_element_size(*layouts, pair);
  std::vector<std::uint64_t> hashes(frames.size(), 0);
  std::vector<std::byte> encoded, scratch;
  for (std::size_t k = 0; k < frames.size(); ++k) {
    const std::string what = me + ": frame " + std::to_string(k);
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout(), what + " header");
    const auto h = wire::decode<wire::bucket_header>(raw);
    const std::string bad = delta ? wire::check_delta_bucket_header(h, k, frames[k].bytes, checksums, accepted)
                                  : wire::check_bucket_header(h, k, frames[k].bytes, checksums);
    if (!bad.empty()) throw_error(errc::protocol_error, what + ": " + bad);
    auto buffers = backend::buffers_of<asio::mutable_buffer>(frames[k]);
    const bool is_delta = (h.flags & wire::flag_delta) != 0;
    // At most a loop's budget of bytes per system call: the loop is shared.
    if (is_delta) {
      encoded.resize(h.payload_bytes);
      co_await net::read_exact(*socket, asio::buffer(encoded), timeout(), what, net::loop_bytes_per_call);
    } else {
      co_await net::read_exact(*socket, buffers, timeout(), what, net::loop_bytes_per_call);
    }
    state->wire_bytes += h.payload_bytes;
    if (!is_delta && !checksums && !delta) continue;
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
    if (checksums && got != h.checksum)
      throw_error(errc::integrity_error, what + ": payload checksum " + to_hex(got) + " differs from the trainer's " +
                                             to_hex(h.checksum) +
                                             (is_delta ? " after decoding its delta (corrupted in transit, or this "
                                                         "worker's tensors did not hold the base)"
                                                       : ""));
    hashes[k] = got;
  }
  co_await links::confirm_update(*socket, seq, timeout(), me);
  if (delta) state->now = held_version{delta->version, delta_fingerprint(digest, hashes)};
}

// ---------------------------------------------------------------- trainer rank

sharded_sender::sharded_sender(const weight_transfer_config& config, const trainer_context& context)
    : sharded_sender_base(config, context) {}

sharded_sender::~sharded_sender() { shutdown(); }

std::function<void()> sharded_sender::read_args(json_reader& r) {
  const bool delta = r.optional<bool>("delta", false);
  const std::uint64_t delta_max = backend::read_delta_max_bytes(r);
  return [this, delta, delta_max] {
    delta_ = delta;
    delta_max_ = delta_max;
    if (!delta_) bases_.clear();  // no snapshot held without deltas
  };
}

// The pool's threads copy bytes into the sockets: one per worker, at most one per core.
unsigned sharded_sender::pool_threads() const {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::min<unsigned>(cores, static_cast<unsigned>(args().workers));
}

asio::awaitable<void> sharded_sender::connected(std::vector<links::member> members) {
  // Each worker's socket moves to its own strand of the pool, where its stream runs.
  for (auto& m : members) {
    auto strand = asio::make_strand(pool().get_executor());
    const auto protocol = m.socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, m.socket->release());
    net::set_buffers(moved, config_.socket_buffer_bytes);
    peers_.push_back(std::make_shared<peer>(peer{m.rank - 1, strand, std::move(moved)}));
  }
  co_return;
}

void sharded_sender::close_transport() noexcept {
  for (auto& p : peers_) asio::post(p->strand, [p] { net::close(p->socket); });
  peers_.clear();
}

// set_next_send's choice holds for this send only, whatever becomes of it.
void sharded_sender::send_begins() { allow_base_ = std::exchange(next_delta_, std::nullopt).value_or(true); }

asio::awaitable<void> sharded_sender::send_pairs(const backend::sharded_send& s) {
  const auto& plan = *s.layouts->plan;
  const int rank = this->rank(), workers = args().workers;
  const bool allow_base = allow_base_;
  const std::uint64_t seq = s.seq;
  // Deltas on: number this version; each pair whose snapshot holds the last
  // version of that same pair is offered deltas against it.
  delta_stats_ = {};
  // The snapshots hold this rank's egress: beyond the bound the update goes plain.
  const bool deltas = delta_ && (delta_max_ == 0 || plan.egress[rank] <= delta_max_);
  if (delta_ && !deltas) {
    bases_.clear();
    delta_stats_.over_bound = true;
    delta_stats_.full_bytes = plan.egress[rank];
  }
  if (deltas) {
    ++version_;
    delta_stats_.version = version_;
    delta_stats_.full_bytes = plan.egress[rank];
    bases_.resize(workers);
  }
  std::vector<asio::awaitable<void>> streams;
  for (int w = 0; w < workers; ++w) {
    const auto& pair = plan.pair(rank, w);
    auto frames = std::make_shared<const std::vector<stream_frame>>(frames_to(s, w));
    const std::uint64_t digest = backend::pair_digest(plan.digest, rank, w);
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
      delta->elem = pair_element_size(*s.layouts, pair);
      b.valid = false;  // a mix of two versions until this send completes
      b.digest = digest;
      b.size = pair.bytes;
      b.version = version_;
    }
    auto p = peers_.at(w);
    streams.push_back(
        asio::co_spawn(p->strand, stream_to(p, header, std::move(frames), seq, std::move(delta)), asio::use_awaitable));
  }
  co_await async::all_of(std::move(streams));
  if (deltas) {
    // Every worker confirmed: each snapshot is this version's bytes of its pair,
    // the next update's base.
    for (int w = 0; w < workers; ++w) {
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
}

asio::awaitable<void> sharded_sender::stream_to(std::shared_ptr<peer> p, std::array<std::byte, 48> header,
                                                std::shared_ptr<const std::vector<stream_frame>> frames,
                                                std::uint64_t seq, std::optional<pair_delta> delta) {
  const std::string who = this->who() + ": worker " + std::to_string(p->worker);
  const std::chrono::milliseconds timeout = args().timeout;
  const bool checksums = args().wire.checksums;
  p->took_delta = p->fell_back = false;
  p->encoded_frames = p->delta_bytes = p->encoded_full = 0;
  p->encode_s = 0;
  std::exception_ptr failure;
  try {
    bool deltas = false;
    if (!delta) {
      co_await links::announce_update(p->socket, header, timeout, who);
    } else {
      // The update header and its delta header, then the worker's answers: it
      // accepts the update, then (when offered deltas) says whether it holds the base.
      std::vector<asio::const_buffer> headers{asio::buffer(header), asio::buffer(delta->header)};
      co_await net::write_all(p->socket, headers, timeout, who + ": update header");
      links::throw_if_failed(
          co_await links::read_status(p->socket, timeout,
                                      who + ": waiting for the worker to accept update " + std::to_string(seq)),
          who + " refused the update");
      if (delta->offers_base) {
        const auto answer =
            co_await links::read_status(p->socket, timeout, who + ": waiting for its answer to the delta offer");
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
      buffers = backend::buffers_of<asio::const_buffer>(f);
      wire::bucket_header h;
      h.index = k;
      h.payload_bytes = f.bytes;
      if (checksums || delta) {
        const std::uint64_t sum = checksum(std::span<const asio::const_buffer>(buffers));  // on this I/O thread
        if (checksums) {
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
      co_await net::write_all(p->socket, buffers, timeout, who + ": frame " + std::to_string(k));
    }
    co_await links::await_confirmation(p->socket, seq, timeout, who);
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes: that reason is the error.
  if (failure) co_await links::rethrow_with_peer_reason(p->socket, failure, who);
}

void sharded_sender::set_next_send(const send_options& options) {
  next_delta_ = backend::next_delta_choice(options, delta_, who());
}

json sharded_sender::last_send_info() const {
  if (!delta_) return nullptr;
  return delta_send_info(delta_stats_);
}

}  // namespace refit::tcp
