// _Engine, which refit/_engine.py wraps: a worker's engine and its session, over
// tensors it receives into (tensors=) or a Python load_weights, optionally behind a
// Python check of every update (check_update=).
#include <asio/awaitable.hpp>

#include <refit/engine.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/model/host_copy_target.h>
#include <refit/session.h>

#include "bindings.h"

namespace refit::py {
namespace {

/// The model_target of an Engine given check_update=: its begin_update calls the
/// Python check with the update's {"names", "dtype_names", "shapes"} before any
/// byte of it moves, so a refusal reaches the trainer at once (the engine base
/// refuses the update on the data path) and the model is never touched. Everything
/// else goes to the Engine's own tensors (tensors=) when it has some.
class checked_target final : public model_target {
 public:
  checked_target(nb::object check, model_target* inner) : check_(std::move(check)), inner_(inner) {
    if (!PyCallable_Check(check_.get().ptr()))
      throw_error(errc::invalid_argument,
                  "check_update: expected a callable, got a " +
                      nb::cast<std::string>(nb::str(nb::handle(check_.get().type()).attr("__name__"))));
  }

  void begin_update(const update_metadata& meta) override {
    json j;
    write_update_metadata(meta, j);
    {
      nb::gil_scoped_acquire gil;
      try {
        nb::handle(check_.get())(to_python(j));
      } catch (nb::python_error& e) {
        throw_error(errc::invalid_argument, "check_update refused the update: " + python_error_text(e));
      }
    }
    if (inner_) inner_->begin_update(meta);
  }
  void load_weights(std::span<const tensor_view> weights) override {
    if (!inner_) throw_error(errc::invalid_state, "check_update: this Engine holds no tensors to load into");
    inner_->load_weights(weights);
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    return inner_ ? inner_->destination(spec) : std::nullopt;
  }
  void direct_write_begins() override {
    if (inner_) inner_->direct_write_begins();
  }
  fingerprint_list fingerprint(const std::vector<std::string>& names) override {
    if (!inner_) return model_target::fingerprint(names);
    return inner_->fingerprint(names);
  }
  bool can_read_back(const tensor_spec& spec) override { return inner_ && inner_->can_read_back(spec); }
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override {
    if (!inner_) return model_target::read_back(spec, out);
    inner_->read_back(spec, out);
  }

 private:
  shared_object check_;
  model_target* inner_;
};

class py_engine {
 public:
  py_engine(const std::string& backend, const std::string& device, std::int64_t timeout_ms, const std::string& commit,
            const std::optional<std::string>& secret_file, std::size_t processing_threads,
            std::size_t socket_buffer_bytes, int tp_rank, int tp_size, int dp_rank, int dp_size, nb::handle tensors,
            const std::string& fw, std::uint64_t max_stage_bytes, nb::handle check_update, bool keep_base,
            std::shared_ptr<host_copy_target> base)
      : fw_(parse_framework(fw)) {
    auto config =
        make_config(backend, timeout_ms, commit, secret_file, processing_threads, socket_buffer_bytes, max_stage_bytes);
    engine_context ctx;
    ctx.executor = runtime::get().executor();
    ctx.device = parse_device(device);
    ctx.ranks.tp_rank = tp_rank;
    ctx.ranks.tp_size = tp_size;
    ctx.ranks.dp_rank = dp_rank;
    ctx.ranks.dp_size = dp_size;
    if (!tensors.is_none()) {
      held_ = held_target::make(tensors, "Engine(tensors=...)", ctx.device);
      ctx.model = held_->target.get();
    }
    if (base) keep_base = true;
    if (!tensors.is_none() && keep_base)
      throw_error(errc::invalid_argument,
                  "Engine: keep_base= with tensors=: the tensors already hold the bytes deltas decode against");
    if (keep_base) {
      copy_ = base ? std::move(base) : std::make_shared<host_copy_target>();
      ctx.model = copy_.get();
    }
    if (!check_update.is_none()) {
      checked_ = std::make_unique<checked_target>(nb::borrow(check_update), ctx.model);
      ctx.model = checked_.get();
    }
    engine_ = engine_factory::instance().create_engine(config, ctx);
    session_ = std::make_unique<weight_update_session>(*engine_);
  }

  ~py_engine() {
    teardown(destroy(std::move(engine_), std::move(session_), std::move(checked_), std::move(copy_), std::move(held_)));
  }

  // On refit's loop: ends the engine's deferred processing (anything still pending
  // ends with the process), then the engine, then the targets it wrote to.
  static asio::awaitable<void> destroy(std::unique_ptr<weight_transfer_engine> engine,
                                       std::unique_ptr<weight_update_session> session,
                                       std::unique_ptr<checked_target> checked, std::shared_ptr<host_copy_target> copy,
                                       std::unique_ptr<held_target> held) {
    if (engine) {
      if (engine->processing_pending() > 0) {
        try {
          co_await engine->drain_pending();
        } catch (...) {
        }
      }
      engine->shutdown();
    }
    session.reset();
    engine.reset();
    checked.reset();
    copy.reset();
    held.reset();
  }

  std::string backend() const { return std::string(engine_->backend()); }
  bool defers_processing() const { return engine_->defers_processing(); }

  asio::awaitable<void> init(json info) {
    auto parsed = engine_->parse_init_info(info);
    co_await engine_->init_transfer_engine(*parsed);
  }

  /// The load_weights of one receive. What a Python load_weights raises is kept in
  /// the engine's slot: the call that reports the failure (receive, drain or
  /// finish, for deferred processing) raises it as itself.
  load_weights_fn loader(nb::object load_weights) {
    slot_->take();  // a new update: an exception kept from an older one is stale
    if (!load_weights.is_none()) {
      auto fn = python_loader(std::move(load_weights), fw_, slot_);
      return copy_ ? copy_->loading_through(std::move(fn)) : fn;
    }
    if (!held_)
      throw_error(errc::invalid_argument,
                  "receive: give load_weights, or create the Engine with tensors= to "
                  "receive into");
    return held_->target->as_load_weights();
  }

  // A receive outside a session: into the engine's tensors it also ends their
  // update (processing drained), so readers see it whole.
  asio::awaitable<void> receive(json info, load_weights_fn fn, bool into_tensors) {
    auto parsed = co_await engine_->read_update_info(info);
    co_await engine_->receive_weights(*parsed, std::move(fn));
    if (into_tensors) {
      try {
        co_await engine_->drain_pending();
      } catch (...) {
        held_->target->abort("receive failed");
        throw;
      }
      held_->target->finish(std::nullopt);
      engine_->mark_weights_clean();
    }
  }

  asio::awaitable<void> drain() { co_await engine_->drain_pending(); }

  asio::awaitable<void> update_weights(json info, load_weights_fn fn) {
    co_await session_->update_weights(info, std::move(fn));
  }

  asio::awaitable<void> finish(std::optional<std::int64_t> version) {
    try {
      co_await session_->finish_weight_update(version);
    } catch (...) {
      if (held_) held_->target->abort("finish_weight_update failed");
      throw;
    }
    end_held_update();
  }

  // The engine's own tensors (tensors=) end their update as the engine left them:
  // dirty, or whole at the session's version.
  void end_held_update() {
    if (!held_) return;
    if (engine_->weights_dirty())
      held_->target->abort(engine_->dirty_reason());
    else
      held_->target->finish(session_->weight_version());
  }

  asio::awaitable<void> abort(std::string why) {
    co_await session_->abort_weight_update(why);
    if (held_ && held_->target->updating()) held_->target->abort(why);
  }

  void start(bool fleet_atomic) {
    session_->start_weight_update();
    if (fleet_atomic) session_->require_undo();
  }

  asio::awaitable<void> prepare() { co_await session_->prepare_weight_update(); }

  // Back to the version before the last fleet-atomic commit.
  asio::awaitable<void> rollback() {
    std::exception_ptr failure;
    try {
      co_await session_->rollback_weight_update();
    } catch (...) {
      failure = std::current_exception();
    }
    if (held_ && held_->target->updating()) end_held_update();
    if (failure) std::rethrow_exception(failure);
  }

  void release_undo() { session_->release_undo(); }

  nb::dict fingerprint(const std::vector<std::string>& names) {
    if (!held_)
      throw_error(errc::unsupported, "fingerprint: this Engine has no tensors of its own (create it with tensors=)");
    fingerprint_list list = on_loop([&] { return held_->target->fingerprint(names); });
    return fingerprints_to_python(list);
  }

  nb::dict state() {
    json j = on_loop([this] {
      json s;
      s["backend"] = std::string(engine_->backend());
      s["initialized"] = engine_->initialized();
      s["receiving"] = engine_->receiving();
      s["processing_pending"] = engine_->processing_pending();
      s["weights_dirty"] = engine_->weights_dirty();
      s["dirty_reason"] = engine_->dirty_reason();
      s["session_active"] = session_->active();
      s["weight_version"] = session_->weight_version() ? json(*session_->weight_version()) : json(nullptr);
      s["prepared"] = session_->prepared();
      s["holds_undo"] = session_->holds_undo();
      s["undo_version"] = session_->undo_version() ? json(*session_->undo_version()) : json(nullptr);
      s["last_update"] = engine_->last_update_stats().to_json();
      s["transport"] = engine_->transport_info();  // null unless the engine reports one (ucx)
      return s;
    });
    return nb::cast<nb::dict>(to_python(j));
  }

  void shutdown() {
    on_loop([this] {
      engine_->shutdown();
      return 0;
    });
  }

  weight_transfer_engine& engine() { return *engine_; }
  weight_update_session& session() { return *session_; }
  const std::shared_ptr<python_error_slot>& slot() const { return slot_; }

 private:
  framework fw_;
  std::shared_ptr<python_error_slot> slot_ = std::make_shared<python_error_slot>();
  std::unique_ptr<held_target> held_;
  std::unique_ptr<checked_target> checked_;  // check_update=, in front of held_'s target (or copy_)
  std::shared_ptr<host_copy_target> copy_;   // keep_base=: what deltas decode against and undo reloads
  std::unique_ptr<weight_transfer_engine> engine_;
  std::unique_ptr<weight_update_session> session_;
};

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<py_host_copy>(m, "_HostCopy")
      .def(nb::init<>())
      .def(
          "seed",
          [](py_host_copy& h, nb::handle tensors) {
            held_tensors held = held_tensors::from_python(tensors, "HostCopy.seed");
            nb::gil_scoped_release release;
            for (const auto& v : held.views()) h.copy->seed(v);
          },
          nb::arg("tensors"))
      .def_prop_ro("bytes", [](const py_host_copy& h) { return h.copy->bytes(); });

  nb::class_<py_engine>(m, "_Engine")
      .def(
          "__init__",
          [](py_engine* self, const std::string& backend, const std::string& device, std::int64_t timeout_ms,
             const std::string& commit, const std::optional<std::string>& secret_file, std::size_t processing_threads,
             std::size_t socket_buffer_bytes, int tp_rank, int tp_size, int dp_rank, int dp_size, nb::handle tensors,
             const std::string& fw, std::uint64_t max_stage_bytes, nb::handle check_update, bool keep_base,
             py_host_copy* base) {
            new (self) py_engine(backend, device, timeout_ms, commit, secret_file, processing_threads,
                                 socket_buffer_bytes, tp_rank, tp_size, dp_rank, dp_size, tensors, fw, max_stage_bytes,
                                 check_update, keep_base, base ? base->copy : nullptr);
          },
          nb::arg("backend"), nb::arg("device"), nb::arg("timeout_ms"), nb::arg("commit"),
          nb::arg("auth_secret_file").none(), nb::arg("processing_threads"), nb::arg("socket_buffer_bytes"),
          nb::arg("tp_rank"), nb::arg("tp_size"), nb::arg("dp_rank"), nb::arg("dp_size"), nb::arg("tensors").none(),
          nb::arg("framework"), nb::arg("max_stage_bytes"), nb::arg("check_update").none(),
          nb::arg("keep_base") = false, nb::arg("base").none() = nb::none())
      .def_prop_ro("backend", &py_engine::backend)
      .def_prop_ro("defers_processing", &py_engine::defers_processing)
      .def("state", &py_engine::state)
      .def("fingerprint", &py_engine::fingerprint, nb::arg("names"))
      .def("shutdown", &py_engine::shutdown)
      .def(
          "start_weight_update",
          [](py_engine& e, bool fleet_atomic) {
            on_loop([&] {
              e.start(fleet_atomic);
              return 0;
            });
          },
          nb::arg("fleet_atomic") = false)
      .def("prepare_weight_update", [](py_engine& e) { block_on(e.prepare()); })
      .def(
          "_start_prepare_weight_update",
          [](py_engine& e, nb::object done) { return start_void(e.prepare(), std::move(done)); }, nb::arg("done"))
      .def("rollback_weight_update", [](py_engine& e) { block_on(e.rollback(), e.slot().get()); })
      .def(
          "_start_rollback_weight_update",
          [](py_engine& e, nb::object done) { return start_void(e.rollback(), std::move(done), e.slot()); },
          nb::arg("done"))
      .def("release_undo",
           [](py_engine& e) {
             on_loop([&] {
               e.release_undo();
               return 0;
             });
           })
      .def(
          "init", [](py_engine& e, nb::handle info) { block_on(e.init(to_json(info))); }, nb::arg("init_info"))
      .def(
          "_start_init",
          [](py_engine& e, nb::handle info, nb::object done) {
            return start_void(e.init(to_json(info)), std::move(done));
          },
          nb::arg("init_info"), nb::arg("done"))
      .def(
          "receive",
          [](py_engine& e, nb::handle info, nb::object load_weights) {
            bool into = load_weights.is_none();
            auto fn = e.loader(std::move(load_weights));
            block_on(e.receive(to_json(info), std::move(fn), into), e.slot().get());
          },
          nb::arg("update_info"), nb::arg("load_weights").none())
      .def(
          "_start_receive",
          [](py_engine& e, nb::handle info, nb::object load_weights, nb::object done) {
            bool into = load_weights.is_none();
            auto fn = e.loader(std::move(load_weights));
            return start_void(e.receive(to_json(info), std::move(fn), into), std::move(done), e.slot());
          },
          nb::arg("update_info"), nb::arg("load_weights").none(), nb::arg("done"))
      .def("drain", [](py_engine& e) { block_on(e.drain(), e.slot().get()); })
      .def(
          "_start_drain",
          [](py_engine& e, nb::object done) { return start_void(e.drain(), std::move(done), e.slot()); },
          nb::arg("done"))
      .def(
          "update_weights",
          [](py_engine& e, nb::handle info, nb::object load_weights) {
            auto fn = e.loader(std::move(load_weights));
            block_on(e.update_weights(to_json(info), std::move(fn)), e.slot().get());
          },
          nb::arg("update_info"), nb::arg("load_weights").none())
      .def(
          "_start_update_weights",
          [](py_engine& e, nb::handle info, nb::object load_weights, nb::object done) {
            auto fn = e.loader(std::move(load_weights));
            return start_void(e.update_weights(to_json(info), std::move(fn)), std::move(done), e.slot());
          },
          nb::arg("update_info"), nb::arg("load_weights").none(), nb::arg("done"))
      .def(
          "finish_weight_update",
          [](py_engine& e, std::optional<std::int64_t> v) { block_on(e.finish(v), e.slot().get()); },
          nb::arg("version").none())
      .def(
          "_start_finish_weight_update",
          [](py_engine& e, std::optional<std::int64_t> v, nb::object done) {
            return start_void(e.finish(v), std::move(done), e.slot());
          },
          nb::arg("version").none(), nb::arg("done"))
      .def(
          "abort_weight_update", [](py_engine& e, const std::string& why) { block_on(e.abort(why)); }, nb::arg("why"))
      .def(
          "_start_abort_weight_update",
          [](py_engine& e, const std::string& why, nb::object done) {
            return start_void(e.abort(why), std::move(done));
          },
          nb::arg("why"), nb::arg("done"));
}

}  // namespace refit::py
