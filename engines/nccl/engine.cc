// The NCCL worker: join through the side channel (which brings the communicator
// id), join the communicator, then per update check the trainer's header against
// this worker's own plan and receive every bucket by broadcast into a staging slot.
#include "engines/nccl/nccl.h"

namespace refit::nccl {

init_info init_info::read(json_reader& r) {
  init_info info;
  static_cast<group::join_info&>(info) = group::join_info::read(r);
  if (info.wire.checksums)
    r.fail("member 'checksums' is not supported by nccl (a collective has no byte stream to checksum)");
  return info;
}

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
    : typed_engine(config, context), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "nccl engine: a collective provider is required");
}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = group::worker_rank(info, context().ranks, "nccl");
  const std::string who = "nccl worker rank " + std::to_string(rank_);
  auto joined = co_await group::join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret,
                                     timeout_, who);
  if (joined.welcome.empty())
    throw_error(errc::protocol_error, who + ": the trainer's welcome carries no communicator id");
  auto socket = std::make_unique<asio::ip::tcp::socket>(std::move(joined.socket));
  comm_ = co_await provider_->join(joined.welcome, rank_, info.world_size, context().executor, timeout_);
  // Staging is allocated once here and reused by every update.
  if (!pipeline_ || !(pipeline_->params() == info.wire))
    pipeline_ = std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire,
                                                   provider_->make_staging(info.wire.num_buffers, info.wire.buffer_bytes));
  socket_ = std::move(socket);
  last_seq_ = 0;
}

asio::awaitable<void> engine::receive(const update_info& info, load_weights_fn load_weights) {
  const std::string who = "nccl worker rank " + std::to_string(rank_);
  if (!socket_ || !comm_)
    throw_error(errc::invalid_state, who + ": the connection to the trainer was closed by an earlier failure; "
                                           "call init_transfer_engine again");
  std::exception_ptr failure;
  try {
    bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
    last_seq_ = co_await group::accept_update(*socket_, last_seq_, info.metadata, plan, timeout_, who);
    transport t(comm_, timeout_, rank_);
    // No direct receive: a broadcast lands in one contiguous buffer per bucket.
    co_await pipeline_->receive(info.metadata, std::move(plan), t, provider_->processing(std::move(load_weights)),
                                deferred(), mutable_stats(), nullptr);
    co_await group::confirm_update(*socket_, last_seq_, timeout_, who);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // The communicator's position is unknown after a failure: abort it (the
    // trainer and the other workers fail too instead of hanging) and re-init.
    do_shutdown();
    std::rethrow_exception(failure);
  }
}

void engine::do_shutdown() {
  if (comm_) {
    comm_->abort();
    comm_.reset();
  }
  if (socket_) {
    std::error_code ignored;
    socket_->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    socket_->close(ignored);
    socket_.reset();
  }
}

}  // namespace refit::nccl
