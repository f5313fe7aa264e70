// The arguments every class of the module takes, Python callables as load_weights and
// the tensors an Engine or WorkerHost receives into (bindings.h).
#include "bindings.h"

#include <refit/error.h>
#include <refit/integrity/auth.h>
#include <refit/json_reader.h>

#ifdef REFIT_PY_CUDA
#include <refit/cuda/tensor_memory.h>
#endif

namespace refit::py {

weight_transfer_config make_config(const std::string& backend, std::int64_t timeout_ms, const std::string& commit,
                                   const std::optional<std::string>& secret_file, std::size_t processing_threads,
                                   std::size_t socket_buffer_bytes, std::uint64_t max_stage_bytes) {
  weight_transfer_config config;
  config.backend = backend;
  if (timeout_ms <= 0)
    throw_error(errc::invalid_argument,
                "timeout_ms: expected a positive number of milliseconds, got " + std::to_string(timeout_ms));
  config.timeout = std::chrono::milliseconds(timeout_ms);
  if (commit == "in_place")
    config.commit = commit_mode::in_place;
  else if (commit == "staged")
    config.commit = commit_mode::staged;
  else
    throw_error(errc::invalid_argument, "commit: expected 'in_place' or 'staged', got '" + commit + "'");
  if (secret_file && !secret_file->empty()) config.auth_secret = auth::read_secret_file(*secret_file);
  if (processing_threads == 0) throw_error(errc::invalid_argument, "processing_threads: expected at least 1");
  config.processing_threads = processing_threads;
  config.socket_buffer_bytes = socket_buffer_bytes;
  config.max_stage_bytes = max_stage_bytes;
  return config;
}

update_metadata read_metadata(nb::handle meta, const std::string& what) {
  json j = to_json(meta);
  json_reader r(j, what);
  auto out = read_update_metadata(r);
  r.finish();
  return out;
}

nb::dict fingerprints_to_python(const fingerprint_list& list) {
  nb::dict out;
  for (const auto& [name, value] : list)
    out[nb::str(name.c_str(), name.size())] = nb::steal(PyLong_FromUnsignedLongLong(value));
  return out;
}

fingerprint_list fingerprints_from_python(nb::handle d) {
  fingerprint_list out;
  for (auto [k, v] : nb::borrow<nb::dict>(d)) out.emplace_back(nb::cast<std::string>(k), nb::cast<std::uint64_t>(v));
  return out;
}

std::string python_error_text(const nb::python_error& e) {
  nb::handle value = e.value();
  std::string type = nb::cast<std::string>(nb::str(nb::handle(value.type()).attr("__name__")));
  std::string text = nb::cast<std::string>(nb::str(value));
  return text.empty() ? type : type + ": " + text;
}

load_weights_fn python_loader(nb::object fn, framework fw, std::shared_ptr<python_error_slot> slot) {
  if (!PyCallable_Check(fn.ptr()))
    throw_error(errc::invalid_argument, "load_weights: expected a callable, got a " +
                                            nb::cast<std::string>(nb::str(nb::handle(fn.type()).attr("__name__"))));
  shared_object callable(std::move(fn));
  return [callable, fw, slot](std::span<const tensor_view> views) {
    nb::gil_scoped_acquire gil;
    try {
      nb::handle(callable.get())(python_batch(views, fw));
    } catch (nb::python_error& e) {
      std::string text = python_error_text(e);
      if (slot) slot->keep(e);
      throw_error(errc::processing_failed, "load_weights raised " + text);
    }
  };
}

std::unique_ptr<held_target> held_target::make(nb::handle tensors, const std::string& what,
                                               refit::device engine_device) {
  auto out = std::make_unique<held_target>();
  out->held = held_tensors::from_python(tensors, what);
  tensor_map_target_options options;
  options.direct_receive = true;
  std::optional<refit::device> where;
  for (const auto& v : out->held.views()) {
    if (where && *where != v.device)
      throw_error(errc::invalid_argument, what + ": tensor '" + std::string(v.name) + "' is on " + to_string(v.device) +
                                              " and an earlier one on " + to_string(*where) +
                                              "; give one engine's tensors on one device");
    where = v.device;
  }
  if (where && where->is_cuda()) {
#ifdef REFIT_PY_CUDA
    options.memory = std::make_shared<cuda::device_tensor_memory>(where->index);
    options.direct_receive_on_device = engine_device == *where;
#else
    (void)engine_device;
    throw_error(errc::unsupported, what + ": the tensors are on " + to_string(*where) +
                                       "; this build of refit's Python module has no CUDA (./refit wheel --cuda "
                                       "builds one), so it receives into host tensors only (or give a load_weights "
                                       "that copies to the device)");
#endif
  }
  out->target = std::make_unique<tensor_map_target>(options);
  for (const auto& v : out->held.views()) out->target->add(v);
  return out;
}

}  // namespace refit::py
