// A bounded ring of staging slots: the receive loop acquires a slot before it
// receives bucket k, and the processing of bucket k releases it. With N slots the
// receiver runs at most N buckets ahead of processing, which bounds staging memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/experimental/channel.hpp>

namespace refit::async {

/// FIFO pool of slot indices [0, size). Not thread-safe: call from its executor.
class slot_ring {
 public:
  slot_ring(asio::any_io_executor ex, std::size_t size);

  /// A slot index, waiting while all are in use. Waiters are served in order.
  asio::awaitable<std::size_t> acquire();
  /// Returns `slot`; its generation advances, so a stale holder can tell (see
  /// generation()). Releasing a slot that is not held is a logic error (throws).
  void release(std::size_t slot);

  std::size_t size() const noexcept { return generation_.size(); }
  std::size_t available() const noexcept { return available_; }
  /// How many times `slot` has been released: a completion that carries the
  /// generation it was issued under detects reuse of the slot.
  std::uint64_t generation(std::size_t slot) const { return generation_.at(slot); }

 private:
  asio::experimental::channel<void(std::error_code, std::size_t)> free_;
  std::vector<std::uint64_t> generation_;
  std::vector<bool> held_;
  std::size_t available_;
};

}  // namespace refit::async
