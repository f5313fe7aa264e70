// The TCP worker: connect, say hello, then per update check the trainer's update
// header against this worker's own plan and receive buckets into staging slots.
// In a relay topology it also forwards what it receives to its children as it
// arrives, and answers for them: it accepts an update once they accepted it, and
// confirms it once they confirmed.
#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/deadline.h>
#include <refit/backend/async/event.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/engines/tcp/tcp.h>
#include <refit/internal/hex.h>

namespace refit::tcp {

namespace wire = links::wire;

namespace {

using socket_ptr = std::shared_ptr<asio::ip::tcp::socket>;

// Forwards to the children what was just received, while the next bytes are read:
// one forward in flight at a time, so each child's stream stays in order.
class forwarder {
 public:
  forwarder(asio::any_io_executor ex, std::vector<socket_ptr> children, std::vector<int> ranks,
            std::chrono::milliseconds timeout, std::string what)
      : ex_(ex), children_(std::move(children)), ranks_(std::move(ranks)), timeout_(timeout), what_(std::move(what)),
        state_(std::make_shared<state>(ex)) {
    state_->idle.set();
  }
  // Waits for the forward in flight, then starts one of `bytes` (which stay valid
  // until finish()).
  asio::awaitable<void> send(std::vector<asio::const_buffer> bytes) {
    co_await finish();
    state_->idle.reset();
    // The completion touches only the shared state: it may come after this
    // forwarder is gone (a failed receive that closes the children).
    asio::co_spawn(ex_, links::write_to_children(children_, ranks_, std::move(bytes), timeout_, what_),
                   [s = state_](std::exception_ptr e) {
                     s->error = e;
                     s->idle.set();
                   });
  }
  // Waits for the forward in flight; rethrows its error.
  asio::awaitable<void> finish() {
    auto s = state_;
    co_await s->idle.wait();
    if (auto e = std::exchange(s->error, nullptr)) std::rethrow_exception(e);
  }

 private:
  struct state {
    explicit state(asio::any_io_executor ex) : idle(std::move(ex)) {}
    async::event idle;
    std::exception_ptr error;
  };
  asio::any_io_executor ex_;
  std::vector<socket_ptr> children_;
  std::vector<int> ranks_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::shared_ptr<state> state_;
};

// The next `n` bytes of `dest` from byte `at` on, as at most 64 buffers.
std::vector<asio::mutable_buffer> window(std::span<const asio::mutable_buffer> dest, std::uint64_t at,
                                         std::uint64_t n) {
  std::vector<asio::mutable_buffer> out;
  std::uint64_t start = 0;
  for (const auto& d : dest) {
    const std::uint64_t end = start + d.size();
    if (end > at && n > 0 && out.size() < 64) {
      const std::uint64_t from = std::max(at, start) - start;
      const std::uint64_t take = std::min<std::uint64_t>(d.size() - from, n);
      out.emplace_back(static_cast<std::byte*>(d.data()) + from, static_cast<std::size_t>(take));
      n -= take;
      at += take;
    }
    start = end;
  }
  return out;
}

// Receives one bucket: its header checked against the plan (begin), then the
// payload straight into the destination (no intermediate copy); its checksum is
// verified on the processing executor while the next bucket arrives (check). With
// children, each header and each piece of payload goes on to them as soon as it is
// here (cut-through), and the bucket is received once they have it too.
class transport final : public bucket_transport {
 public:
  transport(asio::ip::tcp::socket& s, std::chrono::milliseconds timeout, std::string source, bool checksums,
            const std::vector<socket_ptr>& children, const std::vector<int>& child_ranks,
            backend::delta_receive* delta = nullptr)
      : socket_(s), timeout_(timeout), source_(std::move(source)), checksums_(checksums), children_(children),
        child_ranks_(child_ranks), delta_(delta) {}

  asio::awaitable<void> begin(const bucket& b) override {
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(socket_, asio::buffer(raw), timeout_, what(b) + " header");
    auto h = wire::decode<wire::bucket_header>(raw);
    const std::string mismatch =
        delta_ ? wire::check_delta_bucket_header(h, b.index, b.payload_bytes, checksums_, delta_->accepted)
               : wire::check_bucket_header(h, b.index, b.payload_bytes, checksums_);
    if (!mismatch.empty()) throw_error(errc::protocol_error, what(b) + ": " + mismatch);
    expected_ = h.checksum;
    encoded_.reset();
    if ((h.flags & wire::flag_delta) != 0) encoded_ = h.payload_bytes;
    if (!children_.empty()) {
      std::vector<asio::const_buffer> header{asio::buffer(raw)};  // (GCC 12: no braced list in co_await)
      co_await links::write_to_children(children_, child_ranks_, std::move(header), timeout_, what(b) + " header");
    }
  }

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    if (children_.empty()) {
      co_await net::read_exact(socket_, dest, timeout_, what(b) + " payload", net::loop_bytes_per_call);
      co_return;
    }
    // Read what has come (one call of at most what the loop can afford) and pass
    // it on while reading more. (`dest` holds what the wire carries: an encoded
    // bucket is smaller than the plan's, and goes on encoded.)
    constexpr std::uint64_t piece = net::loop_bytes_per_call;
    forwarder out(socket_.get_executor(), children_, child_ranks_, timeout_, what(b) + " payload");
    const std::uint64_t total = asio::buffer_size(dest);
    std::uint64_t at = 0;
    while (at < total) {
      auto next = window(dest, at, std::min(piece, total - at));
      std::size_t got = 0;
      try {
        got = co_await async::with_deadline(socket_.async_read_some(next, asio::use_awaitable), timeout_,
                                            what(b) + " payload");
      } catch (const error&) {
        throw;
      } catch (const std::system_error& e) {
        net::throw_io_error(e.code(), what(b) + " payload");
      }
      auto arrived = window(dest, at, got);
      co_await out.send(std::vector<asio::const_buffer>(arrived.begin(), arrived.end()));
      at += got;
    }
    co_await out.finish();
  }

  std::function<void()> check(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    if (!checksums_ && !delta_) return {};
    // With a delta header every bucket is hashed (checksums or not): the hashes make
    // the fingerprint of the version this worker then holds.
    std::uint64_t* keep = delta_ ? &delta_->hashes.at(b.index) : nullptr;
    return backend::bucket_hash_check(dest, checksums_ ? std::optional<std::uint64_t>(expected_) : std::nullopt, keep,
                                      what(b), encoded_.has_value());
  }

  std::optional<std::uint64_t> encoded_bytes(const bucket&) override { return encoded_; }

  std::function<void()> decode(const bucket& b, std::span<const std::byte> encoded,
                               std::vector<decode_target> pieces) override {
    if (!delta_) throw_error(errc::protocol_error, what(b) + ": an unexpected delta bucket");
    return backend::delta_decode(*delta_, encoded, std::move(pieces), what(b));
  }

 private:
  std::string what(const bucket& b) const { return source_ + ": bucket " + std::to_string(b.index); }
  asio::ip::tcp::socket& socket_;
  std::chrono::milliseconds timeout_;
  std::string source_;  // this worker, and the upstream worker it reads from (if not the trainer)
  bool checksums_;
  const std::vector<socket_ptr>& children_;
  const std::vector<int>& child_ranks_;
  backend::delta_receive* delta_;
  std::uint64_t expected_ = 0;
  std::optional<std::uint64_t> encoded_;  // the bucket begun arrives as a delta of this many bytes
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context)
    : typed_engine(config, context, capabilities_of()) {}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  do_shutdown();
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = links::worker_rank(info, context().ranks, "tcp");
  position_ = {};
  // In a relay topology the hello says where this worker's children may connect.
  links::relay_listener relay;
  if (!info.topology.star())
    relay = [this](const asio::ip::address& local) {
      relay_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context().executor, local.to_string(), 0));
      return relay_->local_endpoint().port();
    };
  auto joined = co_await links::join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret,
                                     timeout_, who(), relay);
  auto socket = std::make_shared<asio::ip::tcp::socket>(std::move(joined.socket));
  net::set_buffers(*socket, config().socket_buffer_bytes);

  // Staging is allocated once here and reused by every update; allocating and
  // faulting in num_buffers x buffer_bytes takes the processing executor a while,
  // not the event loop.
  if (!pipeline_ || !(pipeline_->params() == info.wire)) {
    pipeline_.reset();  // the old staging goes first: peak memory is one set
    const wire_params wire = info.wire;
    std::unique_ptr<staging_memory> staging = co_await async::offload(processing_executor(), [wire] {
      return std::unique_ptr<staging_memory>(std::make_unique<host_staging>(wire.num_buffers, wire.buffer_bytes));
    });
    pipeline_ =
        std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire, std::move(staging));
  }
  socket_ = std::move(socket);
  last_seq_ = 0;
  if (!info.topology.star()) {
    try {
      co_await join_relay(info);
    } catch (...) {
      do_shutdown();
      throw;
    }
  }
}

namespace {
asio::awaitable<void> connect_upstream(std::shared_ptr<asio::ip::tcp::socket>* out, links::relay_position p, int rank,
                                       wire_params wire, std::string secret, std::chrono::milliseconds timeout,
                                       std::string who, std::size_t buffer_bytes) {
  auto j = co_await links::join(p.upstream_address, p.upstream_port, rank, wire, std::move(secret), timeout,
                                who + ": upstream worker rank " + std::to_string(p.upstream));
  *out = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
  net::set_buffers(**out, buffer_bytes);
}

asio::awaitable<void> accept_children(std::vector<socket_ptr>* out, asio::ip::tcp::acceptor& relay,
                                      asio::any_io_executor ex, std::vector<int> ranks, wire_params wire,
                                      std::string secret, std::chrono::milliseconds timeout, std::string who,
                                      std::size_t buffer_bytes) {
  auto members = co_await links::accept_members(relay, ex, std::move(secret), timeout, wire, ranks, who + " (relay)");
  // In the order of `ranks` (accept_members sorts by rank, as are they).
  for (auto& m : members) {
    net::set_buffers(*m.socket, buffer_bytes);
    out->push_back(m.socket);
  }
}
}  // namespace

asio::awaitable<void> engine::join_relay(const init_info& info) {
  // The trainer says where this worker sits once every worker has joined.
  position_ = co_await links::read_position(*socket_, info.topology, timeout_, who());
  // Connect upstream and accept the children at once: a chain forms in one step.
  std::vector<asio::awaitable<void>> both;
  if (position_.upstream != 0)
    both.push_back(connect_upstream(&upstream_, position_, rank_, info.wire, config().auth_secret, timeout_, who(),
                                    config().socket_buffer_bytes));
  if (!position_.children.empty())
    both.push_back(accept_children(&children_, *relay_, context().executor, position_.children, info.wire,
                                   config().auth_secret, timeout_, who(), config().socket_buffer_bytes));
  co_await async::all_of(std::move(both));
  if (position_.children.empty()) relay_.reset();  // nobody will connect
}

asio::awaitable<void> engine::receive(const update_info& info, load_weights_fn load_weights) {
  if (!socket_)
    throw_error(errc::invalid_state, who() +
                                         ": the connection to the trainer was closed by an earlier "
                                         "failure; call init_transfer_engine again");
  const auto from = upstream();  // held: a disconnect closes it, never frees it under the read
  const auto children = children_;
  std::exception_ptr failure;
  try {
    co_await receive_on(*from, children, info, std::move(load_weights));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // The upstream (the trainer or the worker relaying to this one) learns why,
    // so its error names this worker's reason (say, which child was lost), not a
    // reset connection. Then, as the stream position is unknown, the connections
    // close: the children fail at once rather than wait for bytes that never come.
    co_await links::tell_failure(*from, failure, last_seq_);
    do_shutdown();
    std::rethrow_exception(failure);
  }
}

asio::awaitable<void> engine::receive_on(asio::ip::tcp::socket& socket, const std::vector<socket_ptr>& children,
                                         const update_info& info, load_weights_fn load_weights) {
  const std::vector<int> child_ranks = position_.children;
  const std::string me = who();
  // What reads from the upstream name it: a lost relay shows up as that rank.
  const std::string source =
      position_.upstream > 0 ? me + ": upstream worker rank " + std::to_string(position_.upstream) : me;
  bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
  // Which version the weights hold is known only until this update changes them.
  const std::optional<held_version> held = held_.take();
  // The header (and a delta header) goes down the tree; this worker accepts only
  // once its children did.
  std::optional<wire::delta_header> delta_header;
  last_seq_ = co_await links::accept_update_for_subtree(socket, children, child_ranks, last_seq_, info.metadata, plan,
                                                        timeout_, me, source, &delta_header);

  // A delta update: this worker says whether it holds the base (then its buckets
  // may arrive encoded) or not (then every bucket comes full), before any byte of
  // the model changes.
  std::optional<backend::delta_receive> delta;
  if (delta_header) {
    delta.emplace();
    delta->meta = &info.metadata;
    delta->hashes.assign(plan.buckets.size(), 0);
    if ((delta_header->flags & wire::delta_flag_has_base) != 0) {
      // Hashes the tensors (off the loop) too: bytes written outside refit since (a
      // model reloaded, a tensor changed in place) get the update full.
      // (Arguments named first: GCC 12 may destroy a temporary of a co_await
      // expression twice.)
      const bool staged = info.commit.value_or(config().commit) == commit_mode::staged;
      const std::string dirty = weights_dirty() ? dirty_reason() : std::string();
      model_target* const current = staged ? context().model : receive_target();
      const asio::any_io_executor processing = processing_executor();
      std::string why_full = co_await backend::check_delta_base(*delta_header, held, dirty, info.metadata, current,
                                                                staged, plan, processing, delta->base);
      delta->accepted = why_full.empty();
      // With children the subtree answers as one (relay_io.h). Each bucket's header
      // says its form, so a worker that holds the base takes a full stream too.
      co_await links::answer_delta_offer_for_subtree(socket, children, child_ranks, std::move(why_full), last_seq_,
                                                     timeout_, me);
    }
  }

  transport t(socket, timeout_, source, pipeline_->params().checksums, children, child_ranks,
              delta ? &*delta : nullptr);
  // The plan just checked against the trainer's header is the one received with.
  co_await pipeline_->receive(info.metadata, std::move(plan), t, std::move(load_weights), deferred(), mutable_stats(),
                              receive_target());
  // Every child confirms (its subtree has every byte, verified) before this one does.
  co_await links::confirm_update_for_subtree(socket, children, child_ranks, last_seq_, timeout_, me);
  // The weights now hold the trainer's version (its fingerprint is the hashes of
  // the bytes that arrived, so a worker that got other bytes never matches). A
  // chunk staged in an open update session holds it once the session commits.
  if (delta_header) {
    held_.record({delta_header->version, delta_fingerprint(metadata_digest(info.metadata), delta->hashes)},
                 receiving_into_open_session(), held);
  }
}

void engine::do_session_committed() { held_.committed(); }

void engine::do_session_finished() { held_.finished(weights_dirty()); }

void engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  if (!upstream()) return;
  try {
    // The refusal goes upstream; children (whose header never comes) are closed.
    std::shared_ptr<asio::ip::tcp::socket> s =
        upstream_ ? std::exchange(upstream_, nullptr) : std::exchange(socket_, nullptr);
    asio::co_spawn(context().executor,
                   links::refuse_update(s, last_seq_ + 1, kind, reason,
                                        std::min(timeout_, std::chrono::milliseconds(2000)), who()),
                   asio::detached);
  } catch (...) {  // could not start the refusal: the trainer fails at its deadline
  }
  do_shutdown();
}

void engine::do_shutdown() {
  for (auto* s : {socket_.get(), upstream_.get()})
    if (s) net::close(*s);
  for (auto& c : children_) net::close(*c);
  socket_.reset();
  upstream_.reset();
  children_.clear();
  if (relay_) {
    std::error_code ignored;
    relay_->close(ignored);
    relay_.reset();
  }
}

}  // namespace refit::tcp
