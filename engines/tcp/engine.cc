// The TCP worker: connect, say hello, then per update check the trainer's update
// header against this worker's own plan and receive buckets into staging slots.
#include <asio/use_awaitable.hpp>

#include "engines/tcp/status_io.h"
#include "engines/tcp/tcp.h"
#include "engines/tcp/wire.h"
#include "lib/auth.h"
#include "lib/checksum.h"
#include "lib/net.h"

namespace refit::tcp {

init_info init_info::read(json_reader& r) {
  init_info info;
  info.master_address = r.required<std::string>("master_address");
  if (info.master_address.empty()) r.fail("member 'master_address' must not be empty");
  info.master_port = r.required<std::uint16_t>("master_port");
  if (info.master_port == 0) r.fail("member 'master_port' must be a port in [1, 65535], got 0");
  info.rank_offset = r.required<int>("rank_offset");
  info.world_size = r.required<int>("world_size");
  if (info.world_size < 2)
    r.fail("member 'world_size' must be at least 2 (the trainer and one worker), got " +
           std::to_string(info.world_size));
  if (info.rank_offset < 1 || info.rank_offset >= info.world_size)
    r.fail("member 'rank_offset' must be in [1, world_size), got " + std::to_string(info.rank_offset));
  info.wire = wire_params::read(r);
  if (auto ms = r.maybe<std::int64_t>("timeout_ms")) {
    if (*ms <= 0) r.fail("member 'timeout_ms' must be positive, got " + std::to_string(*ms));
    info.timeout = std::chrono::milliseconds(*ms);
  }
  return info;
}

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
        throw_error(errc::integrity_error, what + ": payload checksum " + hex(got) + " differs from the trainer's " +
                                               hex(h.checksum) + " (corrupted in transit)");
    }
  }

 private:
  static std::string hex(std::uint64_t v) {
    char b[20];
    std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
    return b;
  }
  asio::ip::tcp::socket& socket_;
  std::chrono::milliseconds timeout_;
  int rank_;
  bool checksums_;
};

int local_rank(const parallel_ranks& r) {
  return r.tp_rank + r.tp_size * (r.pp_rank + r.pp_size * r.dp_rank);
}

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context)
    : typed_engine(config, context) {}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = info.rank_offset + local_rank(context().ranks);
  if (rank_ >= info.world_size)
    throw_error(errc::invalid_argument,
                "tcp init_info: this worker's rank " + std::to_string(rank_) + " (rank_offset " +
                    std::to_string(info.rank_offset) + " + local rank) is not below world_size " +
                    std::to_string(info.world_size));
  const std::string who = "tcp worker rank " + std::to_string(rank_);
  auto socket = std::make_unique<asio::ip::tcp::socket>(co_await net::connect_with_retry(
      info.master_address, info.master_port, timeout_, who + ": connecting to the trainer"));
  // No weight byte is accepted from a trainer that has not proved the secret.
  co_await auth::as_client(*socket, config().auth_secret, timeout_, who + ": trainer " + info.master_address + ":" +
                                                                        std::to_string(info.master_port));

  wire::hello hello;
  hello.rank = static_cast<std::uint32_t>(rank_);
  hello.num_buffers = info.wire.num_buffers;
  hello.buffer_bytes = info.wire.buffer_bytes;
  hello.flags = info.wire.checksums ? wire::flag_checksum : 0;
  auto raw = wire::encode(hello);
  co_await net::write_all(*socket, asio::buffer(raw), timeout_, who + ": hello");
  throw_if_failed(co_await read_status(*socket, timeout_, who + ": waiting for the trainer's welcome"),
                  who + ": the trainer refused this worker");

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
  std::array<std::byte, sizeof(wire::update)> raw;
  co_await net::read_exact(socket, asio::buffer(raw), timeout_, who + ": waiting for the update header");
  auto u = wire::decode<wire::update>(raw);
  if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, who + ": " + bad);

  bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
  const wire::update_expectation expected{last_seq_, info.metadata.tensors.size(), metadata_digest(info.metadata),
                                          plan.buckets.size(), plan.payload_bytes};
  const std::string mismatch = wire::check_update_header(u, expected);
  if (!mismatch.empty()) {
    co_await send_status(socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, mismatch, timeout_,
                         who + ": refusing the update");
    throw_error(errc::protocol_error, who + ": " + mismatch);
  }
  last_seq_ = u.seq;
  co_await send_status(socket, 0, u.seq, {}, timeout_, who + ": accepting the update");

  transport t(socket, timeout_, rank_, pipeline_->params().checksums);
  // The plan just checked against the trainer's header is the one received with.
  co_await pipeline_->receive(info.metadata, std::move(plan), t, std::move(load_weights), deferred(),
                              mutable_stats(), receive_target());
  co_await send_status(socket, 0, u.seq, {}, timeout_, who + ": confirming the update");
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
