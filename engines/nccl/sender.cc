// The NCCL trainer: rendezvous over the side channel (welcoming every worker with
// the communicator id), then per update: announce the header to every worker, pack
// each bucket into a rotating buffer and broadcast it, and collect confirmations.
#include <asio/co_spawn.hpp>
#include <asio/use_awaitable.hpp>

#include "engines/nccl/nccl.h"
#include "lib/async/all_of.h"
#include "lib/net.h"
#include "lib/send_cursor.h"

namespace refit::nccl {

namespace {
using clock_type = std::chrono::steady_clock;
std::string rank_name(int rank) { return "nccl trainer: worker rank " + std::to_string(rank); }
}  // namespace

sender::sender(const weight_transfer_config& config, const trainer_context& context,
               std::shared_ptr<collective_provider> provider)
    : config_(config), context_(context), provider_(std::move(provider)) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
  if (!provider_) throw_error(errc::invalid_argument, "nccl trainer: a collective provider is required");
}

sender::~sender() { shutdown(); }

json sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "nccl trainer_args");
  auto args = group::trainer_args::read(r, config_.timeout);
  r.finish();
  if (args.wire.checksums)
    throw_error(errc::invalid_argument,
                "nccl trainer_args: member 'checksums' is not supported by nccl (a collective has no byte stream "
                "to checksum)");
  shutdown();
  args_ = args;
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, args_.address, args_.port));
  group_id_ = provider_->new_group_id();
  if (!pack_ || pack_->slot_count() != args_.wire.num_buffers || pack_->slot(0).size() != args_.wire.buffer_bytes)
    pack_ = provider_->make_staging(args_.wire.num_buffers, args_.wire.buffer_bytes);
  return group::worker_init_info(args_, acceptor_->local_endpoint().port());
}

asio::awaitable<void> sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "nccl trainer: connect_workers before prepare");
  fail_all();
  peers_ = co_await group::accept_workers(*acceptor_, context_.executor, config_.auth_secret, args_.timeout,
                                          args_.wire, args_.world_size, "nccl trainer", group_id_);
  try {
    comm_ = co_await provider_->join(group_id_, 0, args_.world_size, context_.executor, args_.timeout);
  } catch (...) {
    fail_all();
    throw;
  }
  seq_ = 0;
}

void sender::fail_all() {
  if (comm_) {
    comm_->abort();
    comm_.reset();
  }
  std::error_code ignored;
  for (auto& p : peers_) {
    p.socket->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    p.socket->close(ignored);
  }
  peers_.clear();
}

namespace {
asio::awaitable<void> announce(std::shared_ptr<asio::ip::tcp::socket> s, const std::array<std::byte, 48>& header,
                               std::chrono::milliseconds timeout, int rank) {
  co_await group::announce_update(*s, header, timeout, rank_name(rank));
}
asio::awaitable<void> confirmation(std::shared_ptr<asio::ip::tcp::socket> s, std::uint64_t seq,
                                   std::chrono::milliseconds timeout, int rank) {
  co_await group::await_confirmation(*s, seq, timeout, rank_name(rank));
}
}  // namespace

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  if (peers_.empty() || !comm_)
    throw_error(errc::invalid_state, "nccl trainer: send_weights before init (or after a failed update; "
                                     "call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  const bucket_plan plan = plan_buckets(declared, args_.wire);
  const std::uint64_t seq = ++seq_;
  // Kept for the whole send: shutdown() may abort it meanwhile (then every
  // broadcast fails), but never frees it under us.
  const std::shared_ptr<collective> comm = comm_;
  const std::vector<group::member> peers = peers_;
  try {
    const auto header = group::update_header(seq, declared, plan);
    {
      std::vector<asio::awaitable<void>> ops;
      for (auto& p : peers) ops.push_back(announce(p.socket, header, args_.timeout, p.rank));
      co_await async::all_of(std::move(ops));
    }
    // Buckets go out in plan order; each is packed into the next rotating buffer.
    // A divergent tensor fails the update here; the abort below makes every worker
    // fail too rather than wait for a broadcast that never comes.
    send_cursor cursor(declared, plan, source, provider_->device_sources());
    for (const bucket& b : plan.buckets) {
      const auto& pieces = cursor.gather(b);
      std::byte* buffer = pack_->slot(b.index % pack_->slot_count()).data();
      co_await provider_->pack(pieces, buffer);
      try {
        co_await comm->broadcast(buffer, b.payload_bytes, args_.timeout);
      } catch (const error& e) {
        throw error(e.code(), "nccl trainer: bucket " + std::to_string(b.index) + ": " + e.message());
      }
    }
    cursor.finish();
    std::vector<asio::awaitable<void>> ops;
    for (auto& p : peers) ops.push_back(confirmation(p.socket, seq, args_.timeout, p.rank));
    co_await async::all_of(std::move(ops));
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

void sender::shutdown() {
  fail_all();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

}  // namespace refit::nccl
