#include <refit/cuda/await.h>

#include <mutex>

#include <refit/cuda/error.h>
#include <refit/cuda/event.h>

// Life cycle of a wait (detail::pending_wait):
//
//   start_wait    links it into its execution context's registry, enqueues the
//                 callback; the callback owns it from then on.
//   callback      (driver thread) under the registry lock: if the registry is open,
//                 unlinks it and posts it to the handler's executor (ownership moves
//                 into the posted function); if the context has shut down, drops
//                 ownership instead.
//   finish        (executor) destroys the wait, then invokes the handler.
//   shutdown      (the context's, on the thread destroying it) closes the registry
//                 under the lock and takes a second ownership of every wait still
//                 linked; outside the lock it destroys their handlers (coroutine
//                 frames may run arbitrary destructors, CUDA calls included, which
//                 must not run under a lock a driver thread may need) and releases.
//
// Posting under the lock is what makes shutdown safe: the registry's service shuts
// down before the scheduler (services shut down in reverse order of creation), so
// once shutdown holds the lock, no callback is inside asio::post, and later ones
// see the registry closed.

namespace refit::cuda::detail {

struct wait_registry {
  std::mutex mutex;
  bool open = true;
  pending_wait* head = nullptr;

  // Both under `mutex`.
  void link(pending_wait* op) noexcept {
    op->prev = nullptr;
    op->next = head;
    if (head != nullptr) head->prev = op;
    head = op;
  }
  void unlink(pending_wait* op) noexcept {
    if (op->prev != nullptr)
      op->prev->next = op->next;
    else
      head = op->next;
    if (op->next != nullptr) op->next->prev = op->prev;
    op->prev = op->next = nullptr;
  }
};

namespace {

// One per execution context: its registry of pending waits.
class wait_service final : public asio::execution_context::service {
 public:
  static inline asio::execution_context::id id;

  explicit wait_service(asio::execution_context& ctx)
      : asio::execution_context::service(ctx), registry_(std::make_shared<wait_registry>()) {}

  const std::shared_ptr<wait_registry>& registry() const noexcept { return registry_; }

 private:
  void shutdown() override {
    pending_wait* abandoned = nullptr;
    {
      const std::lock_guard lock(registry_->mutex);
      registry_->open = false;
      abandoned = registry_->head;
      registry_->head = nullptr;
      for (pending_wait* op = abandoned; op != nullptr; op = op->next)
        op->owners.fetch_add(1, std::memory_order_relaxed);
    }
    // The list links are no longer touched by callbacks (they only look at `open`).
    while (abandoned != nullptr) {
      pending_wait* op = abandoned;
      abandoned = op->next;
      op->drop_handler();
      release(op);
    }
  }

  std::shared_ptr<wait_registry> registry_;
};

// Driver thread (or the initiating one, for a failed enqueue). No CUDA calls.
void deliver(pending_wait* op, cudaError_t status) noexcept {
  const std::shared_ptr<wait_registry> registry = op->registry;  // outlives *op
  std::unique_lock lock(registry->mutex);
  if (registry->open) {
    registry->unlink(op);
    op->post(status);
    return;
  }
  lock.unlock();
  release(op);  // shut down: the handler is (being) destroyed by the shutdown
}

void CUDART_CB on_stream_callback(cudaStream_t, cudaError_t status, void* user) {
  deliver(static_cast<pending_wait*>(user), status);
}

void CUDART_CB on_host_func(void* user) { deliver(static_cast<pending_wait*>(user), cudaSuccess); }

}  // namespace

void release(pending_wait* op) noexcept {
  if (op->owners.fetch_sub(1, std::memory_order_acq_rel) == 1) delete op;
}

void start_wait(asio::execution_context& ctx, const wait_target& target, notify_by how, pending_wait* op) {
  op->registry = asio::use_service<wait_service>(ctx).registry();
  {
    std::unique_lock lock(op->registry->mutex);
    if (!op->registry->open) {
      // Initiated while the context shuts down: nothing could run the handler.
      lock.unlock();
      op->drop_handler();
      release(op);
      return;
    }
    op->registry->link(op);
  }

  std::string_view call;
  cudaError_t status = cudaSuccess;
  if (target.record != nullptr) {
    call = "cudaEventRecord(event, stream)";
    status = cudaEventRecord(target.record, target.stream);
  } else if (target.wait_for != nullptr) {
    call = "cudaStreamWaitEvent(stream, event, 0)";
    status = cudaStreamWaitEvent(target.stream, target.wait_for, 0);
  }
  if (status == cudaSuccess) {
    if (how == notify_by::stream_callback) {
      call = "cudaStreamAddCallback(stream, callback, wait, 0)";
      status = cudaStreamAddCallback(target.stream, &on_stream_callback, op, 0);
    } else {
      call = "cudaLaunchHostFunc(stream, callback, wait)";
      status = cudaLaunchHostFunc(target.stream, &on_host_func, op);
    }
    // From here on the callback owns op and may already have run: no more access
    // unless enqueueing failed.
    if (status == cudaSuccess) return;
  }
  // Clear the runtime's last-error slot so a later check does not see this again
  // (as REFIT_CUDA_CHECK does); the failure travels through the handler.
  (void)cudaGetLastError();
  op->failed = call;
  deliver(op, status);
}

std::exception_ptr wait_error(cudaError_t status, std::string_view failed, const std::source_location& where) {
  return std::make_exception_ptr(cuda_error(status, failed, where));
}

}  // namespace refit::cuda::detail

namespace refit::cuda {

asio::awaitable<void> when_done(cudaStream_t stream, notify_by how, std::source_location where) {
  co_await async_wait_stream(stream, asio::use_awaitable, how, where);
}

asio::awaitable<void> when_recorded(const event& e, cudaStream_t stream, notify_by how, std::source_location where) {
  co_await async_record_and_wait(e.get(), stream, asio::use_awaitable, how, where);
}

}  // namespace refit::cuda
