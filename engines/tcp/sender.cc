// The TCP trainer: accept the workers, then stream each update to all of them at
// once with gather writes straight from the trainer's tensors.
#include <thread>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/use_awaitable.hpp>

#include "engines/tcp/tcp.h"
#include "lib/group/wire.h"
#include "lib/async/all_of.h"
#include "lib/checksum.h"
#include "lib/net.h"
#include "lib/send_cursor.h"

namespace refit::tcp {

namespace wire = group::wire;

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
  const auto args = group::trainer_args::read(r, config_.timeout);
  r.finish();
  args_ = args;
  world_size_ = args.world_size;
  wire_ = args.wire;
  timeout_ = args.timeout;
  shutdown();
  if (!io_pool_) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    io_pool_ = std::make_unique<asio::thread_pool>(std::min<unsigned>(cores, static_cast<unsigned>(world_size_ - 1)));
  }
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, args.address, args.port));
  return worker_init_info();
}

json sender::worker_init_info() const {
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, "tcp trainer: worker_init_info before listen");
  return group::worker_init_info(args_, acceptor_->local_endpoint().port());
}

asio::awaitable<void> sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, "tcp trainer: connect_workers before prepare");
  fail_all();
  auto members = co_await group::accept_workers(*acceptor_, context_.executor, config_.auth_secret, timeout_, wire_,
                                                world_size_, "tcp trainer");
  // Each worker's socket moves to its own strand of the I/O pool, where its
  // streams run.
  for (auto& m : members) {
    auto strand = asio::make_strand(io_pool_->get_executor());
    const auto protocol = m.socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, m.socket->release());
    peers_.push_back(std::make_shared<peer>(peer{m.rank, strand, std::move(moved)}));
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
    s.update = group::update_header(seq, declared, plan);
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
  co_await group::announce_update(p.socket, s.update, timeout_, who);
  for (std::size_t i = 0; i < s.buckets.size(); ++i)
    co_await net::write_all(p.socket, s.buckets[i], timeout_, who + ": bucket " + std::to_string(i));
  co_await group::await_confirmation(p.socket, s.seq, timeout_, who);
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
