// The UCX trainer: accept the workers (links), make an endpoint to each it sends
// to itself (every worker in a star, its children in a chain or tree) from its
// offer, then per bucket write where the worker granted (puts, flushed) or send it
// tagged, and only then say "done" (downstream.h, shared with relaying workers).
#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/delta_stream.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/ucx/ucx.h>
#include "downstream.h"  // private to this engine
#include "ucp.h"         // private to this engine
#include "wire.h"        // private to this engine

namespace refit::ucx {

sender::sender(const weight_transfer_config& config, const trainer_context& context) : sender_base(config, context) {}

sender::~sender() {
  shutdown();
  peers_by_rank_.clear();
  if (worker_) worker_->close();
  if (hash_pool_) hash_pool_->join();
}

json sender::transport_info() const {
  json out = json::object();
  for (const auto& p : peers_by_rank_) out[std::to_string(p->rank)] = p->report.to_json();
  return out;
}

void sender::close_transport() noexcept {
  // Keys, endpoints and the worker are released now (keys first, while their worker
  // lives); a stream still holding its peer finds the endpoint closed (check_open)
  // before it touches a key again. (The side channels are closed by the base.)
  for (auto& p : peers_by_rank_) {
    p->regions.clear();
    if (p->ep) p->ep->close();
  }
  peers_by_rank_.clear();
  if (worker_) {
    worker_->close();
    worker_.reset();
  }
}

asio::awaitable<void> sender::connected() {
  if (!ucp_) ucp_ = std::make_shared<ucx::context>();
  worker_ = worker::create(ucp_, context_.executor);
  worker::engaged progressing(worker_);
  // Endpoints to the workers the trainer sends to itself: in a chain or tree only
  // its children (the others offer theirs to the worker that relays to them).
  for (const auto& m : peers_) {
    auto p = std::make_shared<downstream>();
    p->rank = m.rank;
    p->name = rank_name(m.rank);
    p->socket = m.socket;
    peers_by_rank_.push_back(std::move(p));
  }
  std::vector<asio::awaitable<void>> ops;
  for (auto& p : peers_by_rank_) ops.push_back(connect_downstream(p, worker_, args_.timeout));
  co_await async::all_of(std::move(ops));
}

void sender::prepared() {
  if (!delta_) base_ = {};  // no snapshot held without deltas
}

void sender::set_next_send(const send_options& options) {
  next_delta_ = backend::next_delta_choice(options, delta_, "ucx trainer");
}

json sender::last_send_info() const {
  if (!delta_) return nullptr;
  return backend::delta_send_info(delta_stats_);
}

asio::awaitable<void> sender::stream_to(std::shared_ptr<downstream> p, std::shared_ptr<worker> w,
                                        const std::vector<std::vector<asio::const_buffer>>& payloads,
                                        const std::vector<std::uint64_t>& checksums, const bucket_plan& plan,
                                        std::uint64_t seq, const std::vector<std::vector<std::byte>>* encoded) {
  const bool deltas = encoded && p->took_delta;
  for (const bucket& b : plan.buckets) {
    std::optional<std::uint64_t> sum;
    if (args_.wire.checksums) sum = checksums[b.index];
    // With deltas taken, the bucket's form first, then its bytes: the delta's,
    // or (none smaller) the bucket's own.
    const std::vector<std::byte>* e = deltas ? &(*encoded)[b.index] : nullptr;
    const asio::const_buffer delta_bytes = e ? asio::buffer(*e) : asio::const_buffer();
    const std::span<const asio::const_buffer> payload = e && !e->empty()
                                                            ? std::span<const asio::const_buffer>(&delta_bytes, 1)
                                                            : std::span<const asio::const_buffer>(payloads[b.index]);
    std::optional<std::uint64_t> form;
    if (e) form = e->size();
    co_await send_bucket(w, p, b.index, payload, seq, sum, args_.timeout, form);
  }
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  // set_next_send's choice holds for this send only, whatever becomes of it.
  const bool allow_base = std::exchange(next_delta_, std::nullopt).value_or(true);
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  backend::bucket_update u(declared, plan, seq);
  co_await backend::send_buckets(*this, u, source, {delta_, delta_max_, allow_base, version_, base_, delta_stats_});
  end_update(declared, plan, start);
}

void sender::reset_peers() {
  for (auto& p : peers_by_rank_) {
    p->took_delta = p->fell_back = false;
    p->forget_update_regions();  // each update's grants bring the keys of the regions made for it
  }
}

asio::awaitable<void> sender::transmit(backend::bucket_update& u) {
  worker::engaged progressing(worker_);
  // Checksums (and deltas): one pass over the whole update, off the event loop,
  // before the first byte is sent (each "done" carries its bucket's checksum).
  std::vector<std::uint64_t> checksums;
  if (args_.wire.checksums || u.work) {
    if (!hash_pool_) hash_pool_ = std::make_unique<asio::thread_pool>(1);
    // (Raw pointers: GCC 12 may destroy an owning capture of a lambda written
    // inside co_await twice, async/offload.h.)
    backend::bucket_update* update = &u;
    backend::delta_snapshot* base = &base_;
    checksums = co_await async::offload(hash_pool_->get_executor(), [update, base] {
      std::vector<std::uint64_t> out;
      out.reserve(update->payloads.size());
      backend::hash_buckets(*update, *base, [&out](std::size_t, std::uint64_t h) { out.push_back(h); });
      return out;
    });
  }
  if (!u.offer)
    co_await announce_all(peers_, u.header);
  else
    co_await offer_to_all(u);
  std::vector<asio::awaitable<void>> streams;
  for (auto& p : peers_by_rank_)
    streams.push_back(with_peer_reason(
        stream_to(p, worker_, u.payloads, checksums, u.plan, u.seq, u.work ? &u.encoded : nullptr), p));
  co_await async::all_of(std::move(streams));
  co_await confirm_all(peers_, u.seq);
}

asio::awaitable<void> sender::offer_to_all(const backend::bucket_update& u) {
  std::vector<asio::awaitable<void>> offers;
  for (auto& p : peers_by_rank_)
    offers.push_back([](std::shared_ptr<downstream> p, std::array<std::byte, 48> header, std::array<std::byte, 32> dh,
                        bool offered, std::uint64_t seq, std::chrono::milliseconds timeout) -> asio::awaitable<void> {
      std::vector<asio::const_buffer> headers{asio::buffer(header), asio::buffer(dh)};
      co_await net::write_all(*p->socket, headers, timeout, p->name + ": update header");
      links::throw_if_failed(
          co_await links::read_status(*p->socket, timeout,
                                      p->name + ": waiting for the worker to accept update " + std::to_string(seq)),
          p->name + " refused the update");
      if (!offered) co_return;
      const auto answer =
          co_await links::read_status(*p->socket, timeout, p->name + ": waiting for its answer to the delta offer");
      if (answer.code == static_cast<std::uint32_t>(errc::invalid_state)) {
        p->fell_back = true;  // it does not hold the base: this update goes to it full
      } else {
        links::throw_if_failed(answer, p->name + " refused the delta offer");
        p->took_delta = true;
      }
    }(p, u.header, u.offer->header, u.offer->has_base, u.seq, args_.timeout));
  co_await async::all_of(std::move(offers));
}

std::vector<backend::peer_delta_outcome> sender::delta_outcomes() const {
  // A stream reaches its worker's subtree (relays): each worker there took the
  // deltas, or got the update full.
  std::vector<backend::peer_delta_outcome> out;
  for (const auto& p : peers_by_rank_)
    out.push_back({topology_.subtree(p->rank, args_.world_size - 1).size(), p->took_delta, p->fell_back});
  return out;
}

void sender::failed(const backend::bucket_update&, std::exception_ptr) { close(); }

}  // namespace refit::ucx
