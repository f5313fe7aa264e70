// The NCCL worker: the side channel's welcome brings the communicator id; each
// bucket is one broadcast into a staging slot (the rest is links::worker_engine).
#include <refit/engines/nccl/nccl.h>

namespace refit::nccl {

namespace {

// One bucket: a broadcast from rank 0 into one contiguous range (the slot, or the
// assembly buffer for a piece of a split tensor).
class transport final : public bucket_transport {
 public:
  transport(std::shared_ptr<collective> comm, std::chrono::milliseconds timeout, int rank)
      : comm_(std::move(comm)), timeout_(timeout), rank_(rank) {}
  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = "nccl worker rank " + std::to_string(rank_) + ": bucket " + std::to_string(b.index);
    if (dest.size() != 1 || dest[0].size() != b.payload_bytes)
      throw_error(errc::invalid_state, what + ": a broadcast needs one contiguous destination of the bucket's size");
    try {
      co_await comm_->broadcast(static_cast<std::byte*>(dest[0].data()), b.payload_bytes, timeout_);
    } catch (const error& e) {
      throw error(e.code(), what + ": " + e.message());
    }
  }

 private:
  std::shared_ptr<collective> comm_;
  std::chrono::milliseconds timeout_;
  int rank_;
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context,
               std::shared_ptr<collective_provider> provider)
    : worker_engine(config, context, capabilities_of()), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "nccl engine: a collective provider is required");
}

asio::awaitable<void> engine::joined(const init_info& info, const std::string& welcome) {
  if (welcome.empty()) throw_error(errc::protocol_error, who() + ": the trainer's welcome carries no communicator id");
  comm_ = co_await provider_->join(welcome, rank(), info.world_size, context().executor, timeout());
}

std::unique_ptr<staging_memory> engine::make_staging(const wire_params& wire) {
  return provider_->make_staging(wire.num_buffers, wire.buffer_bytes);
}

std::unique_ptr<bucket_transport> engine::make_transport() {
  if (!comm_) throw_error(errc::invalid_state, who() + ": no communicator; call init_transfer_engine again");
  return std::make_unique<transport>(comm_, timeout(), rank());
}

void engine::close_transport() noexcept {
  if (comm_) {
    comm_->abort();
    aborting_ = std::move(comm_);
  }
}

asio::awaitable<void> engine::transport_closed() {
  if (auto c = std::move(aborting_)) co_await c->aborted();
}

}  // namespace refit::nccl
