// The UCX trainer: accept the workers (links), make an endpoint to each from its
// offer, then per bucket write where the worker granted (puts, flushed) or send it
// tagged, and only then say "done".
#include <poll.h>

#include <refit/backend/async/all_of.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/ucx/ucx.h>
#include <asio/experimental/deferred.hpp>
#include <asio/experimental/parallel_group.hpp>
#include <asio/steady_timer.hpp>
#include "ucp.h"   // private to this engine
#include "wire.h"  // private to this engine

namespace refit::ucx {

sender::sender(const weight_transfer_config& config, const trainer_context& context) : sender_base(config, context) {}

sender::~sender() {
  shutdown();
  peers_by_rank_.clear();
  if (worker_) worker_->close();
}

json sender::transport_info() const {
  json out = json::object();
  for (const auto& p : peers_by_rank_) out[std::to_string(p->rank)] = p->report.to_json();
  return out;
}

void sender::close_transport() noexcept {
  // Keys, endpoints and the worker are released now (keys first, while their worker
  // lives); a stream still holding its peer finds the endpoint closed (check_open)
  // before it touches a key again.
  for (auto& p : peers_by_rank_) {
    p->regions.clear();
    if (p->ep) p->ep->close();
  }
  peers_by_rank_.clear();
  if (worker_) {
    worker_->close();
    worker_.reset();
  }
}

asio::awaitable<void> sender::connected() {
  if (!ucp_) ucp_ = std::make_shared<ucx::context>();
  worker_ = worker::create(ucp_, context_.executor);
  worker::engaged progressing(worker_);
  for (const auto& m : peers_) {
    auto p = std::make_shared<peer>();
    p->rank = m.rank;
    p->socket = m.socket;
    peers_by_rank_.push_back(std::move(p));
  }
  std::vector<asio::awaitable<void>> ops;
  for (auto& p : peers_by_rank_) ops.push_back(connect_one(p, worker_));
  co_await async::all_of(std::move(ops));
}

asio::awaitable<void> sender::connect_one(std::shared_ptr<peer> keep, std::shared_ptr<worker> w) {
  peer& p = *keep;
  const std::string who = rank_name(p.rank);
  const auto timeout = args_.timeout;
  std::array<std::byte, sizeof(wire::offer_header)> raw;
  co_await net::read_exact(*p.socket, asio::buffer(raw), timeout, who + ": waiting for its UCX offer");
  const auto h = wire::decode<wire::offer_header>(raw);
  if (h.magic != wire::offer_magic || h.bytes > wire::max_offer || h.address_bytes > h.bytes)
    throw_error(errc::protocol_error, who + ": expected a UCX offer of at most " + std::to_string(wire::max_offer) +
                                          " bytes (is it a ucx worker?)");
  std::vector<std::byte> body(h.bytes);
  co_await net::read_exact(*p.socket, asio::buffer(body), timeout, who + ": reading its UCX offer");

  std::exception_ptr failure;
  try {
    wire::reader r{body};
    const auto address = r.bytes(h.address_bytes);
    p.ep = std::make_unique<endpoint>(w, address, who);
    for (std::uint32_t i = 0; i < h.regions && r.ok; ++i) {
      region g;
      g.base = r.get<std::uint64_t>();
      g.bytes = r.get<std::uint64_t>();
      const auto key_bytes = r.get<std::uint32_t>();
      const auto key = r.bytes(key_bytes);
      if (!r.ok || key_bytes > wire::max_rkey) break;
      g.rkey = std::make_unique<remote_key>(*p.ep, key, who);
      p.regions.emplace(i, std::move(g));
    }
    if (!r.ok || r.at != body.size())
      throw_error(errc::protocol_error, who + ": its UCX offer is malformed (refused before any byte is written)");
    // Wire-up completes before the transports are read (and before a put).
    co_await p.ep->flush(timeout, who + ": connecting its UCX endpoint");
    const auto t = p.ep->transports();
    p.report.transports = t.transports;
    p.report.put_transports = t.put_transports;
    p.report.mode = t.native_puts ? "put" : "tag";
    p.report.peer_failure_handling = p.ep->peer_failure_handling();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    co_await links::tell_failure(*p.socket, failure, 0);
    std::rethrow_exception(failure);
  }
  co_await links::send_status(*p.socket, 0, 0, p.report.to_json().dump(), timeout, who + ": its UCX endpoint");
  auto st = co_await links::read_status(*p.socket, timeout, who + ": waiting for it to accept the transports");
  links::throw_if_failed(st, who);
}

namespace {

// Awaits `op` (a bucket's puts and their flush, or its tagged send) unless the
// worker hangs up first. UCX 1.13's shared-memory transports have no peer failure
// handling: a worker that dies mid-put leaves a flush that never completes, and
// only its TCP side channel says it is gone. The worker never half-closes that
// connection during an update, so POLLRDHUP there (checked every 20 ms; grants
// that arrive meanwhile do not trigger it) means it is lost: peer_lost at once,
// not a timeout at the deadline.
asio::awaitable<void> unless_hung_up(asio::awaitable<void> op, asio::ip::tcp::socket& s, std::string what) {
  namespace ex = asio::experimental;
  auto executor = co_await asio::this_coro::executor;
  const int fd = s.native_handle();
  auto watch = [](int fd, std::string what) -> asio::awaitable<void> {
    asio::steady_timer t(co_await asio::this_coro::executor);
    for (;;) {
      pollfd p{fd, POLLRDHUP, 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0)
        throw_error(errc::peer_lost, what + ": the worker closed its connection while the bytes were in flight");
      t.expires_after(std::chrono::milliseconds(20));
      co_await t.async_wait(asio::use_awaitable);
    }
  };
  auto group = ex::make_parallel_group(asio::co_spawn(executor, std::move(op), ex::deferred),
                                       asio::co_spawn(executor, watch(fd, what), ex::deferred));
  auto [order, op_error, watch_error] = co_await group.async_wait(ex::wait_for_one(), asio::use_awaitable);
  if (order[0] == 0) {
    if (op_error) std::rethrow_exception(op_error);
    co_return;
  }
  if (watch_error) std::rethrow_exception(watch_error);
}

// A grant, or the worker's status saying why it fails (both start with a magic).
asio::awaitable<wire::grant> read_grant(asio::ip::tcp::socket& s, std::chrono::milliseconds timeout,
                                        const std::string& what) {
  std::array<std::byte, sizeof(wire::grant)> raw;
  constexpr std::size_t head = sizeof(links::wire::status);
  co_await net::read_exact(s, asio::buffer(raw.data(), head), timeout, what + ": waiting for its grant");
  std::uint32_t magic = 0;
  std::memcpy(&magic, raw.data(), sizeof magic);
  if (magic == links::wire::status_magic) {
    const auto st = links::wire::decode<links::wire::status>(
        *reinterpret_cast<const std::array<std::byte, sizeof(links::wire::status)>*>(raw.data()));
    std::string message(std::min(st.message_bytes, links::wire::max_message), '\0');
    co_await net::read_exact(s, asio::buffer(message), links::reason_wait, what + ": reading why it failed");
    links::throw_if_failed({st.code == 0 ? static_cast<std::uint32_t>(errc::protocol_error) : st.code, st.seq, message},
                           what);
  }
  co_await net::read_exact(s, asio::buffer(raw.data() + head, raw.size() - head), timeout, what + ": its grant");
  const auto g = wire::decode<wire::grant>(raw);
  if (g.magic != wire::grant_magic) throw_error(errc::protocol_error, what + ": expected a grant");
  co_return g;
}

}  // namespace

asio::awaitable<void> sender::stream_to(std::shared_ptr<peer> keep, std::shared_ptr<worker> w,
                                        const std::vector<std::vector<asio::const_buffer>>& payloads,
                                        const bucket_plan& plan, std::uint64_t seq) {
  peer& p = *keep;
  const auto timeout = args_.timeout;
  for (const bucket& b : plan.buckets) {
    const std::string what = rank_name(p.rank) + ": bucket " + std::to_string(b.index);
    const wire::grant g = co_await read_grant(*p.socket, timeout, what);
    if (g.index != b.index || g.payload_bytes != b.payload_bytes)
      throw_error(errc::protocol_error, what + ": the worker granted bucket " + std::to_string(g.index) + " of " +
                                            std::to_string(g.payload_bytes) + " bytes, expected " +
                                            std::to_string(b.payload_bytes) + " bytes");
    const auto& payload = payloads[b.index];
    if (g.mode == wire::mode_put) {
      if (g.rkey_bytes > 0) {
        if (g.rkey_bytes > wire::max_rkey) throw_error(errc::protocol_error, what + ": oversized remote key");
        std::vector<std::byte> key(g.rkey_bytes);
        co_await net::read_exact(*p.socket, asio::buffer(key), timeout, what + ": its remote key");
        region r;
        r.base = g.region_base;
        r.bytes = g.region_bytes;
        r.rkey = std::make_unique<remote_key>(*p.ep, key, what);
        p.regions[g.region] = std::move(r);
      }
      auto it = p.regions.find(g.region);
      // A grant outside what the worker registered is refused before a byte moves.
      if (it == p.regions.end() || g.remote < it->second.base || g.payload_bytes > it->second.bytes ||
          g.remote - it->second.base > it->second.bytes - g.payload_bytes)
        throw_error(errc::protocol_error, what + ": the grant lies outside the worker's registered memory");
      if (g.payload_bytes > 0)
        co_await unless_hung_up(put_all(*w, *p.ep, payload, g.remote, *it->second.rkey, timeout, what + ": put"),
                                *p.socket, what + ": put");
    } else if (g.mode == wire::mode_tag) {
      if ((g.tag >> 32) != seq) throw_error(errc::protocol_error, what + ": the grant is for another update");
      co_await unless_hung_up(tag_send(*w, *p.ep, payload, g.tag, timeout, what + ": tagged send"), *p.socket,
                              what + ": tagged send");
    } else {
      throw_error(errc::protocol_error, what + ": unknown grant mode " + std::to_string(g.mode));
    }
    // Only now (puts flushed, send complete) may the worker read the bucket.
    wire::done d;
    d.index = b.index;
    const auto raw = wire::encode(d);
    co_await net::write_all(*p.socket, asio::buffer(raw), timeout, what + ": done");
  }
}

namespace {
asio::awaitable<void> guarded(asio::awaitable<void> op, std::shared_ptr<asio::ip::tcp::socket> socket,
                              std::string who) {
  std::exception_ptr failure;
  try {
    co_await std::move(op);
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes: that reason is the error.
  if (failure) co_await links::rethrow_with_peer_reason(*socket, failure, who);
}
}  // namespace

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  try {
    worker::engaged progressing(worker_);
    // Every tensor the source yields is walked (and checked) before a byte leaves.
    std::vector<std::vector<asio::const_buffer>> payloads(plan.buckets.size());
    send_cursor cursor(declared, plan, source);
    for (const bucket& b : plan.buckets) {
      const auto& g = cursor.gather(b);
      payloads[b.index].assign(g.begin(), g.end());
    }
    cursor.finish();
    co_await announce_all(peers_, links::update_header(seq, declared, plan));
    std::vector<asio::awaitable<void>> streams;
    for (auto& p : peers_by_rank_)
      streams.push_back(guarded(stream_to(p, worker_, payloads, plan, seq), p->socket, rank_name(p->rank)));
    co_await async::all_of(std::move(streams));
    co_await confirm_all(peers_, seq);
  } catch (...) {
    close();
    throw;
  }
  end_update(declared, plan, start);
}

}  // namespace refit::ucx
