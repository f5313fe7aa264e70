// The bridge from CUDA stream completion to asio: a coroutine co_awaits GPU work
// without blocking its event loop and without polling.
//
//   co_await refit::cuda::when_done(stream);          // all work queued so far
//   co_await refit::cuda::when_recorded(done, stream); // records `done`, then waits
//
// How it works: a host callback is enqueued on the stream behind the awaited work.
// CUDA runs it on one of its own (driver) threads; it only takes a mutex and posts
// the completion to the awaiting handler's executor. It never resumes the coroutine
// there and never calls CUDA (CUDA forbids both, and a callback blocks its stream
// while it runs). The handler then runs on its executor, where CUDA errors are turned
// into cuda_error.
//
// Lifetime rules:
//  - The stream and events may be destroyed as soon as the wait is initiated (for
//    use_awaitable: once the co_await has begun): CUDA keeps queued work and the
//    callback alive. Memory the queued work touches must of course outlive it.
//  - Each pending wait holds outstanding work on its handler's executor
//    (executor_work_guard), so io_context::run() does not return while a wait is
//    pending, even when nothing else is queued.
//  - If the execution context is shut down or destroyed while waits are pending
//    (ctx.stop() and then ~io_context), their handlers are destroyed, not invoked,
//    on the thread shutting the context down: an awaiting coroutine's frame is
//    destroyed without resuming. The callback arriving later finds the wait gone and
//    does nothing. Nothing runs on a driver thread except the callback itself.
//  - The completion is always posted, never invoked inside the initiating call, also
//    when enqueueing the callback fails.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <exception>
#include <memory>
#include <optional>
#include <source_location>
#include <string_view>
#include <utility>

#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/awaitable.hpp>
#include <asio/execution/context.hpp>
#include <asio/execution_context.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>
#include <asio/query.hpp>
#include <asio/use_awaitable.hpp>

namespace refit::cuda {

class event;

/// How the completion callback is enqueued.
enum class notify_by {
  /// cudaStreamAddCallback (the default). CUDA calls it also after a device error
  /// (an illegal address, a trap) with that error, so the wait completes with
  /// cuda_error instead of never. Not capturable into CUDA graphs.
  stream_callback,
  /// cudaLaunchHostFunc. Capturable into CUDA graphs, but CUDA does not call it
  /// after an error in the context: such a wait never completes, and its work guard
  /// keeps io_context::run() from returning. Use only where graphs need it and
  /// errors are detected otherwise.
  host_func,
};

namespace detail {

struct wait_registry;

/// One pending wait, type-erased; see await.cc for its life cycle.
class pending_wait {
 public:
  pending_wait(const pending_wait&) = delete;
  pending_wait& operator=(const pending_wait&) = delete;

  // Driver (or initiating) thread, under the registry lock: hands *this, and the
  // outcome, to the handler's executor.
  virtual void post(cudaError_t status) noexcept = 0;
  // Shutting-down thread, outside the lock: destroys the handler uninvoked.
  virtual void drop_handler() noexcept = 0;

  std::shared_ptr<wait_registry> registry;
  pending_wait* prev = nullptr;
  pending_wait* next = nullptr;
  // 1 while only the callback owns a registered wait; 2 while a shutdown also does.
  std::atomic<int> owners{1};
  // What failed, for the message: the enqueueing call if that failed, else the
  // awaited work. Static strings.
  std::string_view failed = "the work queued on the stream before the wait";
  std::source_location where;

 protected:
  explicit pending_wait(std::source_location where) : where(where) {}
  virtual ~pending_wait() = default;
  friend void release(pending_wait* op) noexcept;
};

/// Drops one owner of `op`, deleting it with the last.
void release(pending_wait* op) noexcept;

/// What to do on the stream before enqueueing the callback.
struct wait_target {
  cudaStream_t stream = nullptr;
  cudaEvent_t record = nullptr;    // cudaEventRecord(record, stream) first
  cudaEvent_t wait_for = nullptr;  // cudaStreamWaitEvent(stream, wait_for) first
};

/// Registers `op` with `ctx`'s registry and enqueues the callback; any failure is
/// delivered through op->post.
void start_wait(asio::execution_context& ctx, const wait_target& target, notify_by how, pending_wait* op);

/// The exception a failed wait completes with: cuda_error naming `failed`.
[[nodiscard]] std::exception_ptr wait_error(cudaError_t status, std::string_view failed,
                                            const std::source_location& where);

template <class Handler>
class wait_op final : public pending_wait {
  using executor = asio::associated_executor_t<Handler>;

 public:
  wait_op(Handler handler, std::source_location where)
      : pending_wait(where), guard_(asio::make_work_guard(asio::get_associated_executor(handler))),
        handler_(std::move(handler)) {}

  asio::execution_context& context() const { return asio::query(guard_->get_executor(), asio::execution::context); }

  void post(cudaError_t status) noexcept override {
    auto ex = guard_->get_executor();
    // If the context shuts down before this runs, the lambda is destroyed there,
    // and with it the wait and its handler: never on the driver thread.
    asio::post(ex,
               [self = std::unique_ptr<wait_op, deleter>(this), status]() mutable { finish(std::move(self), status); });
  }

  void drop_handler() noexcept override {
    handler_.reset();
    guard_.reset();
  }

 private:
  struct deleter {
    void operator()(wait_op* op) const noexcept { release(op); }
  };

  static void finish(std::unique_ptr<wait_op, deleter> self, cudaError_t status) {
    std::exception_ptr error;
    if (status != cudaSuccess) error = wait_error(status, self->failed, self->where);
    Handler handler = std::move(*self->handler_);
    // The guard outlives the call, so run() cannot return in between.
    auto guard = std::move(*self->guard_);
    self.reset();
    std::move(handler)(error);
  }

  std::optional<asio::executor_work_guard<executor>> guard_;
  std::optional<Handler> handler_;
};

template <class Token>
auto async_wait(const wait_target& target, notify_by how, std::source_location where, Token&& token) {
  return asio::async_initiate<Token, void(std::exception_ptr)>(
      [](auto handler, wait_target target, notify_by how, std::source_location where) {
        using op_type = wait_op<std::decay_t<decltype(handler)>>;
        auto* op = new op_type(std::move(handler), where);
        start_wait(op->context(), target, how, op);
      },
      token, target, how, where);
}

}  // namespace detail

/// Completes when all work queued on `stream` before the call has completed, or
/// with a cuda_error if that work failed (or the callback could not be enqueued).
/// Signature void(std::exception_ptr): with use_awaitable (the default) the co_await
/// returns, or throws the cuda_error. The completion runs on the handler's
/// associated executor (the awaiting coroutine's), never on a CUDA thread.
/// `stream` may be null (the legacy default stream).
template <class Token = const asio::use_awaitable_t<>&>
auto async_wait_stream(cudaStream_t stream, Token&& token = asio::use_awaitable,
                       notify_by how = notify_by::stream_callback,
                       std::source_location where = std::source_location::current()) {
  return detail::async_wait({.stream = stream}, how, where, std::forward<Token>(token));
}

/// Records `e` on `stream` (cudaEventRecord) and completes when it completes, as
/// async_wait_stream. Other streams can wait on `e` meanwhile (stream::wait), the
/// usual way of gating a processing stream on a communication stream.
template <class Token = const asio::use_awaitable_t<>&>
auto async_record_and_wait(cudaEvent_t e, cudaStream_t stream, Token&& token = asio::use_awaitable,
                           notify_by how = notify_by::stream_callback,
                           std::source_location where = std::source_location::current()) {
  return detail::async_wait({.stream = stream, .record = e}, how, where, std::forward<Token>(token));
}

/// Completes when `e` (recorded elsewhere, possibly on another stream) completes:
/// makes `waiter` wait for it (cudaStreamWaitEvent) and waits for `waiter`, which
/// therefore also waits for the work queued on it before. Pass a stream of your own:
/// the callbacks on one stream run in order, so waits sharing a stream would wait
/// for each other (why there is no hidden shared stream here).
template <class Token = const asio::use_awaitable_t<>&>
auto async_wait_event(cudaEvent_t e, cudaStream_t waiter, Token&& token = asio::use_awaitable,
                      notify_by how = notify_by::stream_callback,
                      std::source_location where = std::source_location::current()) {
  return detail::async_wait({.stream = waiter, .wait_for = e}, how, where, std::forward<Token>(token));
}

/// co_await when_done(stream): async_wait_stream with use_awaitable.
asio::awaitable<void> when_done(cudaStream_t stream, notify_by how = notify_by::stream_callback,
                                std::source_location where = std::source_location::current());

/// co_await when_recorded(e, stream): async_record_and_wait with use_awaitable.
asio::awaitable<void> when_recorded(const event& e, cudaStream_t stream, notify_by how = notify_by::stream_callback,
                                    std::source_location where = std::source_location::current());

}  // namespace refit::cuda
