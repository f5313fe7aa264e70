// What the module's parts share (internal to refit._refit): the arguments every
// class takes (config, metadata, fingerprints), Python callables as load_weights,
// the tensors an Engine or WorkerHost receives into, and one bind_ function per
// class, which module.cc's NB_MODULE calls. engine.cc, sender.cc, group.cc and
// host.cc hold the classes refit/_engine.py, _sender.py, _group.py and _host.py wrap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <refit/engine.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>
#include <refit/model/host_copy_target.h>
#include <refit/model/tensor_map_target.h>

#include "bridge.h"
#include "tensors.h"

namespace refit::py {

// ------------------------------------------------------------------ arguments

weight_transfer_config make_config(const std::string& backend, std::int64_t timeout_ms, const std::string& commit,
                                   const std::optional<std::string>& secret_file, std::size_t processing_threads,
                                   std::size_t socket_buffer_bytes, std::uint64_t max_stage_bytes = 0);

update_metadata read_metadata(nb::handle meta, const std::string& what);

nb::dict fingerprints_to_python(const fingerprint_list& list);
fingerprint_list fingerprints_from_python(nb::handle d);

std::string python_error_text(const nb::python_error& e);

/// load_weights that calls a Python function with a (name, tensor) list. What it
/// raises is kept in `slot` (when given), so the call that received raises it.
load_weights_fn python_loader(nb::object fn, framework fw, std::shared_ptr<python_error_slot> slot);

/// Tensors a worker receives into directly: a tensor_map_target over the Python
/// tensors' own memory (validated updates, direct receive, fingerprints). Host
/// tensors, or (CUDA builds) tensors on one GPU, received into directly when the
/// engine receives on that GPU (nccl) and staged then copied in otherwise (tcp).
struct held_target {
  held_tensors held;
  std::unique_ptr<tensor_map_target> target;

  static std::unique_ptr<held_target> make(nb::handle tensors, const std::string& what, refit::device engine_device);
};

/// _HostCopy: a host_copy_target an Engine's or a WorkerHost's keep_base can be
/// given, so that what it holds outlives one engine (a vLLM worker builds a new
/// engine per trainer) and can be seeded with what the model holds before refit's
/// first update (so that update can be undone too).
struct py_host_copy {
  std::shared_ptr<host_copy_target> copy = std::make_shared<host_copy_target>();
};

// ------------------------------------------------------------------ bindings

void bind_engine(nb::module_& m);        // _Engine (engine.cc)
void bind_sender(nb::module_& m);        // _Sender (sender.cc)
void bind_worker_group(nb::module_& m);  // _WorkerGroup (group.cc)
void bind_fleet(nb::module_& m);         // the fleet protocol's rules (group.cc)
void bind_worker_host(nb::module_& m);   // _WorkerHost (host.cc)

}  // namespace refit::py
