// _Sender (sender.h): the trainer's engine, sending Python tensors.
#include "sender.h"

namespace refit::py {

std::pair<std::shared_ptr<held_tensors>, std::shared_ptr<const update_metadata>> hold_for_send(nb::handle tensors,
                                                                                               nb::handle metadata,
                                                                                               const std::string& what,
                                                                                               tensor_cache* cache) {
  auto held = std::make_shared<held_tensors>(held_tensors::from_python(tensors, what, cache));
  auto declared = metadata.is_none()
                      ? held->shared_metadata()
                      : std::make_shared<const update_metadata>(read_metadata(metadata, what + " metadata"));
  return {std::move(held), std::move(declared)};
}

std::optional<const void*> producer_stream(std::optional<std::uintptr_t> handle) {
  if (!handle) return std::nullopt;
  return reinterpret_cast<const void*>(*handle);
}

void bind_sender(nb::module_& m) {
  nb::class_<py_sender>(m, "_Sender")
      .def(nb::init<const std::string&, const std::string&, std::int64_t, const std::optional<std::string>&,
                    std::size_t>(),
           nb::arg("backend"), nb::arg("device"), nb::arg("timeout_ms"), nb::arg("auth_secret_file").none(),
           nb::arg("socket_buffer_bytes"))
      .def_prop_ro("backend", &py_sender::backend)
      .def("prepare", &py_sender::prepare, nb::arg("trainer_args").none())
      .def("connect_workers", [](py_sender& s) { block_on(s.connect_workers()); })
      .def(
          "_start_connect_workers",
          [](py_sender& s, nb::object done) { return start_void(s.connect_workers(), std::move(done)); },
          nb::arg("done"))
      .def(
          "send_weights",
          [](py_sender& s, nb::handle tensors, nb::handle metadata, std::optional<bool> delta,
             std::optional<std::uintptr_t> stream) {
            auto [held, declared] = hold_for_send(tensors, metadata, "send_weights", &s.cache());
            if (delta || stream) s.sender().set_next_send({.delta = delta, .producer_stream = producer_stream(stream)});
            block_on(py_sender::send(&s.sender(), std::move(held), std::move(declared)));
          },
          nb::arg("tensors"), nb::arg("metadata").none(), nb::arg("delta").none() = nb::none(),
          nb::arg("stream").none() = nb::none())
      .def(
          "_start_send_weights",
          [](py_sender& s, nb::handle tensors, nb::handle metadata, std::optional<bool> delta,
             std::optional<std::uintptr_t> stream, nb::object done) {
            auto [held, declared] = hold_for_send(tensors, metadata, "send_weights", &s.cache());
            if (delta || stream) s.sender().set_next_send({.delta = delta, .producer_stream = producer_stream(stream)});
            return start_void(py_sender::send(&s.sender(), std::move(held), std::move(declared)), std::move(done));
          },
          nb::arg("tensors"), nb::arg("metadata").none(), nb::arg("delta").none(), nb::arg("stream").none(),
          nb::arg("done"))
      .def("last_send_stats", &py_sender::last_send_stats)
      .def("last_send_info", &py_sender::last_send_info)
      .def("shutdown", &py_sender::shutdown);
}

}  // namespace refit::py
