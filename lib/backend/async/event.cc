#include <refit/backend/async/event.h>

#include <asio/experimental/as_tuple.hpp>
#include <asio/use_awaitable.hpp>

namespace refit::async {

event::event(asio::any_io_executor ex) : timer_(std::move(ex)) {
  timer_.expires_at(asio::steady_timer::time_point::max());
}

void event::set() {
  set_ = true;
  ++generation_;
  timer_.cancel();
}

void event::reset() {
  set_ = false;
  timer_.expires_at(asio::steady_timer::time_point::max());
}

asio::awaitable<void> event::wait() {
  const std::uint64_t seen = generation_;
  while (!set_ && generation_ == seen) co_await timer_.async_wait(asio::experimental::as_tuple(asio::use_awaitable));
}

}  // namespace refit::async
