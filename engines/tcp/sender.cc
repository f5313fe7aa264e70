// The TCP trainer: accept the workers, then stream each update to all of them at
// once with gather writes straight from the trainer's tensors.
#include <thread>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/engines/tcp/tcp.h>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/concurrent_channel.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/deadline.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/net.h>

namespace refit::tcp {

namespace wire = links::wire;

namespace {
using clock_type = std::chrono::steady_clock;

std::string rank_name(int rank) { return "tcp trainer: worker rank " + std::to_string(rank); }
}  // namespace

sender::sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sender::~sender() {
  shutdown();
  // Let the queued closes run on their strands before the pool goes away.
  if (io_pool_) io_pool_->join();
}

json sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "tcp trainer_args");
  const auto args = links::trainer_args::read(r, config_.timeout);
  const auto topology = r.maybe<std::string>("topology");
  const bool delta = r.optional<bool>("delta", false);
  const std::uint64_t delta_max = backend::read_delta_max_bytes(r);
  const auto chosen = topology ? links::topology::parse(*topology, "tcp trainer_args: member 'topology'")
                               : links::topology::default_for(args.world_size - 1);
  r.finish();
  topology_ = chosen;
  delta_ = delta;
  delta_max_ = delta_max;
  if (!delta_) base_ = {};  // no snapshot held without deltas
  args_ = args;
  world_size_ = args.world_size;
  wire_ = args.wire;
  timeout_ = args.timeout;
  shutdown();
  if (!io_pool_) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    io_pool_ = std::make_unique<asio::thread_pool>(std::min<unsigned>(cores, static_cast<unsigned>(world_size_ - 1)));
  }
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, args.address, args.port));
  return worker_init_info();
}

json sender::worker_init_info() const {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "tcp trainer: worker_init_info before listen");
  json info = links::worker_init_info(args_, acceptor_->local_endpoint().port());
  if (!topology_.star()) info["topology"] = topology_.to_string();
  return info;
}

asio::awaitable<void> sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "tcp trainer: connect_workers before prepare");
  fail_all();
  auto members = co_await links::accept_workers(*acceptor_, context_.executor, config_.auth_secret, timeout_, wire_,
                                                world_size_, "tcp trainer");
  const int workers = world_size_ - 1;
  // Every worker learns where it sits: whom it receives from (the trainer or a
  // worker's relay listener) and whom it forwards to.
  if (!topology_.star()) co_await links::tell_positions(members, topology_, timeout_, "tcp trainer");
  // Each direct child's socket moves to its own strand of the I/O pool, where its
  // streams run; the other workers' side channels stay open, unused, until the next
  // init or a failure closes them.
  const std::vector<int> direct = topology_.children(0, workers);
  for (auto& m : members) {
    auto strand = asio::make_strand(io_pool_->get_executor());
    const auto protocol = m.socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, m.socket->release());
    net::set_buffers(moved, config_.socket_buffer_bytes);
    auto p = std::make_shared<peer>(peer{m.rank, strand, std::move(moved)});
    if (std::find(direct.begin(), direct.end(), m.rank) != direct.end())
      peers_.push_back(std::move(p));
    else
      relayed_.push_back(std::move(p));
  }
  seq_ = 0;
}

void sender::fail_all() {
  // Closing every connection makes every worker fail fast with peer_lost instead
  // of waiting out its deadline. A socket is only touched on its own strand (a send
  // may be writing to it right now, from a pool thread); the closure keeps the peer
  // alive until it has run.
  for (auto* list : {&peers_, &relayed_}) {
    for (auto& p : *list) asio::post(p->strand, [p] { net::close(p->socket); });
    list->clear();
  }
}

namespace {

// The checksums of an update's buckets, computed in bucket order on a thread of
// their own (backend::hash_buckets) while the streams send earlier buckets: each
// stream receives them, in order, from its own channel (bucket k's header needs k's
// checksum; with deltas, its encoding, made there too).
class checksum_feed {
 public:
  using channel = asio::experimental::concurrent_channel<void(std::error_code, std::uint64_t)>;

  // One channel per stream, on that stream's executor, each with room for every
  // checksum (the hasher never waits for a stream).
  template <class Executors>
  checksum_feed(const Executors& stream_executors, std::size_t buckets) {
    for (const auto& ex : stream_executors) channels_.push_back(std::make_shared<channel>(ex, buckets));
  }
  std::shared_ptr<channel> for_stream(std::size_t i) const { return channels_.at(i); }

  // The next bucket's checksum, to every stream.
  void deliver(std::uint64_t h) {
    for (auto& c : channels_) c->try_send(std::error_code{}, h);
  }
  // Once stop() was called, the hashing stops before its next bucket.
  void stop() noexcept { stopped_ = true; }
  const std::atomic<bool>* stopped() const noexcept { return &stopped_; }
  // The feed failed (an allocation, an encoding): the streams waiting for their next
  // bucket's turn stop at once instead of at their deadline.
  void fail() noexcept {
    for (auto& c : channels_) c->close();
  }

 private:
  std::vector<std::shared_ptr<channel>> channels_;
  std::atomic<bool> stopped_{false};
};

}  // namespace

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  // set_next_send's choice holds for this send only, whatever becomes of it.
  const bool allow_base = std::exchange(next_delta_, std::nullopt).value_or(true);
  if (peers_.empty())
    throw_error(errc::invalid_state,
                "tcp trainer: send_weights before init (or after a failed update; "
                "call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  const bucket_plan plan = plan_buckets(declared, wire_);
  backend::bucket_update u(declared, plan, ++seq_);
  co_await backend::send_buckets(*this, u, source, {delta_, delta_max_, allow_base, version_, base_, delta_stats_});
  stats_.bytes = plan.tensor_bytes;
  stats_.buckets = plan.buckets.size();
  stats_.tensors = declared.tensors.size();
  stats_.wall_s = std::chrono::duration<double>(clock_type::now() - start).count();
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

void sender::reset_peers() {
  for (auto& p : peers_) {
    p->confirmed = false;
    p->took_delta = false;
    p->fell_back = false;
  }
}

asio::awaitable<void> sender::transmit(backend::bucket_update& u) {
  stream s;
  s.update = &u;
  if (u.offer) {
    s.encoded_left = std::make_unique<std::atomic<std::size_t>[]>(u.plan.buckets.size());
    for (std::size_t k = 0; k < u.plan.buckets.size(); ++k) s.encoded_left[k] = peers_.size();
  }
  // Each worker's stream runs on its own strand of the I/O pool, at its own pace:
  // with several workers the kernel copies run on several cores, and a slow
  // worker does not stall the others bucket by bucket. Checksums are computed
  // on a thread of their own, bucket k+1's while bucket k is on the wire.
  std::vector<asio::any_io_executor> executors;
  for (auto& p : peers_) executors.emplace_back(p->strand);
  std::shared_ptr<checksum_feed> feed;
  if (wire_.checksums || u.work) feed = std::make_shared<checksum_feed>(executors, u.plan.buckets.size());
  std::vector<asio::awaitable<void>> streams;
  for (std::size_t i = 0; i < peers_.size(); ++i)
    streams.push_back(asio::co_spawn(peers_[i]->strand, stream_to(peers_[i], s, feed ? feed->for_stream(i) : nullptr),
                                     asio::use_awaitable));
  if (!feed) {
    co_await async::all_of(std::move(streams));
    co_return;
  }
  if (!hash_pool_) hash_pool_ = std::make_unique<asio::thread_pool>(1);
  backend::bucket_update* update = &u;
  backend::delta_snapshot* base = &base_;
  auto hashing = async::offload(hash_pool_->get_executor(), [feed, update, base] {
    struct on_failure {
      checksum_feed& feed;
      bool armed = true;
      ~on_failure() {
        if (armed) feed.fail();
      }
    } guard{*feed};
    checksum_feed* to = feed.get();
    backend::hash_buckets(
        *update, *base, [to](std::size_t, std::uint64_t h) { to->deliver(h); }, feed->stopped());
    guard.armed = false;
  });
  // A stream that fails stops the hashing (it would only feed dead streams).
  auto streams_then_stop = [](std::vector<asio::awaitable<void>> all,
                              std::shared_ptr<checksum_feed> feed) -> asio::awaitable<void> {
    std::exception_ptr e;
    try {
      co_await async::all_of(std::move(all));
    } catch (...) {
      e = std::current_exception();
    }
    feed->stop();
    if (e) std::rethrow_exception(e);
  };
  std::vector<asio::awaitable<void>> hashed_streams;
  hashed_streams.push_back(streams_then_stop(std::move(streams), feed));
  hashed_streams.push_back(std::move(hashing));
  co_await async::all_of(std::move(hashed_streams));
}

std::vector<backend::peer_delta_outcome> sender::delta_outcomes() const {
  // A stream reaches its worker's subtree (relays): each worker there took the
  // deltas, or got the update full.
  std::vector<backend::peer_delta_outcome> out;
  for (const auto& p : peers_)
    out.push_back({topology_.subtree(p->rank, world_size_ - 1).size(), p->took_delta, p->fell_back});
  return out;
}

void sender::failed(const backend::bucket_update& u, std::exception_ptr failure) {
  // Which workers do not hold this update: every direct peer that did not
  // confirm, with the workers it relays to.
  const std::string missing = unconfirmed_ranks();
  fail_all();
  if (missing.empty()) return;
  try {
    std::rethrow_exception(failure);
  } catch (const error& e) {
    throw_error(e.kind(),
                e.message() + " (update " + std::to_string(u.seq) + " not completed by worker " + missing + ")");
  } catch (...) {
  }
}

asio::awaitable<void> sender::stream_to(std::shared_ptr<peer> keep, const stream& s,
                                        std::shared_ptr<checksum_channel> checksums) {
  peer& p = *keep;
  const std::string who = rank_name(p.rank);
  std::exception_ptr failure;
  try {
    co_await stream_body(p, s, std::move(checksums), who);
    p.confirmed = true;
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes (its own error, or which worker
  // below it was lost): that reason, not "connection reset", is the error.
  if (failure) co_await links::rethrow_with_peer_reason(p.socket, failure, who);
}

asio::awaitable<void> sender::stream_body(peer& p, const stream& s, std::shared_ptr<checksum_channel> turns,
                                          const std::string& who) {
  backend::bucket_update& u = *s.update;
  bool deltas = false;
  if (!u.offer) {
    co_await links::announce_update(p.socket, u.header, timeout_, who);
  } else {
    // The update header and its delta header, then the worker's answers: it
    // accepts the update, then (when offered deltas) says whether it holds the base.
    const std::uint64_t seq = u.seq;
    std::vector<asio::const_buffer> headers{asio::buffer(u.header), asio::buffer(u.offer->header)};
    co_await net::write_all(p.socket, headers, timeout_, who + ": update header");
    links::throw_if_failed(
        co_await links::read_status(p.socket, timeout_,
                                    who + ": waiting for the worker to accept update " + std::to_string(seq)),
        who + " refused the update");
    if (u.offer->has_base) {
      const auto answer =
          co_await links::read_status(p.socket, timeout_, who + ": waiting for its answer to the delta offer");
      if (answer.code == static_cast<std::uint32_t>(errc::invalid_state)) {
        p.fell_back = true;  // it does not hold the base: this update goes to it full
      } else {
        links::throw_if_failed(answer, who + " refused the delta offer");
        deltas = true;
        p.took_delta = true;
      }
    }
  }
  std::vector<asio::const_buffer> buffers;
  for (std::size_t i = 0; i < u.payloads.size(); ++i) {
    const std::string what = who + ": bucket " + std::to_string(i);
    wire::bucket_header h;
    h.index = i;
    h.payload_bytes = asio::buffer_size(u.payloads[i]);
    if (turns) {
      // The bucket's checksum (and with deltas, its encoding) is ready.
      auto [ec, sum] =
          co_await async::with_deadline(turns->async_receive(asio::experimental::as_tuple(asio::use_awaitable)),
                                        timeout_, what + ": waiting for its checksum");
      if (ec) throw_error(errc::cancelled, what + ": checksumming stopped");
      if (wire_.checksums) {
        h.flags |= wire::flag_checksum;
        h.checksum = sum;
      }
    }
    const bool encoded = deltas && !u.encoded[i].empty();
    if (encoded) {
      h.flags |= wire::flag_delta;
      h.payload_bytes = u.encoded[i].size();
    }
    const auto header = wire::encode(h);
    buffers.assign(1, asio::buffer(header));
    if (encoded)
      buffers.push_back(asio::buffer(u.encoded[i]));
    else
      buffers.insert(buffers.end(), u.payloads[i].begin(), u.payloads[i].end());
    co_await net::write_all(p.socket, buffers, timeout_, what);
    // The last stream past a bucket frees its delta (the streams run on several
    // threads, so the count is atomic; the bytes are not touched after it).
    if (s.encoded_left && --s.encoded_left[i] == 0) std::vector<std::byte>().swap(u.encoded[i]);
  }
  co_await links::await_confirmation(p.socket, u.seq, timeout_, who);
}

void sender::set_next_send(const send_options& options) {
  next_delta_ = backend::next_delta_choice(options, delta_, "tcp trainer");
}

json sender::last_send_info() const {
  if (!delta_) return nullptr;
  return delta_send_info(delta_stats_);
}

std::string sender::unconfirmed_ranks() const {
  const int workers = world_size_ - 1;
  std::vector<int> ranks;
  for (const auto& p : peers_) {
    if (p->confirmed) continue;
    for (int r : topology_.subtree(p->rank, workers)) ranks.push_back(r);
  }
  std::sort(ranks.begin(), ranks.end());
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return ranks.empty() ? std::string() : out;
}

void sender::shutdown() {
  fail_all();
  // Closed, not destroyed: a coroutine still waiting in accept wakes up cancelled and
  // finds a closed acceptor rather than freed memory.
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

}  // namespace refit::tcp
