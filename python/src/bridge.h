// How Python reaches refit's coroutines: one event loop (an io_context on a thread
// of its own, "refit's loop") runs every engine, sender, worker group and host the
// module creates. A blocking call posts its coroutine there and waits with the GIL
// released; an asyncio call returns at once and its result is delivered to the
// asyncio loop through loop.call_soon_threadsafe (see refit/_loop.py). Python
// code that refit calls back (load_weights, hooks) runs with the GIL re-acquired,
// on refit's loop or its processing threads.
#pragma once

#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/bind_cancellation_slot.hpp>
#include <asio/cancellation_signal.hpp>
#include <asio/co_spawn.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <refit/json_reader.h>

namespace refit::py {

namespace nb = nanobind;

/// refit's loop for this process, started on first use.
class runtime {
 public:
  static runtime& get();
  asio::any_io_executor executor() { return io_.get_executor(); }
  /// Whether the calling thread is refit's loop.
  bool on_loop() const noexcept { return std::this_thread::get_id() == thread_.get_id(); }
  /// Stops the loop and joins its thread (at interpreter exit). Idempotent.
  void stop();
  bool stopped() const noexcept { return stopped_; }

 private:
  runtime();
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  bool stopped_ = false;
};

/// A Python object that C++ may copy and destroy on any thread: the reference is
/// dropped under the GIL (and not at all once the interpreter is gone).
class shared_object {
 public:
  shared_object() = default;
  explicit shared_object(nb::object o);
  nb::handle get() const noexcept { return ptr_ ? nb::handle(ptr_->ptr()) : nb::handle(); }
  explicit operator bool() const noexcept { return ptr_ && ptr_->is_valid(); }

 private:
  std::shared_ptr<nb::object> ptr_;
};

/// Where a Python callback's exception is kept, so the call that ran it raises
/// that same exception (not a refit error wrapping it).
class python_error_slot {
 public:
  /// Keeps `e` (the first one wins). Call with the GIL held.
  void keep(const nb::python_error& e);
  /// The kept exception, if any (empty otherwise).
  shared_object take();

 private:
  std::mutex mutex_;
  shared_object error_;
};

/// A refit error as the Python exception refit raises (refit.Error's subclass for
/// its kind); any other C++ exception as RuntimeError. GIL held.
nb::object python_exception(std::exception_ptr e, python_error_slot* slot = nullptr);
/// Sets the Python error indicator from `e` and throws nb::python_error. GIL held.
[[noreturn]] void raise(std::exception_ptr e, python_error_slot* slot = nullptr);

/// JSON <-> Python (dict, list, str, int, float, bool, None). GIL held.
nb::object to_python(const json& j);
json to_json(nb::handle o);

namespace detail {
// Waits for `done` with the GIL released, answering Ctrl-C: a pending signal
// cancels the operation (its cancellation signal gets `terminal`) and, once it has
// ended, the KeyboardInterrupt is raised.
void wait_released(std::future<void>& done, const std::shared_ptr<asio::cancellation_signal>& cancel);
}  // namespace detail

/// Runs `op` on refit's loop and waits for it with the GIL released; returns its
/// result or raises its exception (a kept Python exception of `slot` as itself).
/// Called with the GIL held. Pass a coroutine that owns what it uses (parameters
/// by value, or objects that outlive the call).
template <class T>
T block_on(asio::awaitable<T> op, python_error_slot* slot = nullptr) {
  auto& rt = runtime::get();
  if (rt.on_loop()) throw std::logic_error("refit: a blocking call from refit's own loop would deadlock");
  auto cancel = std::make_shared<asio::cancellation_signal>();
  std::promise<void> promise;
  auto done = promise.get_future();
  std::exception_ptr error;
  std::optional<T> value;
  asio::co_spawn(rt.executor(), std::move(op),
                 asio::bind_cancellation_slot(cancel->slot(), [&](std::exception_ptr e, T v) {
                   error = e;
                   if (!e) value.emplace(std::move(v));
                   promise.set_value();
                 }));
  detail::wait_released(done, cancel);
  if (error) raise(error, slot);
  return std::move(*value);
}

template <>
void block_on<void>(asio::awaitable<void> op, python_error_slot* slot);

namespace detail {
template <class F>
auto call(F fn) -> asio::awaitable<decltype(fn())> {
  co_return fn();
}
}  // namespace detail

/// Ends a refit object's life from its destructor: runs `op` (which owns what it
/// ends) on refit's loop. Off the loop it waits for it with the GIL released; on
/// the loop itself (a garbage collection inside a Python callback refit runs
/// there) waiting would deadlock, so it starts `op` and returns: `op` runs once
/// the callback is done. Never throws; after interpreter exit (no loop) `op` is
/// destroyed unrun.
void teardown(asio::awaitable<void> op) noexcept;

/// Runs `fn` on refit's loop (for engine state read or changed outside a
/// coroutine) and returns its result. GIL held; released while waiting.
template <class F>
auto on_loop(F fn) -> decltype(fn()) {
  using R = decltype(fn());
  return block_on<R>(detail::call(std::move(fn)));
}

/// An asyncio-side call in flight: cancel() asks the coroutine to stop (asio's
/// terminal cancellation, delivered on refit's loop).
class pending_call {
 public:
  explicit pending_call(std::shared_ptr<asio::cancellation_signal> signal) : signal_(std::move(signal)) {}
  void cancel();

 private:
  std::shared_ptr<asio::cancellation_signal> signal_;
};

/// Hands an asyncio call's outcome to its `done` callback, under the GIL (taken
/// here): done(result(), None), or done(None, the Python exception of `e`). What
/// the callback raises is reported as unraisable, never thrown into the loop.
void deliver(const shared_object& done, std::exception_ptr e, python_error_slot* slot,
             const std::function<nb::object()>& result);

/// Starts `op` on refit's loop and returns at once. When it ends,
/// `done(result, exception)` is called on refit's loop with the GIL held: result is
/// convert(value) (None on error), exception the Python exception (None on
/// success). refit/_loop.py's `done` hands both to the asyncio loop.
template <class T>
pending_call start(asio::awaitable<T> op, std::function<nb::object(T&)> convert, nb::object done,
                   std::shared_ptr<python_error_slot> slot = {}) {
  auto cancel = std::make_shared<asio::cancellation_signal>();
  shared_object callback(std::move(done));
  asio::co_spawn(runtime::get().executor(), std::move(op),
                 asio::bind_cancellation_slot(cancel->slot(),
                                              [callback, convert, slot, cancel](std::exception_ptr e, T v) mutable {
                                                deliver(callback, e, slot.get(), [&] { return convert(v); });
                                              }));
  return pending_call(std::move(cancel));
}

/// The void form: done(None, exception).
pending_call start_void(asio::awaitable<void> op, nb::object done, std::shared_ptr<python_error_slot> slot = {});

}  // namespace refit::py
