// The CUDA IPC worker: per bucket, read which exported buffer holds it, map that
// buffer once (cached), copy the bucket into a staging slot and tell the trainer
// the buffer is consumed; processing overlaps the next hand-over.
#include "engines/cuda_ipc/cuda_ipc.h"
#include "engines/cuda_ipc/wire.h"
#include "lib/group/status_io.h"
#include "lib/net.h"

namespace refit::cuda_ipc {

std::byte* handle_cache::get(const handle_bytes& handle, const gpu_uuid& gpu) {
  auto key = std::make_pair(handle, gpu);
  if (auto it = mapped_.find(key); it != mapped_.end()) return it->second;
  std::byte* p = provider_->open(handle, gpu);
  ++opens_;
  mapped_.emplace(key, p);
  return p;
}

void handle_cache::clear() noexcept {
  for (auto& [key, p] : mapped_) provider_->close(p);
  mapped_.clear();
}

init_info init_info::read(json_reader& r) {
  init_info info;
  static_cast<group::join_info&>(info) = group::join_info::read(r);
  if (info.wire.checksums)
    r.fail("member 'checksums' is not supported by cuda_ipc (the bytes never leave the GPU's memory)");
  return info;
}

namespace {

class transport final : public bucket_transport {
 public:
  transport(asio::ip::tcp::socket& s, handle_cache& handles, ipc_provider& provider, std::uint32_t buffers,
            std::chrono::milliseconds timeout, int rank)
      : socket_(s), handles_(handles), provider_(provider), buffers_(buffers), timeout_(timeout), rank_(rank) {}

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = "cuda_ipc worker rank " + std::to_string(rank_) + ": bucket " + std::to_string(b.index);
    std::array<std::byte, sizeof(wire::chunk)> raw;
    co_await net::read_exact(socket_, asio::buffer(raw), timeout_, what + " hand-over");
    wire::chunk c;
    std::memcpy(&c, raw.data(), sizeof c);
    if (auto bad = wire::check_chunk(c, b.index, b.payload_bytes, buffers_); !bad.empty())
      throw_error(errc::protocol_error, what + ": " + bad);
    std::byte* src = nullptr;
    try {
      src = handles_.get(c.handle, c.gpu);
    } catch (const error& e) {
      throw error(e.code(), what + ": cannot map the trainer's buffer " + std::to_string(c.buffer) + ": " + e.message());
    }
    for (const auto& d : dest) {
      co_await provider_.copy(static_cast<std::byte*>(d.data()), src, d.size());
      src += d.size();
    }
    // Consumed: the trainer may overwrite that buffer now.
    co_await group::send_status(socket_, 0, b.index, {}, timeout_, what + ": consumed");
  }

 private:
  asio::ip::tcp::socket& socket_;
  handle_cache& handles_;
  ipc_provider& provider_;
  std::uint32_t buffers_;
  std::chrono::milliseconds timeout_;
  int rank_;
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context,
               std::shared_ptr<ipc_provider> provider)
    : typed_engine(config, context), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "cuda_ipc engine: an ipc provider is required");
  handles_ = std::make_unique<handle_cache>(provider_);
}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = group::worker_rank(info, context().ranks, "cuda_ipc");
  const std::string who = "cuda_ipc worker rank " + std::to_string(rank_);
  auto joined = co_await group::join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret,
                                     timeout_, who);
  if (!pipeline_ || !(pipeline_->params() == info.wire))
    pipeline_ = std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire,
                                                   provider_->make_staging(info.wire.num_buffers, info.wire.buffer_bytes));
  socket_ = std::make_unique<asio::ip::tcp::socket>(std::move(joined.socket));
  last_seq_ = 0;
}

asio::awaitable<void> engine::receive(const update_info& info, load_weights_fn load_weights) {
  const std::string who = "cuda_ipc worker rank " + std::to_string(rank_);
  if (!socket_)
    throw_error(errc::invalid_state, who + ": the connection to the trainer was closed by an earlier failure; "
                                           "call init_transfer_engine again");
  std::exception_ptr failure;
  try {
    bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
    last_seq_ = co_await group::accept_update(*socket_, last_seq_, info.metadata, plan, timeout_, who);
    transport t(*socket_, *handles_, *provider_, pipeline_->params().num_buffers, timeout_, rank_);
    co_await pipeline_->receive(info.metadata, std::move(plan), t, provider_->processing(std::move(load_weights)),
                                deferred(), mutable_stats(), nullptr);
    co_await group::confirm_update(*socket_, last_seq_, timeout_, who);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    do_shutdown();
    std::rethrow_exception(failure);
  }
}

void engine::do_session_finished() { handles_->clear(); }

void engine::do_shutdown() {
  if (handles_) handles_->clear();
  if (socket_) {
    std::error_code ignored;
    socket_->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    socket_->close(ignored);
    socket_.reset();
  }
}

}  // namespace refit::cuda_ipc
