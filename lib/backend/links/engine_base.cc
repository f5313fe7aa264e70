#include <refit/backend/links/engine_base.h>

#include <algorithm>
#include <utility>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/delta_stream.h>
#include <refit/backend/engine.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/net.h>

namespace refit::links {

stream_free_init_info stream_free_init_info::read(json_reader& r) {
  stream_free_init_info info;
  static_cast<join_info&>(info) = join_info::read(r);
  if (info.wire.checksums)
    r.fail("member 'checksums' is not supported by this engine (its bytes cross no byte stream to checksum)");
  return info;
}

void check_connected(bool connected, const std::string& who) {
  if (!connected)
    throw_error(errc::invalid_state, who +
                                         ": the connection to the trainer was closed by an earlier failure; "
                                         "call init_transfer_engine again");
}

asio::awaitable<void> ensure_staging(std::unique_ptr<receive_pipeline>& pipeline, wire_params wire, bool serves,
                                     asio::any_io_executor executor, asio::any_io_executor processing,
                                     std::function<std::unique_ptr<staging_memory>(const wire_params&)> make) {
  if (pipeline && pipeline->params() == wire && serves) co_return;
  pipeline.reset();  // the old staging goes first: peak memory is one set
  std::unique_ptr<staging_memory> staging = co_await async::offload(processing, [&make, &wire] { return make(wire); });
  pipeline = std::make_unique<receive_pipeline>(executor, processing, wire, std::move(staging));
}

void refuse_upstream(asio::any_io_executor executor, std::shared_ptr<asio::ip::tcp::socket> socket, std::uint64_t seq,
                     errc kind, const std::string& reason, std::chrono::milliseconds timeout,
                     const std::string& who) noexcept {
  if (!socket) return;
  try {
    asio::co_spawn(executor,
                   links::refuse_update(std::move(socket), seq, kind, reason,
                                        std::min(timeout, std::chrono::milliseconds(2000)), who),
                   asio::detached);
  } catch (...) {  // could not start the refusal: the trainer fails at its deadline
  }
}

asio::awaitable<void> worker_engine::init(const stream_free_init_info& info) {
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = worker_rank(info, context().ranks, std::string(backend()));
  auto j =
      co_await join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret, timeout_, who());
  auto socket = std::make_unique<asio::ip::tcp::socket>(std::move(j.socket));
  co_await transport_closed();  // an earlier communicator's abort, before its staging is reused
  co_await joined(info, j.welcome);
  // Staging is allocated once here and reused by every update.
  auto make = [this](const wire_params& wire) { return make_staging(wire); };
  co_await ensure_staging(pipeline_, info.wire, true, context().executor, processing_executor(), make);
  socket_ = std::move(socket);
  last_seq_ = 0;
}

std::string worker_engine::staged_commit_refusal() const {
  if (pipeline_ && pipeline_->staging_device().is_cuda())
    return "its buckets arrive in device memory (" + to_string(pipeline_->staging_device()) +
           ") and a staged commit holds the whole update in host memory";
  return {};
}

asio::awaitable<void> worker_engine::receive(const metadata_update_info& info, load_weights_fn load_weights) {
  check_connected(socket_ != nullptr, who());
  std::exception_ptr failure;
  try {
    bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
    last_seq_ = co_await accept_update(*socket_, last_seq_, info.metadata, plan, timeout_, who());
    auto transport = make_transport();
    // No direct receive: the bytes arrive in one staging buffer per bucket.
    co_await pipeline_->receive(info.metadata, std::move(plan), *transport, wrap(std::move(load_weights)), deferred(),
                                mutable_stats(), nullptr);
    co_await confirm_update(*socket_, last_seq_, timeout_, who());
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // The transport's position is unknown after a failure: close it (the trainer
    // and the other workers fail too instead of waiting) and re-init.
    close();
    co_await transport_closed();
    std::rethrow_exception(failure);
  }
}

void worker_engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  if (!socket_) return;
  close_transport();
  refuse_upstream(context().executor, std::shared_ptr<asio::ip::tcp::socket>(socket_.release()), last_seq_ + 1, kind,
                  reason, timeout_, who());
}

void worker_engine::close() noexcept {
  close_transport();
  if (socket_) {
    net::close(*socket_);
    socket_.reset();
  }
}

sender_base::sender_base(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

void sender_base::set_next_send(const send_options& options) {
  weight_sender::set_next_send(options);
  if (options.producer_stream) next_producer_ = options.producer_stream;
}

const void* sender_base::take_producer_stream() noexcept {
  return std::exchange(next_producer_, std::nullopt).value_or(context_.native_stream);
}

json sender_base::prepare(const json& trainer_args) {
  const std::string name(backend());
  json_reader r(trainer_args, name + " trainer_args");
  auto args = trainer_args::read(r, config_.timeout);
  topology t;
  if (relays()) {
    const auto text = r.maybe<std::string>("topology");
    t = text ? topology::parse(*text, name + " trainer_args: member 'topology'")
             : topology::default_for(args.world_size - 1);
  }
  const bool delta = sends_deltas() && r.optional<bool>("delta", false);
  const std::uint64_t delta_max = sends_deltas() ? backend::read_delta_max_bytes(r) : 0;
  r.finish();
  if (args.wire.checksums && !verifies_checksums())
    throw_error(errc::invalid_argument, name + " trainer_args: member 'checksums' is not supported by " + name +
                                            " (its bytes cross no byte stream to checksum)");
  shutdown();
  args_ = args;
  topology_ = t;
  delta_ = delta;
  delta_max_ = delta_max;
  prepared();  // before listening: an engine that refuses its args leaves nothing open
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, args_.address, args_.port));
  json info = worker_init_info(args_, acceptor_->local_endpoint().port());
  if (!topology_.star()) info["topology"] = topology_.to_string();
  return info;
}

asio::awaitable<void> sender_base::connect_workers() {
  const std::string name(backend());
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, name + " trainer: connect_workers before prepare");
  close();
  auto members = co_await accept_workers(*acceptor_, context_.executor, config_.auth_secret, args_.timeout, args_.wire,
                                         args_.world_size, name + " trainer", welcome());
  // In a relay topology every worker learns its place; the trainer keeps sending
  // to its own children only (the others' side channels stay open, unused, until
  // the next init or a failure closes them).
  const std::vector<int> direct = topology_.children(0, args_.world_size - 1);
  for (auto& m : members)
    (std::find(direct.begin(), direct.end(), m.rank) != direct.end() ? peers_ : relayed_).push_back(m);
  std::exception_ptr failure;
  try {
    if (!topology_.star()) co_await tell_positions(members, topology_, args_.timeout, name + " trainer");
    co_await transport_closed();  // an earlier communicator's abort
    co_await connected();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    co_await close_after_failure();
    std::rethrow_exception(failure);
  }
  seq_ = 0;
}

void sender_base::close() noexcept {
  close_transport();
  for (auto* list : {&peers_, &relayed_}) {
    for (auto& p : *list) net::close(*p.socket);
    list->clear();
  }
}

asio::awaitable<void> sender_base::close_after_failure() {
  close();
  co_await transport_closed();
}

void sender_base::shutdown() {
  close();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

namespace {
asio::awaitable<void> announce_one(std::shared_ptr<asio::ip::tcp::socket> s, std::array<std::byte, 48> header,
                                   std::chrono::milliseconds timeout, std::string who) {
  co_await announce_update(*s, header, timeout, who);
}
asio::awaitable<void> confirm_one(std::shared_ptr<asio::ip::tcp::socket> s, std::uint64_t seq,
                                  std::chrono::milliseconds timeout, std::string who) {
  co_await await_confirmation(*s, seq, timeout, who);
}
}  // namespace

asio::awaitable<void> sender_base::announce_all(const std::vector<member>& peers, std::array<std::byte, 48> header) {
  std::vector<asio::awaitable<void>> ops;
  for (const auto& p : peers) ops.push_back(announce_one(p.socket, header, args_.timeout, rank_name(p.rank)));
  co_await async::all_of(std::move(ops));
}

asio::awaitable<void> sender_base::confirm_all(const std::vector<member>& peers, std::uint64_t seq) {
  std::vector<asio::awaitable<void>> ops;
  for (const auto& p : peers) ops.push_back(confirm_one(p.socket, seq, args_.timeout, rank_name(p.rank)));
  co_await async::all_of(std::move(ops));
}

std::pair<bucket_plan, std::uint64_t> sender_base::begin_update(const update_metadata& declared) {
  if (peers_.empty())
    throw_error(errc::invalid_state, std::string(backend()) +
                                         " trainer: send_weights before init (or after a failed "
                                         "update; call init again)");
  declared.validate();
  stats_ = {};
  return {plan_buckets(declared, args_.wire), ++seq_};
}

void sender_base::end_update(const update_metadata& declared, const bucket_plan& plan,
                             std::chrono::steady_clock::time_point start) {
  stats_.bytes = plan.tensor_bytes;
  stats_.buckets = plan.buckets.size();
  stats_.tensors = declared.tensors.size();
  stats_.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

}  // namespace refit::links
