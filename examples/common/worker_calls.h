// A trainer's control connections to its workers, called all at once: every call
// names its worker in the error it raises, and the first error wins.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>

#include <refit/async/all_of.h>
#include <refit/control/client.h>
#include <refit/json_reader.h>

namespace refit::example {

class worker_group {
 public:
  /// `name_of(i)` names worker i in errors ("worker rank 1").
  explicit worker_group(std::function<std::string(std::size_t)> name_of) : name_of_(std::move(name_of)) {}

  /// Connects a new client (the group's i-th worker) to host:port.
  asio::awaitable<void> connect(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret,
                                std::string host, std::uint16_t port);
  std::size_t size() const noexcept { return clients_.size(); }
  /// Worker i's own connection, for calls that are not the same on every worker.
  control::client& at(std::size_t i) { return *clients_.at(i); }

  /// `method` on every worker at once with params_for(i); the answers by worker.
  asio::awaitable<std::vector<json>> call_each(std::string method, std::function<json(std::size_t)> params_for);
  /// The same `params` for every worker.
  asio::awaitable<std::vector<json>> call_all(std::string method, json params);
  void close();

 private:
  std::function<std::string(std::size_t)> name_of_;
  std::vector<std::unique_ptr<control::client>> clients_;
};

/// Awaits `op` and drops its result.
template <class T>
asio::awaitable<void> discard(asio::awaitable<T> op) {
  co_await std::move(op);
}

/// Both at once; the first error wins (asio's && would report "multiple exceptions").
template <class A, class B>
asio::awaitable<void> both(asio::awaitable<A> a, asio::awaitable<B> b) {
  std::vector<asio::awaitable<void>> ops;
  ops.push_back(discard(std::move(a)));
  ops.push_back(discard(std::move(b)));
  co_await async::all_of(std::move(ops));
}

}  // namespace refit::example
