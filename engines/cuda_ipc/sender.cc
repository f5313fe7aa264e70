// The CUDA IPC trainer: pack each bucket into one of num_buffers exported buffers,
// tell every worker its handle, and reuse a buffer only after every worker has
// consumed what it last held.
#include <cstring>

#include <refit/backend/async/all_of.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/net.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/cuda_ipc/cuda_ipc.h>
#include "wire.h"  // private to this engine

namespace refit::cuda_ipc {

namespace {
asio::awaitable<void> hand_over(std::shared_ptr<asio::ip::tcp::socket> s,
                                std::array<std::byte, sizeof(wire::chunk)> raw, std::chrono::milliseconds timeout,
                                std::string who, std::uint64_t index) {
  co_await net::write_all(*s, asio::buffer(raw), timeout, who + ": bucket " + std::to_string(index));
}
asio::awaitable<void> consumed(std::shared_ptr<asio::ip::tcp::socket> s, std::chrono::milliseconds timeout,
                               std::string who, std::uint64_t index) {
  auto st = co_await links::read_status(*s, timeout,
                                        who + ": waiting for bucket " + std::to_string(index) + " to be consumed");
  links::throw_if_failed(st, who);
  if (st.seq != index)
    throw_error(errc::protocol_error,
                who + ": consumed bucket " + std::to_string(st.seq) + ", expected " + std::to_string(index));
}
}  // namespace

sender::sender(const weight_transfer_config& config, const trainer_context& context,
               std::shared_ptr<ipc_provider> provider)
    : sender_base(config, context), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "cuda_ipc trainer: an ipc provider is required");
}

void sender::prepared() {
  // The exported buffers live as long as the sender: workers keep their mappings
  // for a session, so a buffer is never freed under them mid-session.
  if (!buffers_ || buffers_->slot_count() != args_.wire.num_buffers ||
      buffers_->slot(0).size() != args_.wire.buffer_bytes)
    buffers_ = provider_->make_exportable(args_.wire.num_buffers, args_.wire.buffer_bytes);
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const void* producer = take_producer_stream();  // this send's, whatever becomes of it
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  const std::vector<links::member> peers = peers_;
  const std::size_t n = buffers_->slot_count();
  // Each buffer's handle (the same allocation always has the same handle).
  std::vector<std::pair<handle_bytes, gpu_uuid>> handles;
  for (std::size_t i = 0; i < n; ++i) handles.push_back(provider_->export_buffer(*buffers_, i));
  auto each = [&peers](auto make) {
    std::vector<asio::awaitable<void>> ops;
    for (const auto& p : peers) ops.push_back(make(p));
    return async::all_of(std::move(ops));
  };
  try {
    co_await announce_all(peers, links::update_header(seq, declared, plan));
    send_cursor cursor(declared, plan, source, provider_->device_sources());
    provider_->order_after(producer);
    for (const bucket& b : plan.buckets) {
      const std::size_t slot = b.index % n;
      // The buffer held bucket b - n: every worker must have consumed it.
      if (b.index >= n) {
        const std::uint64_t old = b.index - n;
        co_await each(
            [&](const links::member& p) { return consumed(p.socket, args_.timeout, rank_name(p.rank), old); });
      }
      co_await provider_->pack(cursor.gather(b), buffers_->slot(slot).data());
      wire::chunk c;
      c.buffer = static_cast<std::uint32_t>(slot);
      c.index = b.index;
      c.payload_bytes = b.payload_bytes;
      c.handle = handles[slot].first;
      c.gpu = handles[slot].second;
      std::array<std::byte, sizeof(wire::chunk)> raw;
      std::memcpy(raw.data(), &c, sizeof c);
      co_await each(
          [&](const links::member& p) { return hand_over(p.socket, raw, args_.timeout, rank_name(p.rank), b.index); });
    }
    cursor.finish();
    const std::uint64_t count = plan.buckets.size();
    for (std::uint64_t i = count > n ? count - n : 0; i < count; ++i)
      co_await each([&](const links::member& p) { return consumed(p.socket, args_.timeout, rank_name(p.rank), i); });
    co_await confirm_all(peers, seq);
  } catch (...) {
    close();
    throw;
  }
  end_update(declared, plan, start);
}

}  // namespace refit::cuda_ipc
