// The TCP worker: connect, say hello, then per update check the trainer's update
// header against this worker's own plan and receive buckets into staging slots.
#include <asio/use_awaitable.hpp>

#include "engines/tcp/tcp.h"
#include "lib/group/wire.h"
#include "lib/checksum.h"
#include "lib/hex.h"
#include "lib/net.h"

namespace refit::tcp {

namespace wire = group::wire;

namespace {

// Receives one bucket: header checked against the plan, then the payload straight
// into the destination (no intermediate copy).
class transport final : public bucket_transport {
 public:
  transport(asio::ip::tcp::socket& s, std::chrono::milliseconds timeout, int rank, bool checksums)
      : socket_(s), timeout_(timeout), rank_(rank), checksums_(checksums) {}

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = "tcp worker rank " + std::to_string(rank_) + ": bucket " + std::to_string(b.index);
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(socket_, asio::buffer(raw), timeout_, what + " header");
    auto h = wire::decode<wire::bucket_header>(raw);
    if (auto mismatch = wire::check_bucket_header(h, b.index, b.payload_bytes, checksums_); !mismatch.empty())
      throw_error(errc::protocol_error, what + ": " + mismatch);
    co_await net::read_exact(socket_, dest, timeout_, what + " payload");
    if (checksums_) {
      const std::uint64_t got = checksum(dest);
      if (got != h.checksum)
        throw_error(errc::integrity_error, what + ": payload checksum " + to_hex(got) + " differs from the trainer's " +
                                               to_hex(h.checksum) + " (corrupted in transit)");
    }
  }

 private:
  asio::ip::tcp::socket& socket_;
  std::chrono::milliseconds timeout_;
  int rank_;
  bool checksums_;
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context)
    : typed_engine(config, context) {}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = group::worker_rank(info, context().ranks, "tcp");
  const std::string who = "tcp worker rank " + std::to_string(rank_);
  auto joined = co_await group::join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret,
                                     timeout_, who);
  auto socket = std::make_unique<asio::ip::tcp::socket>(std::move(joined.socket));

  // Staging is allocated once here and reused by every update.
  if (!pipeline_ || !(pipeline_->params() == info.wire)) {
    pipeline_ = std::make_unique<receive_pipeline>(
        context().executor, processing_executor(), info.wire,
        std::make_unique<host_staging>(info.wire.num_buffers, info.wire.buffer_bytes));
  }
  socket_ = std::move(socket);
  last_seq_ = 0;
}

asio::awaitable<void> engine::receive(const update_info& info, load_weights_fn load_weights) {
  const std::string who = "tcp worker rank " + std::to_string(rank_);
  if (!socket_)
    throw_error(errc::invalid_state, who + ": the connection to the trainer was closed by an earlier "
                                           "failure; call init_transfer_engine again");
  try {
    co_await receive_on(*socket_, info, std::move(load_weights));
  } catch (...) {
    // After a failure the stream position is unknown: never read it again.
    do_shutdown();
    throw;
  }
}

asio::awaitable<void> engine::receive_on(asio::ip::tcp::socket& socket, const update_info& info,
                                         load_weights_fn load_weights) {
  const std::string who = "tcp worker rank " + std::to_string(rank_);
  bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
  last_seq_ = co_await group::accept_update(socket, last_seq_, info.metadata, plan, timeout_, who);

  transport t(socket, timeout_, rank_, pipeline_->params().checksums);
  // The plan just checked against the trainer's header is the one received with.
  co_await pipeline_->receive(info.metadata, std::move(plan), t, std::move(load_weights), deferred(),
                              mutable_stats(), receive_target());
  co_await group::confirm_update(socket, last_seq_, timeout_, who);
}

void engine::do_shutdown() {
  if (socket_) {
    std::error_code ignored;
    socket_->shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    socket_->close(ignored);
    socket_.reset();
  }
}

}  // namespace refit::tcp
