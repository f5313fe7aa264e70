// The NCCL trainer: rendezvous over the side channel (welcoming every worker with
// the communicator id), then per update: announce the header to every worker, pack
// each bucket into a rotating buffer and broadcast it, and collect confirmations.
#include "engines/nccl/nccl.h"
#include "lib/send_cursor.h"

namespace refit::nccl {

sender::sender(const weight_transfer_config& config, const trainer_context& context,
               std::shared_ptr<collective_provider> provider)
    : sender_base(config, context), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "nccl trainer: a collective provider is required");
}

void sender::prepared() {
  group_id_ = provider_->new_group_id();
  if (!pack_ || pack_->slot_count() != args_.wire.num_buffers || pack_->slot(0).size() != args_.wire.buffer_bytes)
    pack_ = provider_->make_staging(args_.wire.num_buffers, args_.wire.buffer_bytes);
}

asio::awaitable<void> sender::connected() {
  comm_ = co_await provider_->join(group_id_, 0, args_.world_size, context_.executor, args_.timeout);
}

void sender::close_transport() noexcept {
  if (comm_) {
    comm_->abort();
    comm_.reset();
  }
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  // Kept for the whole send: shutdown() may abort it meanwhile (then every
  // broadcast fails), but never frees it under us.
  const std::shared_ptr<collective> comm = comm_;
  const std::vector<group::member> peers = peers_;
  try {
    if (!comm) throw_error(errc::invalid_state, "nccl trainer: no communicator; call init again");
    co_await announce_all(peers, group::update_header(seq, declared, plan));
    // Buckets go out in plan order; each is packed into the next rotating buffer.
    // A divergent tensor fails the update here; the abort below makes every worker
    // fail too rather than wait for a broadcast that never comes.
    send_cursor cursor(declared, plan, source, provider_->device_sources());
    for (const bucket& b : plan.buckets) {
      std::byte* buffer = pack_->slot(b.index % pack_->slot_count()).data();
      co_await provider_->pack(cursor.gather(b), buffer);
      try {
        co_await comm->broadcast(buffer, b.payload_bytes, args_.timeout);
      } catch (const error& e) {
        throw error(e.code(), "nccl trainer: bucket " + std::to_string(b.index) + ": " + e.message());
      }
    }
    cursor.finish();
    co_await confirm_all(peers, seq);
  } catch (...) {
    close();
    throw;
  }
  end_update(declared, plan, start);
}

}  // namespace refit::nccl
