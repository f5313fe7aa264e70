// The TCP worker: connect, say hello, then per update check the trainer's update
// header against this worker's own plan and receive buckets into staging slots.
#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/use_awaitable.hpp>

#include "engines/tcp/tcp.h"
#include "lib/group/wire.h"
#include "lib/checksum.h"
#include "lib/hex.h"
#include "lib/async/offload.h"
#include "lib/net.h"

namespace refit::tcp {

namespace wire = group::wire;

namespace {

// Receives one bucket: its header checked against the plan (begin), then the
// payload straight into the destination (no intermediate copy); its checksum is
// verified on the processing executor while the next bucket arrives (check).
class transport final : public bucket_transport {
 public:
  transport(asio::ip::tcp::socket& s, std::chrono::milliseconds timeout, int rank, bool checksums)
      : socket_(s), timeout_(timeout), rank_(rank), checksums_(checksums) {}

  asio::awaitable<void> begin(const bucket& b) override {
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(socket_, asio::buffer(raw), timeout_, what(b) + " header");
    auto h = wire::decode<wire::bucket_header>(raw);
    if (auto mismatch = wire::check_bucket_header(h, b.index, b.payload_bytes, checksums_); !mismatch.empty())
      throw_error(errc::protocol_error, what(b) + ": " + mismatch);
    expected_ = h.checksum;
  }

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    co_await net::read_exact(socket_, dest, timeout_, what(b) + " payload");
  }

  std::function<void()> check(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    if (!checksums_) return {};
    return [dest = std::vector<asio::mutable_buffer>(dest.begin(), dest.end()), expected = expected_,
            what = what(b)] {
      const std::uint64_t got = checksum(dest);
      if (got != expected)
        throw_error(errc::integrity_error, what + ": payload checksum " + to_hex(got) + " differs from the trainer's " +
                                               to_hex(expected) + " (corrupted in transit)");
    };
  }

 private:
  std::string what(const bucket& b) const {
    return "tcp worker rank " + std::to_string(rank_) + ": bucket " + std::to_string(b.index);
  }
  asio::ip::tcp::socket& socket_;
  std::chrono::milliseconds timeout_;
  int rank_;
  bool checksums_;
  std::uint64_t expected_ = 0;
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
  net::set_buffers(*socket, config().socket_buffer_bytes);

  // Staging is allocated once here and reused by every update; allocating and
  // faulting in num_buffers x buffer_bytes takes the processing executor a while,
  // not the event loop.
  if (!pipeline_ || !(pipeline_->params() == info.wire)) {
    pipeline_.reset();  // the old staging goes first: peak memory is one set
    const wire_params wire = info.wire;
    std::unique_ptr<staging_memory> staging = co_await async::offload(processing_executor(), [wire] {
      return std::unique_ptr<staging_memory>(std::make_unique<host_staging>(wire.num_buffers, wire.buffer_bytes));
    });
    pipeline_ = std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire,
                                                   std::move(staging));
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

void engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  if (!socket_) return;
  try {
    std::shared_ptr<asio::ip::tcp::socket> s(socket_.release());
    asio::co_spawn(context().executor,
                   group::refuse_update(s, last_seq_ + 1, kind, reason,
                                        std::min(timeout_, std::chrono::milliseconds(2000)),
                                        "tcp worker rank " + std::to_string(rank_)),
                   asio::detached);
  } catch (...) {  // could not start the refusal: the trainer fails at its deadline
  }
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
