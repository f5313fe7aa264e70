#include "examples/common/worker_calls.h"

namespace refit::example {
namespace {

// One call whose error names the worker.
asio::awaitable<void> call_one(control::client& c, std::string name, std::string method, json params, json* out) {
  std::exception_ptr failure;
  try {
    *out = co_await c.call(method, std::move(params));
  } catch (...) {
    failure = std::current_exception();
  }
  if (!failure) co_return;
  try {
    std::rethrow_exception(failure);
  } catch (const error& e) {
    throw error(e.code(), name + ": " + e.message());
  }
}

}  // namespace

asio::awaitable<void> worker_group::connect(asio::any_io_executor executor, std::chrono::milliseconds timeout,
                                            std::string secret, std::string host, std::uint16_t port) {
  clients_.push_back(std::make_unique<control::client>(std::move(executor), timeout, std::move(secret)));
  co_await clients_.back()->connect(std::move(host), port);
}

asio::awaitable<std::vector<json>> worker_group::call_each(std::string method,
                                                           std::function<json(std::size_t)> params_for) {
  std::vector<json> results(clients_.size());
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i)
    ops.push_back(call_one(*clients_[i], name_of_(i), method, params_for(i), &results[i]));
  co_await async::all_of(std::move(ops));
  co_return results;
}

asio::awaitable<std::vector<json>> worker_group::call_all(std::string method, json params) {
  co_return co_await call_each(std::move(method), [&params](std::size_t) { return params; });
}

void worker_group::close() {
  for (auto& c : clients_) c->close();
}

}  // namespace refit::example
