// The UCX trainer: accept the workers (links), make an endpoint to each it sends
// to itself (every worker in a star, its children in a chain or tree) from its
// offer, then per bucket write where the worker granted (puts, flushed) or send it
// tagged, and only then say "done" (downstream.h, shared with relaying workers).
#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/ucx/ucx.h>
#include "downstream.h"  // private to this engine
#include "ucp.h"         // private to this engine

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

asio::awaitable<void> sender::stream_to(std::shared_ptr<downstream> p, std::shared_ptr<worker> w,
                                        const std::vector<std::vector<asio::const_buffer>>& payloads,
                                        const std::vector<std::uint64_t>& checksums, const bucket_plan& plan,
                                        std::uint64_t seq) {
  for (const bucket& b : plan.buckets) {
    std::optional<std::uint64_t> sum;
    if (!checksums.empty()) sum = checksums[b.index];
    co_await send_bucket(w, p, b.index, payloads[b.index], seq, sum, args_.timeout);
  }
}

asio::awaitable<void> sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const auto start = std::chrono::steady_clock::now();
  const auto [plan, seq] = begin_update(declared);
  try {
    worker::engaged progressing(worker_);
    // Every tensor the source yields is walked (and checked) before a byte leaves.
    std::vector<std::vector<asio::const_buffer>> payloads(plan.buckets.size());
    send_cursor cursor(declared, plan, source);
    for (const bucket& b : plan.buckets) {
      const auto& g = cursor.gather(b);
      payloads[b.index].assign(g.begin(), g.end());
    }
    cursor.finish();
    // Checksums: one pass over the whole update, off the event loop, before the
    // first byte is sent (each "done" carries its bucket's).
    std::vector<std::uint64_t> checksums;
    if (args_.wire.checksums) {
      if (!hash_pool_) hash_pool_ = std::make_unique<asio::thread_pool>(1);
      const auto* all = &payloads;
      checksums = co_await async::offload(hash_pool_->get_executor(), [all] {
        std::vector<std::uint64_t> out;
        out.reserve(all->size());
        for (const auto& p : *all) out.push_back(checksum(p));
        return out;
      });
    }
    co_await announce_all(peers_, links::update_header(seq, declared, plan));
    std::vector<asio::awaitable<void>> streams;
    for (auto& p : peers_by_rank_)
      streams.push_back(with_peer_reason(stream_to(p, worker_, payloads, checksums, plan, seq), p));
    co_await async::all_of(std::move(streams));
    co_await confirm_all(peers_, seq);
  } catch (...) {
    close();
    throw;
  }
  end_update(declared, plan, start);
}

}  // namespace refit::ucx
