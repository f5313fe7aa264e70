#include "bridge.h"

#include <chrono>

#include <refit/error.h>

namespace refit::py {

runtime::runtime() : work_(io_.get_executor()) {
  thread_ = std::thread([this] {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        // A handler threw past its coroutine: report it and keep the loop alive,
        // every engine of the process depends on it.
        nb::gil_scoped_acquire gil;
        PyErr_SetString(PyExc_RuntimeError, (std::string("refit's loop: ") + e.what()).c_str());
        PyErr_WriteUnraisable(nullptr);
      }
    }
  });
}

runtime& runtime::get() {
  // Never destroyed: it may still be referenced while the interpreter exits; stop()
  // (from atexit) ends its thread.
  static runtime* instance = new runtime();
  return *instance;
}

void runtime::stop() {
  if (stopped_) return;
  stopped_ = true;
  work_.reset();
  io_.stop();
  if (thread_.joinable()) {
    if (on_loop()) {
      thread_.detach();
    } else {
      nb::gil_scoped_release release;
      thread_.join();
    }
  }
}

shared_object::shared_object(nb::object o)
    : ptr_(new nb::object(std::move(o)), [](nb::object* p) {
        if (nb::detail::cleanup_guard guard{}) {
          delete p;
        } else {
          (void)p->release();  // the interpreter is gone: leak the reference, not crash
          delete p;
        }
      }) {}

void python_error_slot::keep(const nb::python_error& e) {
  std::lock_guard lock(mutex_);
  if (!error_) error_ = shared_object(nb::borrow(e.value()));
}

shared_object python_error_slot::take() {
  std::lock_guard lock(mutex_);
  return std::exchange(error_, shared_object());
}

namespace {

nb::object error_class(errc kind) {
  // refit._errors.error_class, found on first use; never destroyed (a static
  // nb::object would be released after the interpreter is gone).
  static nb::object* by_kind = nullptr;
  if (!by_kind) by_kind = new nb::object(nb::module_::import_("refit._errors").attr("error_class"));
  return (*by_kind)(nb::str(std::string(errc_name(kind)).c_str()));
}

}  // namespace

nb::object python_exception(std::exception_ptr e, python_error_slot* slot) {
  if (slot) {
    if (auto kept = slot->take()) return nb::borrow(kept.get());
  }
  try {
    std::rethrow_exception(e);
  } catch (const nb::python_error& err) {
    return nb::borrow(err.value());
  } catch (const refit::error& err) {
    nb::object cls = error_class(err.kind());
    return cls(nb::str(err.message().c_str()), nb::str(std::string(errc_name(err.kind())).c_str()));
  } catch (const std::system_error& err) {
    // Another category's error (CUDA's, the OS's): refit.Error with the category's
    // name as its kind ("cuda", "system").
    nb::object cls = nb::module_::import_("refit._errors").attr("error_class")(err.code().category().name());
    return cls(nb::str(err.what()), nb::str(err.code().category().name()));
  } catch (const std::exception& err) {
    return nb::borrow(PyExc_RuntimeError)(nb::str(err.what()));
  } catch (...) {
    return nb::borrow(PyExc_RuntimeError)(nb::str("refit: unknown C++ exception"));
  }
}

void raise(std::exception_ptr e, python_error_slot* slot) {
  nb::object exc = python_exception(e, slot);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

nb::object to_python(const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      return nb::none();
    case json::value_t::boolean:
      return nb::bool_(j.get<bool>());
    case json::value_t::number_integer:
      return nb::int_(j.get<std::int64_t>());
    case json::value_t::number_unsigned:
      return nb::steal(PyLong_FromUnsignedLongLong(j.get<std::uint64_t>()));
    case json::value_t::number_float:
      return nb::float_(j.get<double>());
    case json::value_t::string:
      return nb::str(j.get_ref<const std::string&>().c_str(), j.get_ref<const std::string&>().size());
    case json::value_t::array: {
      nb::list out;
      for (const auto& v : j) out.append(to_python(v));
      return out;
    }
    case json::value_t::object: {
      nb::dict out;
      for (const auto& [k, v] : j.items()) out[nb::str(k.c_str(), k.size())] = to_python(v);
      return out;
    }
    default:
      return nb::none();
  }
}

json to_json(nb::handle o) {
  if (o.is_none()) return nullptr;
  if (PyBool_Check(o.ptr())) return o.ptr() == Py_True;
  if (PyLong_Check(o.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
    if (overflow > 0) return json(nb::cast<std::uint64_t>(o));
    if (overflow < 0) throw_error(errc::invalid_argument, "an integer below -2^63 cannot be sent as JSON");
    return json(static_cast<std::int64_t>(v));
  }
  if (PyFloat_Check(o.ptr())) return PyFloat_AsDouble(o.ptr());
  if (PyUnicode_Check(o.ptr())) return nb::cast<std::string>(o);
  if (PyDict_Check(o.ptr())) {
    json out = json::object();
    for (auto [k, v] : nb::borrow<nb::dict>(o)) {
      if (!PyUnicode_Check(k.ptr()))
        throw_error(errc::invalid_argument,
                    "JSON objects need string keys, got " + nb::cast<std::string>(nb::str(nb::handle(k.type()))));
      out[nb::cast<std::string>(k)] = to_json(v);
    }
    return out;
  }
  if (PyList_Check(o.ptr()) || PyTuple_Check(o.ptr())) {
    json out = json::array();
    for (nb::handle v : o) out.push_back(to_json(v));
    return out;
  }
  // Dataclasses and other mappings: their dict form.
  if (nb::hasattr(o, "keys") && nb::hasattr(o, "__getitem__"))
    return to_json(nb::steal(PyDict_New()).attr("__class__")(nb::borrow(o)));
  throw_error(errc::invalid_argument,
              "cannot send a " + nb::cast<std::string>(nb::str(nb::handle(o.type()))) + " as JSON");
}

namespace detail {

void wait_released(std::future<void>& done, const std::shared_ptr<asio::cancellation_signal>& cancel) {
  bool interrupted = false;
  for (;;) {
    std::future_status status;
    {
      nb::gil_scoped_release release;
      status = done.wait_for(std::chrono::milliseconds(interrupted ? 1000 : 50));
    }
    if (status == std::future_status::ready) break;
    if (!interrupted && PyErr_CheckSignals() != 0) {
      // Ctrl-C: cancel, wait for the coroutine to end (it refers to this frame),
      // then raise the KeyboardInterrupt that is pending.
      interrupted = true;
      asio::post(runtime::get().executor(), [cancel] { cancel->emit(asio::cancellation_type::terminal); });
      nb::python_error pending;  // fetched: the indicator is clear while we wait
      {
        nb::gil_scoped_release release;
        done.wait();
      }
      pending.restore();
      throw nb::python_error();
    }
  }
}

}  // namespace detail

template <>
void block_on<void>(asio::awaitable<void> op, python_error_slot* slot) {
  auto& rt = runtime::get();
  if (rt.on_loop()) throw std::logic_error("refit: a blocking call from refit's own loop would deadlock");
  auto cancel = std::make_shared<asio::cancellation_signal>();
  std::promise<void> promise;
  auto done = promise.get_future();
  std::exception_ptr error;
  asio::co_spawn(rt.executor(), std::move(op), asio::bind_cancellation_slot(cancel->slot(), [&](std::exception_ptr e) {
                   error = e;
                   promise.set_value();
                 }));
  detail::wait_released(done, cancel);
  if (error) raise(error, slot);
}

void teardown(asio::awaitable<void> op) noexcept {
  auto& rt = runtime::get();
  if (rt.stopped()) return;
  try {
    if (rt.on_loop()) {
      asio::co_spawn(rt.executor(), std::move(op), [](std::exception_ptr) {});
      return;
    }
    block_on(std::move(op));
  } catch (nb::python_error& e) {
    e.discard_as_unraisable("refit: tearing down an object");  // a destructor raises nothing (Ctrl-C included)
  } catch (std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    PyErr_WriteUnraisable(nullptr);
  } catch (...) {
  }
}

void pending_call::cancel() {
  auto signal = signal_;
  asio::post(runtime::get().executor(), [signal] { signal->emit(asio::cancellation_type::terminal); });
}

void deliver(const shared_object& done, std::exception_ptr e, python_error_slot* slot,
             const std::function<nb::object()>& result) {
  nb::gil_scoped_acquire gil;
  try {
    nb::object value = nb::none(), exc = nb::none();
    if (e)
      exc = python_exception(e, slot);
    else
      value = result();
    nb::handle(done.get())(value, exc);
  } catch (nb::python_error& err) {
    err.discard_as_unraisable("refit: delivering a result to asyncio");
  } catch (std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    PyErr_WriteUnraisable(nullptr);
  }
}

pending_call start_void(asio::awaitable<void> op, nb::object done, std::shared_ptr<python_error_slot> slot) {
  auto cancel = std::make_shared<asio::cancellation_signal>();
  shared_object callback(std::move(done));
  asio::co_spawn(runtime::get().executor(), std::move(op),
                 asio::bind_cancellation_slot(cancel->slot(), [callback, slot, cancel](std::exception_ptr e) {
                   deliver(callback, e, slot.get(), [] { return nb::none(); });
                 }));
  return pending_call(std::move(cancel));
}

}  // namespace refit::py
