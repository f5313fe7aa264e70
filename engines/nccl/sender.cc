// The NCCL trainer: rendezvous over the side channel (welcoming every worker with
// the communicator id), then per update: announce the header to every worker, pack
// each bucket into a rotating buffer and broadcast it, and collect confirmations.
#include <refit/backend/async/all_of.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/nccl/nccl.h>

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
    aborting_ = std::move(comm_);
  }
}

asio::awaitable<void> sender::transport_closed() {
  if (auto c = std::move(aborting_)) co_await c->aborted();
}

namespace {
asio::awaitable<void> broadcast_bucket(std::shared_ptr<collective> comm, std::byte* buffer, const bucket& b,
                                       std::chrono::milliseconds timeout) {
  try {
    co_await comm->broadcast(buffer, b.payload_bytes, timeout);
  } catch (const error& e) {
    throw error(e.code(), "nccl trainer: bucket " + std::to_string(b.index) + ": " + e.message());
  }
}
}  // namespace

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const void* producer = take_producer_stream();  // this send's, whatever becomes of it
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  // Kept for the whole send: shutdown() may abort it meanwhile (then every
  // broadcast fails), but never frees it under us.
  const std::shared_ptr<collective> comm = comm_;
  const std::vector<links::member> peers = peers_;
  std::exception_ptr failure;
  try {
    if (!comm) throw_error(errc::invalid_state, "nccl trainer: no communicator; call init again");
    co_await announce_all(peers, links::update_header(seq, declared, plan));
    // Buckets go out in plan order, each packed into the next rotating buffer. A
    // divergent tensor fails the update while packing; the abort below makes every
    // worker fail too rather than wait for a broadcast that never comes.
    send_cursor cursor(declared, plan, source, provider_->device_sources());
    provider_->order_after(producer);
    const std::size_t n = pack_->slot_count();
    auto buffer_of = [&](const bucket& b) { return pack_->slot(b.index % n).data(); };
    const auto& buckets = plan.buckets;
    if (!buckets.empty()) co_await provider_->pack(cursor.gather(buckets[0]), buffer_of(buckets[0]));
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      // Bucket k+1 is packed while bucket k is broadcast: its buffer last held
      // bucket k+1-n, whose broadcast has completed (n >= 2). With one buffer they
      // take turns.
      std::vector<asio::awaitable<void>> ops;
      ops.push_back(broadcast_bucket(comm, buffer_of(buckets[k]), buckets[k], args_.timeout));
      const bool next = k + 1 < buckets.size();
      if (next && n >= 2) ops.push_back(provider_->pack(cursor.gather(buckets[k + 1]), buffer_of(buckets[k + 1])));
      co_await async::all_of(std::move(ops));
      if (next && n < 2) co_await provider_->pack(cursor.gather(buckets[k + 1]), buffer_of(buckets[k + 1]));
    }
    cursor.finish();
    co_await confirm_all(peers, seq);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    co_await close_after_failure();
    std::rethrow_exception(failure);
  }
  end_update(declared, plan, start);
}

}  // namespace refit::nccl
