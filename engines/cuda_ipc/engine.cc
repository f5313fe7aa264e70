// The CUDA IPC worker: per bucket, read which exported buffer holds it, map that
// buffer once (cached), copy the bucket into a staging slot and tell the trainer
// the buffer is consumed; processing overlaps the next hand-over (the rest is
// links::worker_engine).
#include <refit/backend/async/offload.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/net.h>
#include <refit/engines/cuda_ipc/cuda_ipc.h>
#include "wire.h"  // private to this engine

namespace refit::cuda_ipc {

std::byte* handle_cache::find(const handle_bytes& handle, const gpu_uuid& gpu) noexcept {
  auto it = mapped_.find(std::make_pair(handle, gpu));
  if (it == mapped_.end()) return nullptr;
  it->second.used = session_;
  return it->second.address;
}

std::byte* handle_cache::get(const handle_bytes& handle, const gpu_uuid& gpu) {
  if (std::byte* p = find(handle, gpu)) return p;
  auto key = std::make_pair(handle, gpu);
  std::byte* p = provider_->open(handle, gpu);
  ++opens_;
  mapped_.emplace(key, mapping{p, session_});
  return p;
}

void handle_cache::end_session() noexcept {
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    if (it->second.used != session_) {
      provider_->close(it->second.address);
      it = mapped_.erase(it);
    } else {
      ++it;
    }
  }
  ++session_;
}

void handle_cache::clear() noexcept {
  for (auto& [key, m] : mapped_) provider_->close(m.address);
  mapped_.clear();
}

namespace {

class transport final : public bucket_transport {
 public:
  transport(asio::ip::tcp::socket& s, handle_cache& handles, ipc_provider& provider, asio::any_io_executor pool,
            std::uint32_t buffers, std::chrono::milliseconds timeout, int rank)
      : socket_(s), handles_(handles), provider_(provider), pool_(std::move(pool)), buffers_(buffers),
        timeout_(timeout), rank_(rank) {}

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = "cuda_ipc worker rank " + std::to_string(rank_) + ": bucket " + std::to_string(b.index);
    std::array<std::byte, sizeof(wire::chunk)> raw;
    co_await net::read_exact(socket_, asio::buffer(raw), timeout_, what + " hand-over");
    wire::chunk c;
    std::memcpy(&c, raw.data(), sizeof c);
    if (auto bad = wire::check_chunk(c, b.index, b.payload_bytes, buffers_); !bad.empty())
      throw_error(errc::protocol_error, what + ": " + bad);
    std::byte* src = handles_.find(c.handle, c.gpu);
    try {
      // A buffer not mapped yet is opened on the processing executor: opening takes
      // milliseconds the event loop has no time for.
      if (!src) src = co_await async::offload(pool_, [this, &c] { return handles_.get(c.handle, c.gpu); });
    } catch (const error& e) {
      throw error(e.code(),
                  what + ": cannot map the trainer's buffer " + std::to_string(c.buffer) + ": " + e.message());
    }
    // The bucket is contiguous in the trainer's buffer; the pipeline may scatter it
    // (into the model's own memory).
    std::vector<copy_piece> pieces;
    pieces.reserve(dest.size());
    for (const auto& d : dest) {
      pieces.push_back({src, static_cast<std::byte*>(d.data()), d.size()});
      src += d.size();
    }
    co_await provider_.copy_batch(pieces);
    // Consumed: the trainer may overwrite that buffer now.
    co_await links::send_status(socket_, 0, b.index, {}, timeout_, what + ": consumed");
  }

 private:
  asio::ip::tcp::socket& socket_;
  handle_cache& handles_;
  ipc_provider& provider_;
  asio::any_io_executor pool_;
  std::uint32_t buffers_;
  std::chrono::milliseconds timeout_;
  int rank_;
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context,
               std::shared_ptr<ipc_provider> provider)
    : worker_engine(config, context, capabilities_of()), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "cuda_ipc engine: an ipc provider is required");
  handles_ = std::make_unique<handle_cache>(provider_);
}

std::unique_ptr<bucket_transport> engine::make_transport() {
  return std::make_unique<transport>(side_channel(), *handles_, *provider_, processing_executor(), wire().num_buffers,
                                     timeout(), rank());
}

}  // namespace refit::cuda_ipc
