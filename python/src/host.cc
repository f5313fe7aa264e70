// _WorkerHost, which refit/_host.py wraps: a worker process's control server,
// receiving into its tensors or through a Python load_weights, with Python hooks
// and methods.
#include <asio/co_spawn.hpp>
#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/control/worker_host.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/model/host_copy_target.h>

#include "bindings.h"

namespace refit::py {
namespace {

using control::worker_host;

// Calls a Python hook (GIL held); what it raises becomes a refit error here, under
// the GIL, so no Python object crosses into the host.
template <class F>
void call_hook(const char* name, F fn) {
  try {
    fn();
  } catch (nb::python_error& e) {
    throw_error(errc::processing_failed, std::string(name) + " raised " + python_error_text(e));
  }
}

// refit.UpdateFailure(reason, kind): the reason's text with its kind as a field
// (GIL held). The class is found on first use and never destroyed (a static
// nb::object would be released after the interpreter is gone).
nb::object update_failure(const std::string& reason, errc kind) {
  static nb::object* cls = nullptr;
  if (!cls) cls = new nb::object(nb::module_::import_("refit._errors").attr("UpdateFailure"));
  return (*cls)(nb::str(reason.c_str(), reason.size()), nb::str(std::string(errc_name(kind)).c_str()));
}

class py_worker_host {
 public:
  py_worker_host(const std::string& backend, const std::string& host, int port, nb::handle tensors,
                 nb::object load_weights, std::int64_t timeout_ms, const std::string& commit,
                 const std::optional<std::string>& secret_file, std::size_t processing_threads, const std::string& fw,
                 nb::object on_started, nb::object on_finished, nb::object on_failed,
                 std::optional<std::int64_t> session_timeout_ms, std::uint64_t max_stage_bytes, bool keep_base,
                 const std::string& device, py_host_copy* base) {
    if (port < 0 || port > 65535) throw_error(errc::invalid_argument, "port: expected 0..65535");
    auto config = make_config(backend, timeout_ms, commit, secret_file, processing_threads, 0, max_stage_bytes);
    control::host_limits limits;
    if (session_timeout_ms) {
      if (*session_timeout_ms <= 0)
        throw_error(errc::invalid_argument, "session_timeout_ms: expected a positive number of milliseconds, got " +
                                                std::to_string(*session_timeout_ms));
      limits.session_timeout = std::chrono::milliseconds(*session_timeout_ms);
    }
    engine_context ctx;
    ctx.executor = runtime::get().executor();
    ctx.device = parse_device(device);
    load_weights_fn fn;
    if (base) keep_base = true;
    if (!tensors.is_none() && keep_base)
      throw_error(errc::invalid_argument,
                  "WorkerHost: keep_base= with tensors=: the tensors already hold the bytes deltas decode against");
    if (!tensors.is_none()) {
      held_ = held_target::make(tensors, "WorkerHost(tensors=...)", ctx.device);
      ctx.model = held_->target.get();
      fn = held_->target->as_load_weights();
      if (!load_weights.is_none())
        throw_error(errc::invalid_argument, "WorkerHost: give tensors= or load_weights=, not both");
    } else if (!load_weights.is_none()) {
      fn = python_loader(std::move(load_weights), parse_framework(fw), nullptr);
      if (keep_base) {
        // Received into a host copy load_weights gets views of: deltas decode
        // against it, and a fleet-atomic commit's undo reads it back.
        copy_ = base ? base->copy : std::make_shared<host_copy_target>();
        ctx.model = copy_.get();
        fn = copy_->loading_through(std::move(fn));
      }
    } else {
      throw_error(errc::invalid_argument, "WorkerHost: give tensors= (received into) or load_weights=");
    }
    control::update_hooks hooks;
    shared_object started(std::move(on_started)), finished(std::move(on_finished)), failed(std::move(on_failed));
    tensor_map_target* target = held_ ? held_->target.get() : nullptr;
    hooks.on_update_started = [started](const std::string& owner) {
      if (!started || started.get().is_none()) return;
      nb::gil_scoped_acquire gil;
      call_hook("on_update_started", [&] { nb::handle(started.get())(owner); });
    };
    hooks.on_update_finished = [finished](std::int64_t version, const json& stats) {
      if (!finished || finished.get().is_none()) return;
      nb::gil_scoped_acquire gil;
      call_hook("on_update_finished", [&] { nb::handle(finished.get())(version, to_python(stats)); });
    };
    hooks.on_update_failed = [failed](const std::string& reason, errc kind) {
      if (!failed || failed.get().is_none()) return;
      nb::gil_scoped_acquire gil;
      call_hook("on_update_failed", [&] { nb::handle(failed.get())(update_failure(reason, kind)); });
    };
    host_ = std::make_unique<worker_host>(config, ctx, std::move(fn), engine_factory::instance(), limits);
    // Received into tensors: they serve what the host holds, then the Python hooks run.
    host_->set_hooks(target ? control::tensor_map_hooks(*host_, *target, std::move(hooks)) : std::move(hooks));
    port_ = on_loop([&] { return host_->listen(host, static_cast<std::uint16_t>(port)); });
    asio::co_spawn(runtime::get().executor(), host_->serve(), [](std::exception_ptr) {});
  }
  ~py_worker_host() { teardown(destroy(std::move(host_), std::move(held_), std::move(copy_), stopped_)); }
  static asio::awaitable<void> destroy(std::unique_ptr<worker_host> host, std::unique_ptr<held_target> held,
                                       std::shared_ptr<host_copy_target> copy, bool stopped) {
    if (host && !stopped) host->stop();
    // Let the connections' coroutines see the stop before the host goes.
    asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(1));
    co_await t.async_wait(asio::use_awaitable);
    if (host && host->engine().processing_pending() > 0) {
      try {
        co_await host->drain_pending();
      } catch (...) {
      }
    }
    host.reset();
    held.reset();  // after the host: its hooks and engine write into it
    copy.reset();
  }

  int port() const { return port_; }
  void stop() {
    on_loop([this] {
      if (!stopped_) {
        stopped_ = true;
        host_->stop();
      }
      return 0;
    });
  }
  nb::dict weight_info() {
    json j = on_loop([this] { return host_->weight_info(); });
    return nb::cast<nb::dict>(to_python(j));
  }
  nb::dict fingerprint(const std::vector<std::string>& names) {
    if (!held_) throw_error(errc::unsupported, "fingerprint: this WorkerHost has no tensors of its own");
    return fingerprints_to_python(on_loop([&] { return held_->target->fingerprint(names); }));
  }
  void add_method(const std::string& name, nb::object fn) {
    shared_object callable(std::move(fn));
    on_loop([&] {
      host_->add_method(name, [callable](const json& params) -> asio::awaitable<json> {
        json out;
        {
          nb::gil_scoped_acquire gil;
          try {
            out = to_json(nb::handle(callable.get())(to_python(params)));
          } catch (nb::python_error& e) {
            throw_error(errc::processing_failed, python_error_text(e));
          }
        }
        co_return out;
      });
      return 0;
    });
  }

 private:
  std::unique_ptr<held_target> held_;
  std::shared_ptr<host_copy_target> copy_;  // keep_base=: what deltas decode against
  std::unique_ptr<worker_host> host_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace

void bind_worker_host(nb::module_& m) {
  nb::class_<py_worker_host>(m, "_WorkerHost")
      .def(nb::init<const std::string&, const std::string&, int, nb::handle, nb::object, std::int64_t,
                    const std::string&, const std::optional<std::string>&, std::size_t, const std::string&, nb::object,
                    nb::object, nb::object, std::optional<std::int64_t>, std::uint64_t, bool, const std::string&,
                    py_host_copy*>(),
           nb::arg("backend"), nb::arg("host"), nb::arg("port"), nb::arg("tensors").none(),
           nb::arg("load_weights").none(), nb::arg("timeout_ms"), nb::arg("commit"), nb::arg("auth_secret_file").none(),
           nb::arg("processing_threads"), nb::arg("framework"), nb::arg("on_update_started").none(),
           nb::arg("on_update_finished").none(), nb::arg("on_update_failed").none(),
           nb::arg("session_timeout_ms").none(), nb::arg("max_stage_bytes"), nb::arg("keep_base") = false,
           nb::arg("device") = "cpu", nb::arg("base").none() = nb::none())
      .def_prop_ro("port", &py_worker_host::port)
      .def("stop", &py_worker_host::stop)
      .def("weight_info", &py_worker_host::weight_info)
      .def("fingerprint", &py_worker_host::fingerprint, nb::arg("names"))
      .def("add_method", &py_worker_host::add_method, nb::arg("name"), nb::arg("fn"));
}

}  // namespace refit::py
