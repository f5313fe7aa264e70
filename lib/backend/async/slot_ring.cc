#include <refit/backend/async/slot_ring.h>

#include <asio/use_awaitable.hpp>

#include <refit/error.h>

namespace refit::async {

slot_ring::slot_ring(asio::any_io_executor ex, std::size_t size)
    : free_(ex, size), generation_(size, 0), held_(size, false), available_(size) {
  if (size == 0) throw_error(errc::invalid_argument, "slot_ring: size must be at least 1");
  for (std::size_t i = 0; i < size; ++i) free_.try_send(std::error_code{}, i);
}

asio::awaitable<std::size_t> slot_ring::acquire() {
  std::size_t slot = co_await free_.async_receive(asio::use_awaitable);
  held_[slot] = true;
  --available_;
  co_return slot;
}

void slot_ring::release(std::size_t slot) {
  if (slot >= held_.size() || !held_[slot])
    throw_error(errc::invalid_state, "slot_ring: release of slot " + std::to_string(slot) + " that is not held");
  held_[slot] = false;
  ++generation_[slot];
  ++available_;
  // Capacity equals the slot count and a slot is only sent back once, so this
  // cannot fail; a waiter, if any, receives it directly.
  free_.try_send(std::error_code{}, slot);
}

}  // namespace refit::async
