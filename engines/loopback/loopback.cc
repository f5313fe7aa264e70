#include <refit/engines/loopback/loopback.h>

#include <map>
#include <mutex>

#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/concurrent_channel.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/send_cursor.h>

namespace refit::loopback {

// The worker asks for bucket k with a destination; the sender copies into it and
// answers. Both directions carry an error code so either side's failure reaches
// the other instead of leaving it waiting.
struct request {
  std::uint64_t index = 0;
  std::uint64_t bytes = 0;
  std::span<const asio::mutable_buffer> dest;
};

struct link {
  link(asio::any_io_executor ex, wire_params w) : wire(w), requests(ex, 1), replies(ex, 1) {}
  wire_params wire;
  asio::experimental::concurrent_channel<void(std::error_code, request)> requests;
  // Carries the bucket index answered (asio 1.22 cannot build a channel whose
  // signature is void(error_code) alone).
  asio::experimental::concurrent_channel<void(std::error_code, std::uint64_t)> replies;
  bool worker_attached = false;
};

namespace {

std::mutex hub_mutex;
std::map<std::string, std::weak_ptr<link>> hub;

wire_params read_channel_args(json_reader& r, std::string& channel) {
  channel = r.required<std::string>("channel");
  if (channel.empty()) r.fail("member 'channel' must not be empty");
  return wire_params::read(r);
}

}  // namespace

init_info init_info::read(json_reader& r) {
  init_info info;
  info.wire = read_channel_args(r, info.channel);
  return info;
}

// ---- worker ----

namespace {
class transport final : public bucket_transport {
 public:
  transport(link& l, std::chrono::milliseconds timeout) : link_(l), timeout_(timeout) {}
  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = "loopback: bucket " + std::to_string(b.index);
    co_await async::with_deadline(
        link_.requests.async_send(std::error_code{}, request{b.index, b.payload_bytes, dest}, asio::use_awaitable),
        timeout_, what + " (waiting for the trainer to take the request)");
    auto [ec, index] =
        co_await async::with_deadline(link_.replies.async_receive(asio::experimental::as_tuple(asio::use_awaitable)),
                                      timeout_, what + " (waiting for the trainer's bytes)");
    if (ec == errc::protocol_error)
      throw_error(errc::protocol_error, what + ": the trainer's metadata differ from this update's");
    if (ec == errc::cancelled) throw_error(errc::peer_lost, what + ": the trainer aborted the update");
    if (ec) throw_error(errc::peer_lost, what + ": the trainer closed the channel (" + ec.message() + ")");
    if (index != b.index)
      throw_error(errc::protocol_error, what + ": the trainer answered bucket " + std::to_string(index));
  }

 private:
  link& link_;
  std::chrono::milliseconds timeout_;
};
}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context)
    : typed_engine(config, context, capabilities_of()) {}

engine::~engine() { do_shutdown(); }

asio::awaitable<void> engine::init(const init_info& info) {
  std::shared_ptr<link> l;
  {
    std::lock_guard lock(hub_mutex);
    auto it = hub.find(info.channel);
    if (it != hub.end()) l = it->second.lock();
  }
  if (!l) throw_error(errc::peer_lost, "loopback: no trainer has opened channel '" + info.channel + "'");
  if (!(l->wire == info.wire))
    throw_error(errc::invalid_argument, "loopback: init_info wire parameters differ from the trainer's");
  pipeline_ =
      std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire,
                                         std::make_unique<host_staging>(info.wire.num_buffers, info.wire.buffer_bytes));
  link_ = std::move(l);
  co_return;
}

asio::awaitable<void> engine::receive(const update_info& info, load_weights_fn load_weights) {
  transport t(*link_, config().timeout);
  co_await pipeline_->receive(info.metadata, t, std::move(load_weights), deferred(), mutable_stats(), receive_target());
}

void engine::do_shutdown() {
  link_.reset();
  pipeline_.reset();
}

// ---- trainer ----

sender::sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {}

sender::~sender() { shutdown(); }

json sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "loopback trainer_args");
  std::string channel;
  wire_params wire = read_channel_args(r, channel);
  r.finish();
  auto l = std::make_shared<link>(context_.executor, wire);
  {
    std::lock_guard lock(hub_mutex);
    auto& slot = hub[channel];
    if (slot.lock()) throw_error(errc::already_registered, "loopback: channel '" + channel + "' is already open");
    slot = l;
  }
  link_ = std::move(l);
  json init_info = {{"channel", channel}};
  wire.write(init_info);
  return init_info;
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  if (!link_) throw_error(errc::invalid_state, "loopback: send_weights before init");
  declared.validate();
  const bucket_plan plan = plan_buckets(declared, link_->wire);
  send_cursor cursor(declared, plan, source);
  try {
    for (const bucket& b : plan.buckets) {
      const std::string what = "loopback trainer: bucket " + std::to_string(b.index);
      const auto& buffers = cursor.gather(b);
      request req = co_await async::with_deadline(link_->requests.async_receive(asio::use_awaitable), config_.timeout,
                                                  what + " (waiting for the worker)");
      if (req.index != b.index || req.bytes != b.payload_bytes)
        throw_error(errc::protocol_error, what + ": worker expects bucket " + std::to_string(req.index) + " of " +
                                              std::to_string(req.bytes) + " bytes, trainer has " +
                                              std::to_string(b.payload_bytes) + " bytes (metadata differ)");
      asio::buffer_copy(req.dest, buffers);
      co_await async::with_deadline(link_->replies.async_send(std::error_code{}, b.index, asio::use_awaitable),
                                    config_.timeout, what + " (handing the bytes over)");
    }
    cursor.finish();
  } catch (const error& e) {
    // Tell a worker that waits for this update, instead of leaving it to its
    // deadline: drop its pending request and answer with the kind of failure.
    link_->requests.try_receive([](std::error_code, request) {});
    link_->replies.try_send(make_error_code(e.kind() == errc::protocol_error ? errc::protocol_error : errc::cancelled),
                            std::uint64_t{0});
    throw;
  }
}

void sender::shutdown() {
  if (!link_) return;
  link_->requests.close();
  link_->replies.close();
  link_.reset();
}

}  // namespace refit::loopback
