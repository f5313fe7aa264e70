#include <refit/backend/async/drain_scope.h>

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>

namespace refit::async {

drain_scope::drain_scope(asio::any_io_executor ex) : ex_(ex), idle_(ex) { idle_.set(); }

void drain_scope::add() noexcept {
  if (pending_++ == 0) idle_.reset();
}

void drain_scope::done(std::exception_ptr error) {
  if (error && !error_) error_ = error;
  if (--pending_ == 0) idle_.set();
}

void drain_scope::spawn(asio::awaitable<void> work) {
  add();
  asio::co_spawn(ex_, std::move(work), asio::bind_executor(ex_, [this](std::exception_ptr e) { done(e); }));
}

asio::awaitable<void> drain_scope::join() {
  co_await idle_.wait();
  if (auto e = std::exchange(error_, nullptr)) std::rethrow_exception(e);
}

}  // namespace refit::async
