// The CUDA IPC trainer: pack each bucket into one of num_buffers exported buffers,
// tell every worker its handle, and reuse a buffer only after every worker has
// consumed what it last held.
#include <cstring>

#include "engines/cuda_ipc/cuda_ipc.h"
#include "engines/cuda_ipc/wire.h"
#include "lib/async/all_of.h"
#include "lib/group/status_io.h"
#include "lib/net.h"
#include "lib/send_cursor.h"

namespace refit::cuda_ipc {

namespace {
using clock_type = std::chrono::steady_clock;
std::string rank_name(int rank) { return "cuda_ipc trainer: worker rank " + std::to_string(rank); }

asio::awaitable<void> announce(std::shared_ptr<asio::ip::tcp::socket> s, std::array<std::byte, 48> header,
                               std::chrono::milliseconds timeout, int rank) {
  co_await group::announce_update(*s, header, timeout, rank_name(rank));
}
asio::awaitable<void> hand_over(std::shared_ptr<asio::ip::tcp::socket> s, std::array<std::byte, sizeof(wire::chunk)> raw,
                                std::chrono::milliseconds timeout, int rank, std::uint64_t index) {
  co_await net::write_all(*s, asio::buffer(raw), timeout, rank_name(rank) + ": bucket " + std::to_string(index));
}
asio::awaitable<void> consumed(std::shared_ptr<asio::ip::tcp::socket> s, std::chrono::milliseconds timeout, int rank,
                               std::uint64_t index) {
  auto st = co_await group::read_status(*s, timeout, rank_name(rank) + ": waiting for bucket " + std::to_string(index) +
                                                         " to be consumed");
  group::throw_if_failed(st, rank_name(rank));
  if (st.seq != index)
    throw_error(errc::protocol_error, rank_name(rank) + ": consumed bucket " + std::to_string(st.seq) + ", expected " +
                                          std::to_string(index));
}
asio::awaitable<void> confirmation(std::shared_ptr<asio::ip::tcp::socket> s, std::uint64_t seq,
                                   std::chrono::milliseconds timeout, int rank) {
  co_await group::await_confirmation(*s, seq, timeout, rank_name(rank));
}
}  // namespace

sender::sender(const weight_transfer_config& config, const trainer_context& context,
               std::shared_ptr<ipc_provider> provider)
    : config_(config), context_(context), provider_(std::move(provider)) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
  if (!provider_) throw_error(errc::invalid_argument, "cuda_ipc trainer: an ipc provider is required");
}

sender::~sender() { shutdown(); }

json sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "cuda_ipc trainer_args");
  auto args = group::trainer_args::read(r, config_.timeout);
  r.finish();
  if (args.wire.checksums)
    throw_error(errc::invalid_argument,
                "cuda_ipc trainer_args: member 'checksums' is not supported by cuda_ipc (the bytes never leave the "
                "GPU's memory)");
  shutdown();
  args_ = args;
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, args_.address, args_.port));
  // The exported buffers live as long as the sender: workers keep their mappings
  // for a session, so a buffer is never freed under them mid-session.
  if (!buffers_ || buffers_->slot_count() != args_.wire.num_buffers ||
      buffers_->slot(0).size() != args_.wire.buffer_bytes)
    buffers_ = provider_->make_exportable(args_.wire.num_buffers, args_.wire.buffer_bytes);
  return group::worker_init_info(args_, acceptor_->local_endpoint().port());
}

asio::awaitable<void> sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "cuda_ipc trainer: connect_workers before prepare");
  fail_all();
  peers_ = co_await group::accept_workers(*acceptor_, context_.executor, config_.auth_secret, args_.timeout,
                                          args_.wire, args_.world_size, "cuda_ipc trainer");
  seq_ = 0;
}

void sender::fail_all() {
  std::error_code ignored;
  for (auto& p : peers_) {
    p.socket->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    p.socket->close(ignored);
  }
  peers_.clear();
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  if (peers_.empty())
    throw_error(errc::invalid_state, "cuda_ipc trainer: send_weights before init (or after a failed update; "
                                     "call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  const bucket_plan plan = plan_buckets(declared, args_.wire);
  const std::uint64_t seq = ++seq_;
  const std::vector<group::member> peers = peers_;
  const std::size_t n = buffers_->slot_count();
  // Each buffer's handle, exported once per update (host handles are per export).
  std::vector<std::pair<handle_bytes, gpu_uuid>> handles;
  for (std::size_t i = 0; i < n; ++i) handles.push_back(provider_->export_buffer(*buffers_, i));
  auto each = [&peers](auto make) {
    std::vector<asio::awaitable<void>> ops;
    for (const auto& p : peers) ops.push_back(make(p));
    return async::all_of(std::move(ops));
  };
  try {
    const auto header = group::update_header(seq, declared, plan);
    co_await each([&](const group::member& p) { return announce(p.socket, header, args_.timeout, p.rank); });
    send_cursor cursor(declared, plan, source, provider_->device_sources());
    for (const bucket& b : plan.buckets) {
      const std::size_t slot = b.index % n;
      // The buffer held bucket b - n: every worker must have consumed it.
      if (b.index >= n) {
        const std::uint64_t old = b.index - n;
        co_await each([&](const group::member& p) { return consumed(p.socket, args_.timeout, p.rank, old); });
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
      co_await each([&](const group::member& p) { return hand_over(p.socket, raw, args_.timeout, p.rank, b.index); });
    }
    cursor.finish();
    const std::uint64_t count = plan.buckets.size();
    for (std::uint64_t i = count > n ? count - n : 0; i < count; ++i)
      co_await each([&](const group::member& p) { return consumed(p.socket, args_.timeout, p.rank, i); });
    co_await each([&](const group::member& p) { return confirmation(p.socket, seq, args_.timeout, p.rank); });
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

}  // namespace refit::cuda_ipc
