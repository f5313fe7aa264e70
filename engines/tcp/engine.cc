// The TCP worker's transport: each bucket's header and payload read from the
// trainer (or the upstream worker) straight into the pipeline's destination and, in
// a relay topology, forwarded to the children as it arrives. Joining, the
// subtree's update header and confirmation, and deltas' answers are
// links::stream_engine's.
#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/async/event.h>
#include <refit/backend/checksum.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/engines/tcp/tcp.h>

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
    : typed_init(config, context, capabilities_of()) {}

std::unique_ptr<staging_memory> engine::make_staging(const wire_params& wire) {
  return std::make_unique<host_staging>(wire.num_buffers, wire.buffer_bytes);
}

// Every side channel carries buckets (in a relay, down the tree too).
void engine::opened(asio::ip::tcp::socket& socket) { net::set_buffers(socket, config().socket_buffer_bytes); }

asio::awaitable<void> engine::receive_buckets(links::stream_update& u) {
  transport t(u.upstream, timeout(), u.source, pipeline()->params().checksums, u.children, u.child_ranks, u.delta);
  // The plan just checked against the trainer's header is the one received with.
  co_await pipeline()->receive(u.info.metadata, std::move(u.plan), t, std::move(u.load_weights), deferred(),
                               mutable_stats(), receive_target());
}

}  // namespace refit::tcp
