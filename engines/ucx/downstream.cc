#include "downstream.h"  // private to this engine

#include <poll.h>

#include <asio/co_spawn.hpp>
#include <asio/experimental/deferred.hpp>
#include <asio/experimental/parallel_group.hpp>
#include <asio/steady_timer.hpp>

#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include "wire.h"  // private to this engine

namespace refit::ucx {

void downstream::forget_update_regions() noexcept {
  regions.erase(regions.lower_bound(wire::first_update_region), regions.end());
}

const remote_key& downstream::key_for(std::uint32_t id, std::span<const std::byte> key, std::uint64_t base,
                                      std::uint64_t bytes, std::uint64_t at, std::uint64_t n, const std::string& what,
                                      std::optional<std::uint32_t> piece) {
  if (!key.empty()) {
    region r;
    r.base = base;
    r.bytes = bytes;
    r.rkey = std::make_unique<remote_key>(*ep, key, what);
    regions[id] = std::move(r);
  }
  auto it = regions.find(id);
  if (it == regions.end() || !it->second.holds(at, n))
    throw_error(errc::protocol_error,
                what + ": " + (piece ? "piece " + std::to_string(*piece) + " of the grant" : std::string("the grant")) +
                    " lies outside the worker's registered memory");
  return *it->second.rkey;
}

void downstream::close() noexcept {
  regions.clear();
  if (ep) ep->close();
  if (socket) net::close(*socket);
}

asio::awaitable<void> connect_downstream(std::shared_ptr<downstream> keep, std::shared_ptr<worker> w,
                                         std::chrono::milliseconds timeout) {
  downstream& p = *keep;
  const std::string& who = p.name;
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
      downstream::region g;
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

asio::awaitable<void> send_bucket(std::shared_ptr<worker> w, std::shared_ptr<downstream> keep, std::uint64_t index,
                                  std::span<const asio::const_buffer> payload, std::uint64_t seq,
                                  std::optional<std::uint64_t> checksum, std::chrono::milliseconds timeout,
                                  std::optional<std::uint64_t> form) {
  downstream& p = *keep;
  const std::string what = p.name + ": bucket " + std::to_string(index);
  const std::uint64_t payload_bytes = asio::buffer_size(payload);
  if (form) {
    // The worker grants a slot of the delta's size, or the bucket's destination.
    wire::form f;
    f.index = index;
    f.encoded_bytes = *form;
    const auto raw = wire::encode(f);
    co_await net::write_all(*p.socket, asio::buffer(raw), timeout, what + ": its form");
  }
  const wire::grant g = co_await read_grant(*p.socket, timeout, what);
  if (g.index != index || g.payload_bytes != payload_bytes)
    throw_error(errc::protocol_error, what + ": the worker granted bucket " + std::to_string(g.index) + " of " +
                                          std::to_string(g.payload_bytes) + " bytes, expected " +
                                          std::to_string(payload_bytes) + " bytes");
  if (g.mode == wire::mode_put) {
    if (g.rkey_bytes > wire::max_rkey) throw_error(errc::protocol_error, what + ": oversized remote key");
    std::vector<std::byte> key(g.rkey_bytes);
    if (!key.empty()) co_await net::read_exact(*p.socket, asio::buffer(key), timeout, what + ": its remote key");
    // A grant outside what the worker registered is refused before a byte moves.
    const remote_key& rkey = p.key_for(g.region, key, g.region_base, g.region_bytes, g.remote, g.payload_bytes, what);
    if (g.payload_bytes > 0)
      co_await unless_hung_up(put_all(*w, *p.ep, payload, g.remote, rkey, timeout, what + ": put"), *p.socket,
                              what + ": put");
  } else if (g.mode == wire::mode_put_pieces) {
    // Several ranges (the model's memory, a stage), each within a region the worker
    // registered; every range checked before a byte moves.
    if (g.region == 0 || g.region > wire::max_pieces || g.rkey_bytes > wire::max_pieces_bytes)
      throw_error(errc::protocol_error, what + ": a grant of " + std::to_string(g.region) + " pieces in " +
                                            std::to_string(g.rkey_bytes) + " bytes");
    std::vector<std::byte> body(g.rkey_bytes);
    co_await net::read_exact(*p.socket, asio::buffer(body), timeout, what + ": its pieces");
    wire::reader r{body};
    std::vector<remote_range> ranges;
    std::uint64_t total = 0;
    for (std::uint32_t i = 0; i < g.region && r.ok; ++i) {
      const auto piece = r.get<wire::put_piece>();
      const auto key = r.bytes(piece.rkey_bytes);
      if (!r.ok || piece.rkey_bytes > wire::max_rkey) break;
      const remote_key& rkey =
          p.key_for(piece.region, key, piece.region_base, piece.region_bytes, piece.remote, piece.bytes, what, i);
      ranges.push_back({piece.remote, piece.bytes, &rkey});
      total += piece.bytes;
    }
    if (!r.ok || r.at != body.size() || total != g.payload_bytes)
      throw_error(errc::protocol_error, what + ": the grant's pieces are malformed (refused before any byte is put)");
    co_await unless_hung_up(put_scattered(*w, *p.ep, payload, ranges, timeout, what + ": put"), *p.socket,
                            what + ": put");
  } else if (g.mode == wire::mode_tag) {
    if ((g.tag >> 32) != seq) throw_error(errc::protocol_error, what + ": the grant is for another update");
    co_await unless_hung_up(tag_send(*w, *p.ep, payload, g.tag, timeout, what + ": tagged send"), *p.socket,
                            what + ": tagged send");
  } else {
    throw_error(errc::protocol_error, what + ": unknown grant mode " + std::to_string(g.mode));
  }
  // Only now (puts flushed, send complete) may the worker read the bucket.
  wire::done d;
  d.index = index;
  if (checksum) {
    d.flags |= wire::done_checksum;
    d.checksum = *checksum;
  }
  const auto raw = wire::encode(d);
  co_await net::write_all(*p.socket, asio::buffer(raw), timeout, what + ": done");
}

asio::awaitable<void> with_peer_reason(asio::awaitable<void> op, std::shared_ptr<downstream> d) {
  std::exception_ptr failure;
  try {
    co_await std::move(op);
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes: that reason is the error.
  if (failure) co_await links::rethrow_with_peer_reason(*d->socket, failure, d->name);
}

}  // namespace refit::ucx
