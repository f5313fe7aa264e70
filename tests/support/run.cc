#include "tests/support/run.h"

#include <refit/error.h>

namespace refit::testing {

std::string outcome::message() const {
  if (!error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const refit::error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "non-standard exception";
  }
}

int outcome::kind() const {
  if (!error) return 0;
  try {
    std::rethrow_exception(error);
  } catch (const refit::error& e) {
    return static_cast<int>(e.kind());
  } catch (...) {
    return -1;
  }
}

bool run(asio::io_context& io, std::chrono::milliseconds limit) {
  io.restart();
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!io.stopped()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    io.run_for(std::chrono::milliseconds(100));
  }
  return true;
}

void run_to_completion(asio::io_context& io, asio::awaitable<void> work, std::chrono::milliseconds limit) {
  auto result = spawn(io, std::move(work));
  if (!run_until(
          io, [&] { return result->done; }, limit))
    throw refit::error(refit::errc::timeout, "test coroutine did not finish in time");
  if (result->error) std::rethrow_exception(result->error);
}

asio::awaitable<void> send_views(weight_sender& sender, const update_metadata& meta, std::vector<tensor_view> views) {
  co_await trainer_send_weights(sender, meta, views);
}

asio::awaitable<void> receive_update(weight_transfer_engine& engine, std::unique_ptr<update_info> info,
                                     load_weights_fn load, bool drain) {
  co_await engine.receive_weights(*info, std::move(load));
  if (drain) co_await engine.drain_pending();
}

}  // namespace refit::testing
