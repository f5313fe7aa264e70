// What a ucx worker registers for the sender's puts beyond its staging (private to
// the ucx engine): the model's own memory and a staged commit's stage, per update,
// and the grant that names those ranges (wire::mode_put_pieces).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>
#include <asio/thread_pool.hpp>

#include <refit/backend/async/offload.h>
#include "ucp.h"   // private to this engine
#include "wire.h"  // private to this engine

namespace refit::ucx {

// The memory of one update's destinations outside the staging (the model's own
// memory under direct receive, a staged commit's stage, a sharded worker's
// tensors), registered for the sender's puts as it is granted, off the event loop
// (on RDMA hardware a registration pins pages), and released when the update ends.
// Region ids from wire::first_update_region on, never reused within the engine.
class update_registry {
 public:
  update_registry(std::shared_ptr<context> ctx, asio::any_io_executor registrar, std::uint32_t& next_id,
                  refit::device where)
      : ctx_(std::move(ctx)), registrar_(std::move(registrar)), next_id_(next_id), where_(where) {}

  /// A region of this update; `announced` once its key went to the sender.
  struct region {
    std::uint32_t id = 0;
    std::unique_ptr<registration> reg;
    bool announced = false;
  };
  /// The region holding each of `pieces` ([data, data + size), none empty), made
  /// for those no region holds yet. Runs on one executor at a time (the loop).
  asio::awaitable<std::vector<region*>> cover(std::span<const asio::mutable_buffer> pieces) {
    std::vector<region*> out(pieces.size(), nullptr);
    std::vector<std::pair<std::byte*, std::uint64_t>> missing;
    std::vector<std::size_t> missing_at;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      auto* p = static_cast<std::byte*>(pieces[i].data());
      if (region* r = find(p, pieces[i].size())) {
        out[i] = r;
      } else {
        missing.emplace_back(p, pieces[i].size());
        missing_at.push_back(i);
      }
    }
    if (!missing.empty()) {
      std::vector<std::unique_ptr<registration>> made;
      auto* m = &missing;
      auto* into = &made;
      auto* ctx = &ctx_;
      const refit::device* where = &where_;
      co_await async::offload(registrar_, [m, into, ctx, where] {
        for (auto [p, n] : *m) into->push_back(std::make_unique<registration>(*ctx, p, n, *where));
      });
      for (std::size_t k = 0; k < made.size(); ++k) {
        std::byte* base = made[k]->base();
        auto it = by_base_.emplace(base, region{next_id_++, std::move(made[k]), false});
        out[missing_at[k]] = &it->second;
      }
    }
    co_return out;
  }
  std::size_t size() const noexcept { return by_base_.size(); }

 private:
  // The region starting nearest below p, if it holds [p, p + n) (pieces are parts
  // of disjoint tensors; a piece no such region holds gets its own).
  region* find(const std::byte* p, std::uint64_t n) {
    auto it = by_base_.upper_bound(p);
    if (it == by_base_.begin()) return nullptr;
    --it;
    return it->second.reg->contains(p, n) ? &it->second : nullptr;
  }
  std::shared_ptr<context> ctx_;
  asio::any_io_executor registrar_;
  std::uint32_t& next_id_;
  refit::device where_;                              // of every piece
  std::multimap<const std::byte*, region> by_base_;  // by the region's base
};

/// Where an engine's registries come from: the thread that registers and releases
/// memory off the loop, and the next region id (never reused within the engine).
class registrar {
 public:
  /// An empty registry for one update, on `ctx`, of memory on `where`.
  std::unique_ptr<update_registry> open(std::shared_ptr<context> ctx, refit::device where = device::cpu()) {
    return std::make_unique<update_registry>(std::move(ctx), pool_.get_executor(), next_id_, where);
  }
  /// Releases `registry` (the update's puts completed, or it failed) on this
  /// thread, not the loop: unpinning costs on RDMA hardware.
  asio::awaitable<void> close(std::unique_ptr<update_registry> registry);

 private:
  asio::thread_pool pool_{1};
  std::uint32_t next_id_ = wire::first_update_region;
};

/// Fills `g` as a mode_put_pieces grant for `pieces` (none empty), held by
/// `regions` (cover()'s answer), and returns the records that follow it: each
/// piece's range and region, with the region's extent and key where `fresh(region)`
/// says the sender has not seen it in this update.
std::vector<std::byte> put_pieces_grant(std::span<const asio::mutable_buffer> pieces,
                                        std::span<update_registry::region* const> regions,
                                        const std::function<bool(update_registry::region&)>& fresh, wire::grant& g);

}  // namespace refit::ucx
