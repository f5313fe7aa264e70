#include "lib/engine.h"

#include <asio/co_spawn.hpp>

namespace refit {

namespace {
// Runs before any member uses the executor.
engine_context checked(engine_context context) {
  if (!context.executor) throw_error(errc::invalid_argument, "engine_context: an executor is required");
  return context;
}
}  // namespace

weight_transfer_engine::weight_transfer_engine(weight_transfer_config config,
                                               engine_context context)
    : config_(std::move(config)), context_(checked(std::move(context))), deferred_(context_.executor) {}

weight_transfer_engine::~weight_transfer_engine() = default;

asio::any_io_executor weight_transfer_engine::processing_executor() {
  if (context_.processing_executor) return context_.processing_executor;
  if (!own_pool_) own_pool_ = std::make_unique<asio::thread_pool>(config_.processing_threads);
  return own_pool_->get_executor();
}

asio::awaitable<void> weight_transfer_engine::init_transfer_engine(const init_info& info) {
  const std::string name(backend());
  if (state_ == state::initializing || state_ == state::receiving)
    throw_error(errc::invalid_state, name + ": init_transfer_engine while " +
                                         (state_ == state::receiving ? "an update is being received"
                                                                     : "another init is running"));
  if (state_ == state::ready) do_shutdown();  // re-init replaces the old connection
  state_ = state::initializing;
  try {
    co_await do_init(info);
  } catch (...) {
    state_ = state::created;
    do_shutdown();
    throw;
  }
  state_ = state::ready;
}

asio::awaitable<void> weight_transfer_engine::receive_weights(const update_info& info,
                                                              load_weights_fn load_weights) {
  const std::string name(backend());
  switch (state_) {
    case state::ready: break;
    case state::receiving:
      throw_error(errc::invalid_state, name + ": receive_weights while another update is being received");
    case state::shut_down:
      throw_error(errc::invalid_state, name + ": receive_weights after shutdown (call init_transfer_engine again)");
    default:
      throw_error(errc::invalid_state, name + ": receive_weights before init_transfer_engine");
  }
  if (!load_weights) throw_error(errc::invalid_argument, name + ": load_weights is empty");
  // Deferred work of an earlier update must not overlap this one's staging slots.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, name + ": receive_weights while the previous update's "
                                            "processing is pending (call drain_pending first)");
  state_ = state::receiving;
  stats_ = {};
  try {
    co_await do_receive(info, std::move(load_weights));
  } catch (...) {
    if (state_ == state::receiving) state_ = state::ready;
    throw;
  }
  if (state_ == state::receiving) state_ = state::ready;
  if (!defers_processing()) co_await drain_pending();
}

asio::awaitable<void> weight_transfer_engine::drain_pending() {
  std::exception_ptr error;
  try {
    co_await deferred_.join();
  } catch (...) {
    error = std::current_exception();
  }
  stats_.finalize();
  if (error) std::rethrow_exception(error);
}

void weight_transfer_engine::shutdown() {
  // Deferred processing still reads staging memory that shutdown may free.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, std::string(backend()) + ": shutdown while " +
                                         std::to_string(deferred_.pending()) +
                                         " bucket(s) are still being processed; co_await drain_pending() first");
  if (state_ == state::shut_down || state_ == state::created) {
    state_ = state::shut_down;
    return;
  }
  state_ = state::shut_down;
  do_shutdown();
}

}  // namespace refit
