#include <refit/backend/links/links.h>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/async/event.h>
#include <refit/backend/handshake.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>

namespace refit::links {

using clock_type = std::chrono::steady_clock;

join_info join_info::read(json_reader& r) {
  join_info info;
  info.master_address = r.required<std::string>("master_address");
  if (info.master_address.empty()) r.fail("member 'master_address' must not be empty");
  info.master_port = r.required<std::uint16_t>("master_port");
  if (info.master_port == 0) r.fail("member 'master_port' must be a port in [1, 65535], got 0");
  info.rank_offset = r.required<int>("rank_offset");
  info.world_size = r.required<int>("world_size");
  if (info.world_size < 2)
    r.fail("member 'world_size' must be at least 2 (the trainer and one worker), got " +
           std::to_string(info.world_size));
  if (info.rank_offset < 1 || info.rank_offset >= info.world_size)
    r.fail("member 'rank_offset' must be in [1, world_size), got " + std::to_string(info.rank_offset));
  info.wire = wire_params::read(r);
  if (auto ms = r.maybe<std::int64_t>("timeout_ms")) {
    if (*ms <= 0) r.fail("member 'timeout_ms' must be positive, got " + std::to_string(*ms));
    info.timeout = std::chrono::milliseconds(*ms);
  }
  return info;
}

trainer_args trainer_args::read(json_reader& r, std::chrono::milliseconds default_timeout) {
  trainer_args a;
  a.address = r.required<std::string>("master_address");
  a.port = r.required<std::uint16_t>("master_port");
  a.world_size = r.required<int>("world_size");
  if (a.world_size < 2)
    r.fail("member 'world_size' must be at least 2 (the trainer and one worker), got " + std::to_string(a.world_size));
  a.wire = wire_params::read(r);
  auto ms = r.optional<std::int64_t>("timeout_ms", default_timeout.count());
  if (ms <= 0) r.fail("member 'timeout_ms' must be positive, got " + std::to_string(ms));
  a.timeout = std::chrono::milliseconds(ms);
  return a;
}

json worker_init_info(const trainer_args& args, std::uint16_t port) {
  json j = {{"master_address", args.address},
            {"master_port", port},
            {"rank_offset", 1},
            {"world_size", args.world_size},
            {"timeout_ms", args.timeout.count()}};
  args.wire.write(j);
  return j;
}

int worker_rank(const join_info& info, const parallel_ranks& r, const std::string& backend) {
  const int local = r.tp_rank + r.tp_size * (r.pp_rank + r.pp_size * r.dp_rank);
  const int rank = info.rank_offset + local;
  if (rank >= info.world_size)
    throw_error(errc::invalid_argument, backend + " init_info: this worker's rank " + std::to_string(rank) +
                                            " (rank_offset " + std::to_string(info.rank_offset) +
                                            " + local rank) is not below world_size " +
                                            std::to_string(info.world_size));
  return rank;
}

namespace {

// What the handshakes of one rendezvous share. They run concurrently on the
// trainer's executor, so a slow or silent connection delays nobody; they touch
// only this (never the caller's objects, which may be gone when a cut-off one
// resumes).
struct rendezvous {
  rendezvous(asio::any_io_executor ex, std::string secret, std::chrono::milliseconds timeout, wire_params wire,
             std::vector<int> expected, std::string who, std::string welcome)
      : executor(ex), secret(std::move(secret)), timeout(timeout), wire(wire), expected(std::move(expected)),
        who(std::move(who)), welcome(std::move(welcome)), changed(ex) {}
  asio::any_io_executor executor;
  std::string secret;
  std::chrono::milliseconds timeout;
  wire_params wire;
  std::vector<int> expected;  // the ranks that may join
  std::string who, welcome;
  std::vector<member> joined;  // welcomed
  std::vector<int> claimed;    // welcomed or being welcomed
  std::vector<std::weak_ptr<asio::ip::tcp::socket>> pending;
  std::string last_refusal;
  async::event changed;  // a worker joined or accepting stopped
  bool done = false, accepting = true;
};

std::string peer_of(asio::ip::tcp::socket& s) {
  std::error_code ec;
  auto ep = s.remote_endpoint(ec);
  return ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
}

asio::awaitable<void> handshake(std::shared_ptr<rendezvous> r, std::shared_ptr<asio::ip::tcp::socket> socket) {
  // A connection that fails authentication or its hello is refused and the
  // trainer keeps waiting: a stray or hostile peer cannot end the rendezvous.
  const std::string from = peer_of(*socket);
  std::array<std::byte, sizeof(wire::hello)> raw;
  std::string failure;
  try {
    co_await auth::as_server(*socket, r->secret, r->timeout, r->who + ": connection from " + from);
    co_await net::read_exact(*socket, asio::buffer(raw), r->timeout, r->who + ": reading the hello of " + from);
  } catch (const error& e) {
    failure = from + ": " + std::string(errc_name(e.kind())) + ": " + e.message();
  }
  if (r->done) co_return;
  if (!failure.empty()) {
    r->last_refusal = failure;
    co_return;
  }
  const auto h = wire::decode<wire::hello>(raw);
  std::string refusal;
  errc code = errc::invalid_argument;
  if (h.magic != wire::hello_magic) {
    refusal = "not a refit worker (bad magic)";
    code = errc::protocol_error;
  } else if (h.version != wire::protocol_version) {
    refusal =
        "protocol version " + std::to_string(h.version) + ", trainer speaks " + std::to_string(wire::protocol_version);
    code = errc::protocol_error;
  } else if (std::find(r->expected.begin(), r->expected.end(), static_cast<int>(h.rank)) == r->expected.end()) {
    std::string ranks;
    for (int e : r->expected) ranks += (ranks.empty() ? "" : ", ") + std::to_string(e);
    refusal = "rank " + std::to_string(h.rank) + " is not one of the ranks expected here (" + ranks + ")";
  } else if (h.buffer_bytes != r->wire.buffer_bytes || h.num_buffers != r->wire.num_buffers ||
             ((h.flags & wire::flag_checksum) != 0) != r->wire.checksums) {
    refusal = "wire parameters differ: worker has buffer_bytes " + std::to_string(h.buffer_bytes) + " x " +
              std::to_string(h.num_buffers) + (h.flags & wire::flag_checksum ? " with" : " without") +
              " checksums, trainer " + std::to_string(r->wire.buffer_bytes) + " x " +
              std::to_string(r->wire.num_buffers) + (r->wire.checksums ? " with" : " without") + " checksums";
  } else if (std::find(r->claimed.begin(), r->claimed.end(), static_cast<int>(h.rank)) != r->claimed.end()) {
    // The usual cause: several workers were given the same init_info (one
    // prepare() result) unchanged, so they all claim rank_offset + 0.
    refusal = "rank " + std::to_string(h.rank) +
              " is already connected: another worker joined with the same rank. Each worker needs its own "
              "rank, rank_offset + its local rank (tp_rank): give worker i (0, 1, ...) the trainer's init_info "
              "with \"rank_offset\": 1 + i, as vLLM's engines do, or one engine tp_rank i of tp_size N "
              "(refit's WorkerGroup.init does the former for you)";
  }
  if (!refusal.empty()) {
    // The refused worker gets the reason; the trainer keeps waiting for valid ones.
    r->last_refusal = from + ": " + refusal;
    try {
      co_await send_status(*socket, static_cast<std::uint32_t>(code), 0, refusal, r->timeout,
                           r->who + ": refusing a worker");
    } catch (const error&) {
    }
    co_return;
  }
  const int rank = static_cast<int>(h.rank);
  r->claimed.push_back(rank);
  try {
    co_await send_status(*socket, 0, 0, r->welcome, r->timeout,
                         r->who + ": welcoming worker rank " + std::to_string(rank));
  } catch (const error& e) {
    std::erase(r->claimed, rank);
    if (!r->done) r->last_refusal = from + ": " + std::string(errc_name(e.kind())) + ": " + e.message();
    co_return;
  }
  if (r->done) co_return;
  member m{rank, socket};
  m.relay_port = static_cast<std::uint16_t>(h.relay_port);
  std::error_code ec;
  const auto ep = socket->remote_endpoint(ec);
  if (!ec) m.address = ep.address().to_string();
  r->joined.push_back(std::move(m));
  r->changed.set();
}

asio::awaitable<void> accept_loop(std::shared_ptr<rendezvous> r, asio::ip::tcp::acceptor& acceptor) {
  std::chrono::milliseconds backoff(0);
  while (!r->done) {
    auto socket = std::make_shared<asio::ip::tcp::socket>(r->executor);
    std::error_code ec;
    co_await acceptor.async_accept(*socket, asio::redirect_error(asio::use_awaitable, ec));
    if (r->done) break;  // the acceptor may be gone: touch nothing of it
    if (ec) {
      if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor) break;
      // E.g. out of descriptors: keep accepting, but after a pause (an accept retried
      // at once fails at once, forever), and say why if the rendezvous times out.
      r->last_refusal = "accepting a connection failed: " + net::describe(ec);
      backoff = std::clamp(backoff * 2, std::chrono::milliseconds(5), std::chrono::milliseconds(1000));
      asio::steady_timer pause(r->executor, backoff);
      std::error_code ignored;
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
      continue;
    }
    backoff = std::chrono::milliseconds(0);
    net::tune(*socket);
    r->pending.push_back(socket);
    asio::co_spawn(r->executor, handshake(r, socket), asio::detached);
  }
  r->accepting = false;
  r->changed.set();
}

}  // namespace

asio::awaitable<std::vector<member>> accept_workers(asio::ip::tcp::acceptor& acceptor, asio::any_io_executor executor,
                                                    std::string secret, std::chrono::milliseconds timeout,
                                                    wire_params wire, int world_size, std::string who,
                                                    std::string welcome) {
  std::vector<int> ranks;
  for (int r = 1; r < world_size; ++r) ranks.push_back(r);
  co_return co_await accept_members(acceptor, executor, std::move(secret), timeout, wire, std::move(ranks),
                                    std::move(who), std::move(welcome));
}

asio::awaitable<std::vector<member>> accept_members(asio::ip::tcp::acceptor& acceptor, asio::any_io_executor executor,
                                                    std::string secret, std::chrono::milliseconds timeout,
                                                    wire_params wire, std::vector<int> expected, std::string who,
                                                    std::string welcome) {
  if (welcome.size() > wire::max_message)
    throw_error(errc::invalid_argument, who + ": welcome text of " + std::to_string(welcome.size()) + " bytes");
  const int workers = static_cast<int>(expected.size());
  auto r = std::make_shared<rendezvous>(executor, std::move(secret), timeout, wire, std::move(expected), who,
                                        std::move(welcome));
  asio::co_spawn(executor, accept_loop(r, acceptor), asio::detached);
  // One deadline for the whole rendezvous: a worker that never comes is an error
  // naming how many did.
  const auto give_up = clock_type::now() + timeout;
  std::exception_ptr failure;
  try {
    while (static_cast<int>(r->joined.size()) < workers) {
      if (!r->accepting) throw_error(errc::cancelled, who + ": shut down while waiting for workers");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - clock_type::now());
      bool expired = left.count() <= 0;
      if (!expired) {
        r->changed.reset();
        try {
          co_await async::with_deadline(r->changed.wait(), left, who + ": waiting for workers");
        } catch (const error& e) {
          if (e.kind() != errc::timeout) throw;
          expired = true;
        }
      }
      if (expired && static_cast<int>(r->joined.size()) < workers) {
        std::string have;
        for (const auto& m : r->joined) have += (have.empty() ? "" : ", ") + std::to_string(m.rank);
        throw_error(errc::timeout, who + ": " + std::to_string(r->joined.size()) + " of " + std::to_string(workers) +
                                       " workers connected within " + std::to_string(timeout.count()) +
                                       " ms (ranks: " + (have.empty() ? "none" : have) + ")" +
                                       (r->last_refusal.empty() ? "" : "; last refused: " + r->last_refusal));
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // Stop accepting; handshakes still running are cut off.
  r->done = true;
  std::error_code ignored;
  if (r->accepting) acceptor.cancel(ignored);
  for (auto& weak : r->pending)
    if (auto s = weak.lock();
        s && std::none_of(r->joined.begin(), r->joined.end(), [&s](const member& m) { return m.socket == s; }))
      s->close(ignored);
  if (failure) {
    for (auto& m : r->joined) m.socket->close(ignored);
    std::rethrow_exception(failure);
  }
  std::sort(r->joined.begin(), r->joined.end(), [](const member& a, const member& b) { return a.rank < b.rank; });
  co_return std::move(r->joined);
}

asio::awaitable<joined> join(std::string address, std::uint16_t port, int rank, wire_params wire, std::string secret,
                             std::chrono::milliseconds timeout, std::string who, relay_listener relay) {
  auto socket = co_await net::connect_with_retry(address, port, timeout, who + ": connecting to the trainer");
  // No weight byte is accepted from a trainer that has not proved the secret.
  co_await auth::as_client(socket, secret, timeout, who + ": trainer " + address + ":" + std::to_string(port));
  wire::hello hello;
  if (relay) {
    // Where this worker's downstream workers will connect: the interface it
    // reaches the trainer through.
    std::error_code ec;
    const auto local = socket.local_endpoint(ec);
    if (ec) throw_error(errc::io_error, who + ": no local address to relay on: " + ec.message());
    hello.relay_port = relay(local.address());
  }
  hello.rank = static_cast<std::uint32_t>(rank);
  hello.num_buffers = wire.num_buffers;
  hello.buffer_bytes = wire.buffer_bytes;
  hello.flags = wire.checksums ? wire::flag_checksum : 0;
  auto raw = wire::encode(hello);
  co_await net::write_all(socket, asio::buffer(raw), timeout, who + ": hello");
  auto welcome = co_await read_status(socket, timeout, who + ": waiting for the trainer's welcome");
  throw_if_failed(welcome, who + ": the trainer refused this worker");
  co_return joined{std::move(socket), std::move(welcome.message)};
}

std::array<std::byte, 48> update_header(std::uint64_t seq, const update_metadata& meta, const bucket_plan& plan) {
  return update_header(seq, meta.tensors.size(), metadata_digest(meta), plan.buckets.size(), plan.payload_bytes);
}

std::array<std::byte, 48> update_header(std::uint64_t seq, std::uint64_t tensors, std::uint64_t digest,
                                        std::uint64_t buckets, std::uint64_t payload_bytes) {
  wire::update u;
  u.seq = seq;
  u.digest = digest;
  u.tensors = tensors;
  u.buckets = buckets;
  u.payload_bytes = payload_bytes;
  return wire::encode(u);
}

asio::awaitable<void> announce_update(asio::ip::tcp::socket& socket, const std::array<std::byte, 48>& header,
                                      std::chrono::milliseconds timeout, std::string who) {
  const auto seq = wire::decode<wire::update>(header).seq;
  co_await net::write_all(socket, asio::buffer(header), timeout, who + ": update header");
  throw_if_failed(
      co_await read_status(socket, timeout, who + ": waiting for the worker to accept update " + std::to_string(seq)),
      who + " refused the update");
}

asio::awaitable<std::uint64_t> accept_update(asio::ip::tcp::socket& socket, std::uint64_t last_seq,
                                             const update_metadata& meta, const bucket_plan& plan,
                                             std::chrono::milliseconds timeout, std::string who,
                                             std::optional<wire::delta_header>* delta) {
  std::array<std::byte, sizeof(wire::update)> raw;
  co_await net::read_exact(socket, asio::buffer(raw), timeout, who + ": waiting for the update header");
  auto u = wire::decode<wire::update>(raw);
  if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, who + ": " + bad);
  const wire::update_expectation expected{last_seq, meta.tensors.size(), metadata_digest(meta), plan.buckets.size(),
                                          plan.payload_bytes};
  std::string mismatch = wire::check_update_header(u, expected);
  if (delta && (u.flags & wire::update_flag_delta) != 0) {
    // A delta header follows (docs/delta.md).
    std::array<std::byte, sizeof(wire::delta_header)> raw_delta;
    co_await net::read_exact(socket, asio::buffer(raw_delta), timeout, who + ": reading the delta header");
    *delta = wire::decode<wire::delta_header>(raw_delta);
    if (mismatch.empty()) mismatch = wire::check_delta_header(**delta);
    u.flags &= ~wire::update_flag_delta;
  }
  if (mismatch.empty() && u.flags != 0)
    mismatch = (u.flags & wire::update_flag_delta) != 0
                   ? "the trainer sends a delta update; this engine takes full updates only"
                   : "unknown update flags " + std::to_string(u.flags);
  if (!mismatch.empty()) {
    co_await send_status(socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, mismatch, timeout,
                         who + ": refusing the update");
    throw_error(errc::protocol_error, who + ": " + mismatch);
  }
  co_await send_status(socket, 0, u.seq, {}, timeout, who + ": accepting the update");
  co_return u.seq;
}

asio::awaitable<void> refuse_update(std::shared_ptr<asio::ip::tcp::socket> socket, std::uint64_t seq, errc kind,
                                    std::string reason, std::chrono::milliseconds linger, std::string who) {
  std::error_code ignored;
  try {
    co_await send_status(*socket, static_cast<std::uint32_t>(kind), seq, reason, linger, who + ": refusing the update");
    socket->shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
    std::array<std::byte, 64 << 10> sink;
    const auto until = std::chrono::steady_clock::now() + linger;
    for (;;) {  // until the trainer closes (it fails on the status) or the linger ends
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      co_await async::with_deadline(socket->async_read_some(asio::buffer(sink), asio::use_awaitable), left,
                                    who + ": draining after a refusal");
    }
  } catch (const std::exception&) {  // closed, reset or timed out: done either way
  }
  net::close(*socket);
}

asio::awaitable<void> confirm_update(asio::ip::tcp::socket& socket, std::uint64_t seq,
                                     std::chrono::milliseconds timeout, std::string who) {
  co_await send_status(socket, 0, seq, {}, timeout, who + ": confirming the update");
}

asio::awaitable<void> await_confirmation(asio::ip::tcp::socket& socket, std::uint64_t seq,
                                         std::chrono::milliseconds timeout, std::string who) {
  throw_if_failed(
      co_await read_status(socket, timeout, who + ": waiting for the worker to confirm update " + std::to_string(seq)),
      who + " failed the update");
}

}  // namespace refit::links
