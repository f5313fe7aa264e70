// The in-process host collective: a registry of groups; rank 0's broadcast copies
// its bytes once and queues them to every other rank, which copies them into its
// buffer. Deadlines and abort behave like a non-blocking NCCL communicator's.
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/channel.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/send_cursor.h>
#include <refit/engines/nccl/collective.h>

namespace refit::nccl {
namespace {

using payload = std::shared_ptr<const std::vector<std::byte>>;
using inbox = asio::experimental::channel<void(std::error_code, payload)>;

struct group {
  int world_size = 0;
  std::map<int, std::shared_ptr<inbox>> ranks;
  // Point-to-point: one queue per (sender, receiver), made by whichever comes first.
  std::map<std::pair<int, int>, std::shared_ptr<inbox>> pairs;
  asio::any_io_executor executor;
  bool aborted = false;

  std::shared_ptr<inbox> pair(int from, int to) {
    auto& box = pairs[{from, to}];
    if (!box) box = std::make_shared<inbox>(executor, 64);
    return box;
  }
};

std::mutex registry_mutex;
std::map<std::string, std::shared_ptr<group>>& registry() {
  static std::map<std::string, std::shared_ptr<group>> r;
  return r;
}

class host_collective final : public collective {
 public:
  host_collective(std::shared_ptr<group> g, int rank) : group_(std::move(g)), rank_(rank) {}
  ~host_collective() override { abort(); }

  asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds deadline) override {
    const std::string who = "host collective rank " + std::to_string(rank_);
    if (group_->aborted) throw_error(errc::peer_lost, who + ": the communicator was aborted");
    if (rank_ == 0) {
      auto copy = std::make_shared<const std::vector<std::byte>>(data, data + bytes);
      for (auto& [rank, box] : group_->ranks) {
        if (rank == 0) continue;
        auto [ec] = co_await async::with_deadline(
            box->async_send(std::error_code{}, copy, asio::experimental::as_tuple(asio::use_awaitable)), deadline,
            who + ": broadcast to rank " + std::to_string(rank));
        if (ec) throw_error(errc::peer_lost, who + ": rank " + std::to_string(rank) + " left the communicator");
      }
      co_return;
    }
    auto& box = *group_->ranks.at(rank_);
    auto [ec, got] = co_await async::with_deadline(box.async_receive(asio::experimental::as_tuple(asio::use_awaitable)),
                                                   deadline, who + ": broadcast from rank 0");
    if (ec || !got) throw_error(errc::peer_lost, who + ": the communicator was aborted");
    if (got->size() != bytes)
      throw_error(errc::protocol_error, who + ": rank 0 broadcast " + std::to_string(got->size()) +
                                            " bytes, this rank expected " + std::to_string(bytes));
    if (bytes) std::memcpy(data, got->data(), bytes);
  }

  asio::awaitable<void> exchange(std::span<const p2p_op> ops, std::chrono::milliseconds deadline) override {
    const std::string who = "host collective rank " + std::to_string(rank_);
    // Sends first (queued, copied now), then receives in order: as NCCL's group,
    // no rank waits on another's receive to post its sends.
    for (const auto& op : ops) {
      if (group_->aborted) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      if (op.type != p2p_op::kind::send) continue;
      if (op.peer < 0 || op.peer >= group_->world_size || op.peer == rank_)
        throw_error(errc::invalid_argument, who + ": no peer rank " + std::to_string(op.peer));
      auto copy = std::make_shared<const std::vector<std::byte>>(op.data, op.data + op.bytes);
      auto [ec] = co_await async::with_deadline(
          group_->pair(rank_, op.peer)
              ->async_send(std::error_code{}, copy, asio::experimental::as_tuple(asio::use_awaitable)),
          deadline, who + ": send to rank " + std::to_string(op.peer));
      if (ec) throw_error(errc::peer_lost, who + ": rank " + std::to_string(op.peer) + " left the communicator");
    }
    for (const auto& op : ops) {
      if (op.type != p2p_op::kind::recv) continue;
      if (op.peer < 0 || op.peer >= group_->world_size || op.peer == rank_)
        throw_error(errc::invalid_argument, who + ": no peer rank " + std::to_string(op.peer));
      if (group_->aborted) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      auto box = group_->pair(op.peer, rank_);
      auto [ec, got] =
          co_await async::with_deadline(box->async_receive(asio::experimental::as_tuple(asio::use_awaitable)), deadline,
                                        who + ": receive from rank " + std::to_string(op.peer));
      if (ec || !got) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      if (got->size() != op.bytes)
        throw_error(errc::protocol_error, who + ": rank " + std::to_string(op.peer) + " sent " +
                                              std::to_string(got->size()) + " bytes, this rank expected " +
                                              std::to_string(op.bytes));
      if (op.bytes) std::memcpy(op.data, got->data(), op.bytes);
    }
  }

  void abort() noexcept override {
    if (group_->aborted) return;
    group_->aborted = true;
    for (auto& [rank, box] : group_->ranks) box->close();
    for (auto& [key, box] : group_->pairs) box->close();
  }

 private:
  std::shared_ptr<group> group_;
  int rank_;
};

class host_provider final : public collective_provider {
 public:
  std::string name() const override { return "host"; }
  std::string new_group_id() override {
    std::lock_guard lock(registry_mutex);
    return "host-group-" + std::to_string(++next_id_);
  }

  asio::awaitable<std::unique_ptr<collective>> join(std::string id, int rank, int world_size,
                                                    asio::any_io_executor executor,
                                                    std::chrono::milliseconds deadline) override {
    std::shared_ptr<group> g;
    {
      std::lock_guard lock(registry_mutex);
      auto& slot = registry()[id];
      if (!slot || slot->aborted) {
        slot = std::make_shared<group>();
        slot->world_size = world_size;
        slot->executor = executor;
      }
      g = slot;
      if (g->world_size != world_size)
        throw_error(errc::invalid_argument, "host collective " + id + ": world size " + std::to_string(world_size) +
                                                ", the group has " + std::to_string(g->world_size));
      if (g->ranks.count(rank))
        throw_error(errc::invalid_argument,
                    "host collective " + id + ": rank " + std::to_string(rank) + " joined twice");
      g->ranks[rank] = std::make_shared<inbox>(executor, 64);
    }
    // Like ncclCommInitRank: complete when every rank has joined.
    asio::steady_timer timer(executor);
    const auto until = std::chrono::steady_clock::now() + deadline;
    while (static_cast<int>(g->ranks.size()) < world_size) {
      if (std::chrono::steady_clock::now() >= until)
        throw_error(errc::timeout, "host collective " + id + ": " + std::to_string(g->ranks.size()) + " of " +
                                       std::to_string(world_size) + " ranks joined within " +
                                       std::to_string(deadline.count()) + " ms");
      timer.expires_after(std::chrono::milliseconds(1));
      co_await timer.async_wait(asio::use_awaitable);
    }
    if (rank == 0) {
      std::lock_guard lock(registry_mutex);
      registry().erase(id);  // the group lives on in its members
    }
    co_return std::make_unique<host_collective>(g, rank);
  }

  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<host_staging>(count, bytes);
  }

  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    pack_pieces(pieces, dst);
    co_return;
  }

  bool device_sources() const noexcept override { return false; }

 private:
  std::uint64_t next_id_ = 0;
};

}  // namespace

std::shared_ptr<collective_provider> host_collectives() {
  static auto provider = std::make_shared<host_provider>();
  return provider;
}

}  // namespace refit::nccl
