// refit._refit: the C++ engines for Python. refit/_engine.py, _host.py, _sender.py
// and _group.py wrap its classes (keyword arguments, the asyncio forms, errors by
// kind); engine.cc, host.cc, sender.cc and group.cc map them onto refit's C++ API
// (bindings.h), running every coroutine on refit's loop (bridge.h). This file holds
// the module itself: its errors, its functions, and NB_MODULE, which binds each part.
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include <refit/error.h>
#include <refit/factory.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>

#include "bindings.h"

namespace refit::py {
namespace {

// refit errors thrown anywhere (constructors, properties) become refit.Error's
// subclass for their kind.
void register_errors() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::system_error&) {  // refit's kinds, and CUDA's or the OS's errors
      nb::object exc = python_exception(p);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

// The module's functions: backends and plugins, describe and fingerprints.
void bind_functions(nb::module_& m) {
  m.def("_errc_names", [] {
    std::vector<std::string> out;
    for (int i = 1; i <= static_cast<int>(last_errc); ++i) out.emplace_back(errc_name(static_cast<errc>(i)));
    return out;
  });
  m.def("_shutdown", [] { runtime::get().stop(); });
  m.def(
      "backends", [] { return engine_factory::instance().available(); }, "Registered backend names, sorted.");
  m.def(
      "register_plugin",
      [](const std::string& name, const std::string& library, const std::string& symbol) {
        engine_factory::instance().register_lazy(name, library, symbol);
      },
      nb::arg("name"), nb::arg("library"), nb::arg("symbol"),
      "Registers a backend in a shared library, loaded (dlopen) on first use.");
  m.def(
      "describe",
      [](nb::handle tensors) {
        auto held = held_tensors::from_python(tensors, "describe");
        json out;
        write_update_metadata(held.metadata(), out);
        return nb::cast<nb::dict>(to_python(out));
      },
      nb::arg("tensors"), "vLLM's update info of `tensors`: {\"names\", \"dtype_names\", \"shapes\"}.");
  m.def(
      "fingerprints",
      [](nb::handle tensors, std::optional<std::vector<std::string>> names) {
        auto held = held_tensors::from_python(tensors, "fingerprints");
        for (const auto& v : held.views())
          if (!v.device.is_cpu())
            throw_error(errc::unsupported, "fingerprints: tensor '" + std::string(v.name) + "' is on " +
                                               to_string(v.device) + "; fingerprint a host copy");
        fingerprint_list list;
        {
          nb::gil_scoped_release release;
          list = fingerprint_all(held.views(), names.value_or(std::vector<std::string>{}));
        }
        return fingerprints_to_python(list);
      },
      nb::arg("tensors"), nb::arg("names") = nb::none());
}

}  // namespace
}  // namespace refit::py

NB_MODULE(_refit, m) {
  using namespace refit::py;
  m.doc() = "refit's C++ engines (see the refit package for the documented API)";
  register_errors();
  // Async forms: `_start_<name>(..., done)` returns a pending_call; refit/_loop.py
  // turns it into an awaitable.
  nb::class_<pending_call>(m, "_PendingCall").def("cancel", &pending_call::cancel);
  bind_functions(m);
  bind_engine(m);
  bind_sender(m);
  bind_worker_group(m);
  bind_fleet(m);
  bind_worker_host(m);
}
