#include <refit/session.h>

#include <asio/post.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/internal/engine_access.h>

namespace refit {

namespace {

// engine_access::undo_refusal on the engine's processing executor (a lookup per
// tensor: milliseconds for a large model), resuming on the caller's loop.
asio::awaitable<std::string> undo_refusal_off_loop(weight_transfer_engine& engine, const update_metadata& meta) {
  auto loop = co_await asio::this_coro::executor;
  co_await asio::post(internal::engine_access::processing_executor(engine), asio::use_awaitable);
  std::string why;
  std::exception_ptr failure;
  try {
    why = internal::engine_access::undo_refusal(engine, meta);
  } catch (...) {
    failure = std::current_exception();
  }
  co_await asio::post(loop, asio::use_awaitable);
  if (failure) std::rethrow_exception(failure);
  co_return why;
}

}  // namespace

void weight_update_session::start_weight_update() {
  if (active_)
    throw_error(errc::invalid_state, "start_weight_update: a weight update is already active (finish it first)");
  if (!engine_.initialized())
    throw_error(errc::invalid_state,
                "start_weight_update: the weight transfer engine is not initialised "
                "(call init_weight_transfer_engine first)");
  internal::engine_access::begin_session(engine_);
  active_ = true;
  chunks_ = 0;
  applied_ = 0;
  prepared_ = false;
  undoable_ = false;
  undo_version_.reset();  // begin_session dropped the engine's undo
  failure_.clear();
}

void weight_update_session::require_undo() {
  if (!active_) throw_error(errc::invalid_state, "require_undo: no active weight update");
  if (chunks_ > 0 || updating_)
    throw_error(errc::invalid_state, "require_undo: chunks of this session were already received");
  undoable_ = true;
}

bool weight_update_session::holds_undo() const noexcept { return internal::engine_access::holds_undo(engine_); }

void weight_update_session::release_undo() noexcept {
  internal::engine_access::release_undo(engine_);
  undo_version_.reset();
}

asio::awaitable<void> weight_update_session::rollback_weight_update() {
  if (active_ || finishing_)
    throw_error(errc::invalid_state, "rollback_weight_update: a weight update session is open; abort it first");
  if (!holds_undo())
    throw_error(errc::invalid_state,
                "rollback_weight_update: no undo is held (only the last fleet-atomic update can be rolled back, "
                "until the next update starts)");
  const std::optional<std::int64_t> previous = undo_version_;
  finishing_ = true;
  std::exception_ptr failure;
  try {
    co_await internal::engine_access::rollback_session(engine_);
  } catch (...) {
    failure = std::current_exception();
  }
  finishing_ = false;
  undo_version_.reset();
  if (failure) {
    version_.reset();  // the weights are a mix (the engine says dirty): no version is claimed
    std::rethrow_exception(failure);
  }
  version_ = previous;
}

asio::awaitable<void> weight_update_session::update_weights(const update_info& info, load_weights_fn load_weights) {
  if (!active_)
    throw_error(errc::invalid_state, "update_weights: no active weight update (call start_weight_update first)");
  if (updating_ || preparing_)
    throw_error(errc::invalid_state, preparing_
                                         ? "update_weights: the session is being prepared"
                                         : "update_weights: another chunk of this update is still being received");
  if (undoable_) {
    updating_ = true;  // no other chunk, finish or abort while the check runs off the loop
    std::string why;
    std::exception_ptr failure;
    try {
      why = co_await undo_refusal_off_loop(engine_, info.metadata);
    } catch (...) {
      failure = std::current_exception();
    }
    updating_ = false;
    if (failure) std::rethrow_exception(failure);
    if (!why.empty()) {
      const std::string message =
          "update_weights: a fleet-atomic update needs every worker to be able to undo its commit, and this "
          "worker cannot: " +
          why;
      internal::engine_access::refuse_update(engine_, errc::unsupported, message);
      throw_error(errc::unsupported, message);
    }
  }
  if (prepared_) {
    const std::string message =
        "update_weights: the session is prepared (it voted to commit what it holds); finish "
        "or abort it";
    internal::engine_access::refuse_update(engine_, errc::invalid_state, message);
    throw_error(errc::invalid_state, message);
  }
  if (!failure_.empty()) {
    // The trainer is about to send this chunk: tell it at once.
    const std::string message = "update_weights: " + failure_ +
                                "; this session cannot complete: abort it and start "
                                "again";
    internal::engine_access::refuse_update(engine_, errc::invalid_state, message);
    throw_error(errc::invalid_state, message);
  }
  updating_ = true;
  const bool staged = info.commit.value_or(engine_.config().commit) == commit_mode::staged;
  std::exception_ptr failure;
  try {
    // A chunk may come while the previous chunk's deferred processing still runs
    // (update_weights answers once its bytes are in); the engine receives only
    // after that work is done, so wait for it here rather than refuse the chunk.
    // Its errors fail this chunk (the earlier one had reached the model: dirty).
    if (chunks_ > 0) co_await engine_.drain_pending();
    co_await engine_.receive_weights(info, std::move(load_weights));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    updating_ = false;
    failure_ = "chunk " + std::to_string(chunks_ + 1) + " failed: " + describe_error(failure);
    // Earlier in_place chunks of this session already reached the model (staged
    // ones were discarded with the stage).
    if (applied_ > 0 && !engine_.weights_dirty())
      internal::engine_access::mark_weights_dirty(
          engine_, "chunk " + std::to_string(chunks_ + 1) + " of a weight update failed after " +
                       std::to_string(applied_) + " chunk(s) of it had been applied");
    std::rethrow_exception(failure);
  }
  updating_ = false;
  ++chunks_;
  if (!staged) ++applied_;
}

asio::awaitable<void> weight_update_session::update_weights(const json& update_info_json,
                                                            load_weights_fn load_weights) {
  if (!active_)
    throw_error(errc::invalid_state, "update_weights: no active weight update (call start_weight_update first)");
  if (updating_ || reading_)
    throw_error(errc::invalid_state, "update_weights: another chunk of this update is still being received");
  // Read off the event loop; meanwhile another chunk or a finish is refused as
  // while receiving.
  reading_ = true;
  std::unique_ptr<update_info> info;
  std::exception_ptr failure;
  try {
    info = co_await engine_.read_update_info(update_info_json);
  } catch (...) {
    failure = std::current_exception();
  }
  reading_ = false;
  if (failure) std::rethrow_exception(failure);
  co_await update_weights(*info, std::move(load_weights));
}

asio::awaitable<void> weight_update_session::prepare_weight_update() {
  if (!active_)
    throw_error(errc::invalid_state, "prepare_weight_update: no active weight update (call start_weight_update first)");
  if (updating_ || reading_ || preparing_)
    throw_error(errc::invalid_state,
                std::string("prepare_weight_update: ") +
                    (preparing_ ? "the session is already being prepared" : "a chunk is still being received"));
  if (prepared_) co_return;
  if (!failure_.empty())
    throw_error(errc::invalid_state,
                "prepare_weight_update: " + failure_ + "; this session cannot be committed: abort it");
  if (applied_ > 0)
    throw_error(errc::invalid_state, "prepare_weight_update: " + std::to_string(applied_) +
                                         " chunk(s) of this session were applied in place as they arrived; only a "
                                         "staged session (commit \"staged\") can be prepared");
  preparing_ = true;
  std::exception_ptr failure;
  std::string fails_session;  // what the failure makes of the session ("": it stays as it was)
  try {
    fails_session = "its processing failed: ";
    co_await engine_.drain_pending();
    fails_session.clear();
    if (internal::engine_access::staged_chunks(engine_) != chunks_)
      throw_error(errc::invalid_state, "prepare_weight_update: the engine holds " +
                                           std::to_string(internal::engine_access::staged_chunks(engine_)) +
                                           " staged chunk(s) of the session's " + std::to_string(chunks_) +
                                           "; this session cannot be committed whole: abort it");
    // The commit's undo needs its scratch: reserved now, so a worker that cannot
    // hold it votes no rather than failing at its commit.
    fails_session = "its undo could not be reserved: ";
    if (undoable_) co_await internal::engine_access::reserve_undo(engine_);
  } catch (...) {
    failure = std::current_exception();
  }
  preparing_ = false;
  if (failure) {
    if (!fails_session.empty()) failure_ = fails_session + describe_error(failure);
    std::rethrow_exception(failure);
  }
  prepared_ = true;
}

asio::awaitable<void> weight_update_session::finish_weight_update(std::optional<std::int64_t> weight_version) {
  if (!active_)
    throw_error(errc::invalid_state, "finish_weight_update: no active weight update (call start_weight_update first)");
  if (updating_ || reading_) throw_error(errc::invalid_state, "finish_weight_update: a chunk is still being received");
  if (preparing_) throw_error(errc::invalid_state, "finish_weight_update: the session is being prepared");
  active_ = false;
  prepared_ = false;
  std::exception_ptr failure;
  if (!failure_.empty()) {
    // Nothing may claim a version for an update that did not arrive whole.
    failure = std::make_exception_ptr(
        error(errc::invalid_state, "finish_weight_update: " + failure_ + "; the session is closed without a version" +
                                       (applied_ > 0 ? std::string(" (its applied chunks leave the weights dirty)")
                                                     : std::string(" (nothing of it was committed)"))));
    internal::engine_access::discard_session(engine_);
    try {
      co_await engine_.drain_pending();
    } catch (const std::exception&) {
    }
  } else {
    finishing_ = true;
    try {
      co_await engine_.drain_pending();
      co_await internal::engine_access::commit_session(engine_, undoable_);
    } catch (...) {
      failure = std::current_exception();
    }
    finishing_ = false;
    if (failure && internal::engine_access::session_open(engine_))
      internal::engine_access::discard_session(engine_);  // the drain failed: nothing is committed
  }
  internal::engine_access::session_finished(engine_);
  if (failure) std::rethrow_exception(failure);
  if (holds_undo()) undo_version_ = version_;
  if (weight_version) version_ = weight_version;
  engine_.mark_weights_clean();
}

asio::awaitable<void> weight_update_session::abort_weight_update(std::string why) {
  if (!active_) co_return;
  if (updating_) throw_error(errc::invalid_state, "abort_weight_update: a chunk of the update is still being received");
  if (preparing_) throw_error(errc::invalid_state, "abort_weight_update: the session is being prepared");
  active_ = false;
  prepared_ = false;
  if (applied_ > 0 && !engine_.weights_dirty())
    internal::engine_access::mark_weights_dirty(
        engine_, "a weight update was aborted after " + std::to_string(applied_) + " chunk(s) of it had been applied" +
                     (why.empty() ? "" : " (" + why + ")"));
  // Staged chunks never reached the model: dropping the stage is all.
  internal::engine_access::discard_session(engine_);
  // Errors of the aborted update were already reported to whoever failed; drain so
  // the next update starts clean.
  try {
    co_await engine_.drain_pending();
  } catch (const std::exception&) {
  }
  internal::engine_access::session_finished(engine_);
}

}  // namespace refit
