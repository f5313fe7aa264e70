// The TCP trainer: accept the workers, then stream each update to all of them at
// once with gather writes straight from the trainer's tensors.
#include <thread>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>

#include "engines/tcp/status_io.h"
#include "engines/tcp/tcp.h"
#include "engines/tcp/wire.h"
#include "lib/async/all_of.h"
#include "lib/async/deadline.h"
#include "lib/async/event.h"
#include "lib/auth.h"
#include "lib/checksum.h"
#include "lib/net.h"
#include "lib/send_cursor.h"

namespace refit::tcp {

namespace {
using clock_type = std::chrono::steady_clock;

std::string rank_name(int rank) { return "tcp trainer: worker rank " + std::to_string(rank); }
}  // namespace

sender::sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sender::~sender() {
  shutdown();
  // Let the queued closes run on their strands before the pool goes away.
  if (io_pool_) io_pool_->join();
}

json sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "tcp trainer_args");
  address_ = r.required<std::string>("master_address");
  auto port = r.required<std::uint16_t>("master_port");
  world_size_ = r.required<int>("world_size");
  if (world_size_ < 2)
    r.fail("member 'world_size' must be at least 2 (the trainer and one worker), got " +
           std::to_string(world_size_));
  wire_ = wire_params::read(r);
  auto ms = r.optional<std::int64_t>("timeout_ms", config_.timeout.count());
  if (ms <= 0) r.fail("member 'timeout_ms' must be positive, got " + std::to_string(ms));
  timeout_ = std::chrono::milliseconds(ms);
  r.finish();
  shutdown();
  if (!io_pool_) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    io_pool_ = std::make_unique<asio::thread_pool>(std::min<unsigned>(cores, static_cast<unsigned>(world_size_ - 1)));
  }
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, address_, port));
  return worker_init_info();
}

json sender::worker_init_info() const {
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, "tcp trainer: worker_init_info before listen");
  json j = {{"master_address", address_},
            {"master_port", acceptor_->local_endpoint().port()},
            {"rank_offset", 1},
            {"world_size", world_size_},
            {"timeout_ms", timeout_.count()}};
  wire_.write(j);
  return j;
}

// What the handshakes of one rendezvous share. They run concurrently on the
// trainer's executor, so a slow or silent connection delays nobody; they touch
// only this (never the sender, which may be gone when a cancelled one resumes).
struct sender::rendezvous {
  rendezvous(asio::any_io_executor ex, std::string secret, std::chrono::milliseconds timeout, wire_params wire,
             int world_size)
      : executor(ex), secret(std::move(secret)), timeout(timeout), wire(wire), world_size(world_size), changed(ex) {}
  asio::any_io_executor executor;
  std::string secret;
  std::chrono::milliseconds timeout;
  wire_params wire;
  int world_size;
  std::vector<std::pair<int, std::shared_ptr<asio::ip::tcp::socket>>> joined;  // welcomed
  std::vector<int> claimed;                                                    // welcomed or being welcomed
  std::vector<std::weak_ptr<asio::ip::tcp::socket>> pending;
  std::string last_refusal;
  async::event changed;  // a worker joined or accepting stopped
  bool done = false, accepting = true;
};

asio::awaitable<void> sender::accept_loop(std::shared_ptr<rendezvous> r, asio::ip::tcp::acceptor& acceptor) {
  while (!r->done) {
    auto socket = std::make_shared<asio::ip::tcp::socket>(r->executor);
    std::error_code ec;
    co_await acceptor.async_accept(*socket, asio::redirect_error(asio::use_awaitable, ec));
    if (r->done) break;  // the acceptor may be gone: touch nothing of it
    if (ec) {
      if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor) break;
      continue;  // e.g. out of descriptors: keep accepting
    }
    net::tune(*socket);
    r->pending.push_back(socket);
    asio::co_spawn(r->executor, handshake(r, socket), asio::detached);
  }
  r->accepting = false;
  r->changed.set();
}

asio::awaitable<void> sender::handshake(std::shared_ptr<rendezvous> r, std::shared_ptr<asio::ip::tcp::socket> socket) {
  // A connection that fails authentication or its hello is refused and the
  // trainer keeps waiting: a stray or hostile peer cannot end the rendezvous.
  std::string from = "?";
  {
    std::error_code ec;
    auto ep = socket->remote_endpoint(ec);
    if (!ec) from = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  std::array<std::byte, sizeof(wire::hello)> raw;
  std::string failure;
  try {
    co_await auth::as_server(*socket, r->secret, r->timeout, "tcp trainer: connection from " + from);
    co_await net::read_exact(*socket, asio::buffer(raw), r->timeout, "tcp trainer: reading the hello of " + from);
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
    refusal = "not a refit tcp worker (bad magic)";
    code = errc::protocol_error;
  } else if (h.version != wire::protocol_version) {
    refusal = "protocol version " + std::to_string(h.version) + ", trainer speaks " +
              std::to_string(wire::protocol_version);
    code = errc::protocol_error;
  } else if (h.rank < 1 || h.rank >= static_cast<std::uint32_t>(r->world_size)) {
    refusal = "rank " + std::to_string(h.rank) + " outside [1, " + std::to_string(r->world_size) + ")";
  } else if (h.buffer_bytes != r->wire.buffer_bytes || h.num_buffers != r->wire.num_buffers ||
             ((h.flags & wire::flag_checksum) != 0) != r->wire.checksums) {
    refusal = "wire parameters differ: worker has buffer_bytes " + std::to_string(h.buffer_bytes) + " x " +
              std::to_string(h.num_buffers) + (h.flags & wire::flag_checksum ? " with" : " without") +
              " checksums, trainer " + std::to_string(r->wire.buffer_bytes) + " x " +
              std::to_string(r->wire.num_buffers) + (r->wire.checksums ? " with" : " without") + " checksums";
  } else if (std::find(r->claimed.begin(), r->claimed.end(), static_cast<int>(h.rank)) != r->claimed.end()) {
    refusal = "rank " + std::to_string(h.rank) + " is already connected";
  }
  if (!refusal.empty()) {
    // The refused worker gets the reason; the trainer keeps waiting for valid ones.
    r->last_refusal = from + ": " + refusal;
    try {
      co_await send_status(*socket, static_cast<std::uint32_t>(code), 0, refusal, r->timeout,
                           "tcp trainer: refusing a worker");
    } catch (const error&) {
    }
    co_return;
  }
  const int rank = static_cast<int>(h.rank);
  r->claimed.push_back(rank);
  try {
    co_await send_status(*socket, 0, 0, {}, r->timeout, rank_name(rank) + ": welcome");
  } catch (const error& e) {
    std::erase(r->claimed, rank);
    if (!r->done) r->last_refusal = from + ": " + std::string(errc_name(e.kind())) + ": " + e.message();
    co_return;
  }
  if (r->done) co_return;
  r->joined.emplace_back(rank, socket);
  r->changed.set();
}

asio::awaitable<void> sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, "tcp trainer: connect_workers before prepare");
  const int workers = world_size_ - 1;
  fail_all();
  auto r = std::make_shared<rendezvous>(context_.executor, config_.auth_secret, timeout_, wire_, world_size_);
  asio::co_spawn(context_.executor, accept_loop(r, *acceptor_), asio::detached);
  // One deadline for the whole rendezvous: a worker that never comes is an error
  // naming how many did.
  const auto give_up = clock_type::now() + timeout_;
  std::exception_ptr failure;
  try {
    while (static_cast<int>(r->joined.size()) < workers) {
      if (!r->accepting) throw_error(errc::cancelled, "tcp trainer: shut down while waiting for workers");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - clock_type::now());
      bool expired = left.count() <= 0;
      if (!expired) {
        r->changed.reset();
        try {
          co_await async::with_deadline(r->changed.wait(), left, "tcp trainer: waiting for workers");
        } catch (const error& e) {
          if (e.kind() != errc::timeout) throw;
          expired = true;
        }
      }
      if (expired && static_cast<int>(r->joined.size()) < workers) {
        std::string have;
        for (const auto& [rank, socket] : r->joined) have += (have.empty() ? "" : ", ") + std::to_string(rank);
        throw_error(errc::timeout, "tcp trainer: " + std::to_string(r->joined.size()) + " of " +
                                       std::to_string(workers) + " workers connected within " +
                                       std::to_string(timeout_.count()) + " ms (ranks: " +
                                       (have.empty() ? "none" : have) + ")" +
                                       (r->last_refusal.empty() ? "" : "; last refused: " + r->last_refusal));
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // Stop accepting; handshakes still running are cut off.
  r->done = true;
  std::error_code ignored;
  if (acceptor_) acceptor_->cancel(ignored);
  for (auto& weak : r->pending)
    if (auto s = weak.lock(); s && std::none_of(r->joined.begin(), r->joined.end(),
                                                [&s](const auto& j) { return j.second == s; }))
      s->close(ignored);
  if (failure) {
    for (auto& [rank, socket] : r->joined) socket->close(ignored);
    std::rethrow_exception(failure);
  }
  // Each worker's socket moves to its own strand of the I/O pool, where its
  // streams run.
  for (auto& [rank, socket] : r->joined) {
    auto strand = asio::make_strand(io_pool_->get_executor());
    const auto protocol = socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, socket->release());
    peers_.push_back(std::make_shared<peer>(peer{rank, strand, std::move(moved)}));
  }
  seq_ = 0;
}

void sender::fail_all() {
  // Closing every connection makes every worker fail fast with peer_lost instead
  // of waiting out its deadline. A socket is only touched on its own strand (a send
  // may be writing to it right now, from a pool thread); the closure keeps the peer
  // alive until it has run.
  for (auto& p : peers_)
    asio::post(p->strand, [p] {
      std::error_code ignored;
      p->socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
      p->socket.close(ignored);
    });
  peers_.clear();
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  if (peers_.empty())
    throw_error(errc::invalid_state, "tcp trainer: send_weights before init (or after a failed update; "
                                     "call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  const bucket_plan plan = plan_buckets(declared, wire_);
  const std::uint64_t seq = ++seq_;

  try {
    // Walk (and check) every tensor the source yields before any byte leaves: a
    // divergent or extra tensor fails the update while workers have nothing of it.
    stream s;
    wire::update u;
    u.seq = seq;
    u.digest = metadata_digest(declared);
    u.tensors = declared.tensors.size();
    u.buckets = plan.buckets.size();
    u.payload_bytes = plan.payload_bytes;
    s.update = wire::encode(u);
    s.seq = seq;
    s.headers.resize(plan.buckets.size());
    s.buckets.resize(plan.buckets.size());
    send_cursor cursor(declared, plan, source);
    for (const bucket& b : plan.buckets) {
      wire::bucket_header h;
      h.index = b.index;
      h.payload_bytes = b.payload_bytes;
      const auto& payload = cursor.gather(b);
      if (wire_.checksums) {
        h.flags |= wire::flag_checksum;
        h.checksum = checksum(payload);
      }
      s.headers[b.index] = wire::encode(h);
      auto& buffers = s.buckets[b.index];
      buffers.push_back(asio::buffer(s.headers[b.index]));
      buffers.insert(buffers.end(), payload.begin(), payload.end());
    }
    cursor.finish();

    // Each worker's stream runs on its own strand of the I/O pool, at its own pace:
    // with several workers the kernel copies run on several cores, and a slow
    // worker does not stall the others bucket by bucket.
    std::vector<asio::awaitable<void>> streams;
    for (auto& p : peers_)
      streams.push_back(asio::co_spawn(p->strand, stream_to(p, s), asio::use_awaitable));
    co_await async::all_of(std::move(streams));
  } catch (...) {
    fail_all();
    throw;
  }
  stats_.bytes = plan.tensor_bytes;
  stats_.buckets = plan.buckets.size();
  stats_.tensors = declared.tensors.size();
  stats_.wall_s = std::chrono::duration<double>(clock_type::now() - start).count();
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

asio::awaitable<void> sender::stream_to(std::shared_ptr<peer> keep, const stream& s) {
  peer& p = *keep;
  const std::string who = rank_name(p.rank);
  co_await net::write_all(p.socket, asio::buffer(s.update), timeout_, who + ": update header");
  throw_if_failed(co_await read_status(p.socket, timeout_,
                                       who + ": waiting for the worker to accept update " + std::to_string(s.seq)),
                  who + " refused the update");
  for (std::size_t i = 0; i < s.buckets.size(); ++i)
    co_await net::write_all(p.socket, s.buckets[i], timeout_, who + ": bucket " + std::to_string(i));
  throw_if_failed(co_await read_status(p.socket, timeout_,
                                       who + ": waiting for the worker to confirm update " + std::to_string(s.seq)),
                  who + " failed the update");
}

void sender::shutdown() {
  fail_all();
  // Closed, not destroyed: a coroutine still waiting in accept wakes up cancelled and
  // finds a closed acceptor rather than freed memory.
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

}  // namespace refit::tcp
