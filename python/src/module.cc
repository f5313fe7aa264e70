// refit._refit: the C++ engines for Python. refit/_engine.py, _host.py, _sender.py
// and _group.py wrap these classes (keyword arguments, the asyncio forms, errors by
// kind); this file maps them onto
// refit's C++ API, running every coroutine on refit's loop (bridge.h).
#include <atomic>
#include <optional>

#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <refit/control/worker_group.h>
#include <refit/control/worker_host.h>
#include <refit/engine.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/integrity/auth.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>
#include <refit/model/host_copy_target.h>
#include <refit/model/tensor_map_target.h>
#include <refit/session.h>
#include <refit/trainer.h>

#ifdef REFIT_PY_CUDA
#include <refit/cuda/tensor_memory.h>
#endif

#include "bridge.h"
#include "tensors.h"

namespace refit::py {
namespace {

using control::worker_group;
using control::worker_host;

// ------------------------------------------------------------------ arguments

weight_transfer_config make_config(const std::string& backend, std::int64_t timeout_ms, const std::string& commit,
                                   const std::optional<std::string>& secret_file, std::size_t processing_threads,
                                   std::size_t socket_buffer_bytes, std::uint64_t max_stage_bytes = 0) {
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

/// load_weights that calls a Python function with a (name, tensor) list. What it
/// raises is kept in `slot` (when given), so the call that received raises it.
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

/// Tensors a worker receives into directly: a tensor_map_target over the Python
/// tensors' own memory (validated updates, direct receive, fingerprints). Host
/// tensors, or (CUDA builds) tensors on one GPU, received into directly when the
/// engine receives on that GPU (nccl) and staged then copied in otherwise (tcp).
struct held_target {
  held_tensors held;
  std::unique_ptr<tensor_map_target> target;

  static std::unique_ptr<held_target> make(nb::handle tensors, const std::string& what, refit::device engine_device) {
    auto out = std::make_unique<held_target>();
    out->held = held_tensors::from_python(tensors, what);
    tensor_map_target_options options;
    options.direct_receive = true;
    std::optional<refit::device> where;
    for (const auto& v : out->held.views()) {
      if (where && *where != v.device)
        throw_error(errc::invalid_argument, what + ": tensor '" + std::string(v.name) + "' is on " +
                                                to_string(v.device) + " and an earlier one on " + to_string(*where) +
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
};

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

 private:
  shared_object check_;
  model_target* inner_;
};

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

nb::dict stats_to_python(const update_stats& s) { return nb::cast<nb::dict>(to_python(s.to_json())); }

// ------------------------------------------------------------------ worker engine

class py_engine {
 public:
  py_engine(const std::string& backend, const std::string& device, std::int64_t timeout_ms, const std::string& commit,
            const std::optional<std::string>& secret_file, std::size_t processing_threads,
            std::size_t socket_buffer_bytes, int tp_rank, int tp_size, int dp_rank, int dp_size, nb::handle tensors,
            const std::string& fw, std::uint64_t max_stage_bytes, nb::handle check_update, bool keep_base)
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
      if (keep_base)
        throw_error(errc::invalid_argument,
                    "Engine: keep_base=True with tensors=: the tensors already hold the bytes deltas decode against");
      held_ = held_target::make(tensors, "Engine(tensors=...)", ctx.device);
      ctx.model = held_->target.get();
    }
    if (keep_base) {
      copy_ = std::make_unique<host_copy_target>();
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
    if (runtime::get().stopped()) return;  // interpreter exit: the loop is gone
    try {
      on_loop([this] {
        if (engine_->processing_pending() == 0) engine_->shutdown();
        return 0;
      });
    } catch (...) {
    }
    // Anything still pending ends with the process; the engine is destroyed on the
    // loop, where its coroutines run.
    block_on(destroy(std::move(engine_), std::move(session_)));
  }

  static asio::awaitable<void> destroy(std::unique_ptr<weight_transfer_engine> engine,
                                       std::unique_ptr<weight_update_session> session) {
    if (engine && engine->processing_pending() > 0) {
      try {
        co_await engine->drain_pending();
      } catch (...) {
      }
      engine->shutdown();
    }
    session.reset();
    engine.reset();
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
    if (held_) {
      if (engine_->weights_dirty())
        held_->target->abort(engine_->dirty_reason());
      else
        held_->target->finish(session_->weight_version());
    }
  }

  asio::awaitable<void> abort(std::string why) {
    co_await session_->abort_weight_update(why);
    if (held_ && held_->target->updating()) held_->target->abort(why);
  }

  void start() { session_->start_weight_update(); }

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
  std::unique_ptr<host_copy_target> copy_;   // keep_base=: what deltas decode against
  std::unique_ptr<weight_transfer_engine> engine_;
  std::unique_ptr<weight_update_session> session_;
};

// ------------------------------------------------------------------ trainer sender

class py_sender {
 public:
  py_sender(const std::string& backend, const std::string& device, std::int64_t timeout_ms,
            const std::optional<std::string>& secret_file, std::size_t socket_buffer_bytes) {
    auto config = make_config(backend, timeout_ms, "in_place", secret_file, 1, socket_buffer_bytes);
    trainer_context ctx;
    ctx.executor = runtime::get().executor();
    ctx.device = parse_device(device);
    sender_ = engine_factory::instance().create_sender(config, ctx);
  }
  ~py_sender() {
    if (runtime::get().stopped()) return;
    block_on(destroy(std::move(sender_)));
  }
  static asio::awaitable<void> destroy(std::unique_ptr<weight_sender> sender) {
    sender->shutdown();
    sender.reset();
    co_return;
  }

  std::string backend() const { return std::string(sender_->backend()); }
  nb::dict prepare(nb::handle trainer_args) {
    json args = to_json(trainer_args);
    if (args.is_null()) args = json::object();
    json info = on_loop([&] { return sender_->prepare(args); });
    return nb::cast<nb::dict>(to_python(info));
  }
  asio::awaitable<void> connect_workers() { co_await sender_->connect_workers(); }

  static asio::awaitable<void> send(weight_sender* sender, std::shared_ptr<held_tensors> held,
                                    std::shared_ptr<const update_metadata> declared) {
    auto views = held->views();
    range_source<std::span<const tensor_view>> source(views);
    co_await sender->send_weights(*declared, source);
  }

  nb::dict last_send_stats() {
    auto stats = on_loop([this] { return sender_->last_send_stats(); });
    return stats_to_python(stats);
  }
  nb::object last_send_info() {
    return to_python(on_loop([this] { return sender_->last_send_info(); }));
  }
  void shutdown() {
    on_loop([this] {
      sender_->shutdown();
      return 0;
    });
  }
  weight_sender& sender() { return *sender_; }
  tensor_cache& cache() { return cache_; }

 private:
  std::unique_ptr<weight_sender> sender_;
  tensor_cache cache_;
};

// The tensors of one send and what the trainer declares for them (their own
// metadata unless `metadata` is given; shared with the sender's cache, not copied).
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

// ------------------------------------------------------------------ worker group

std::vector<control::worker_endpoint> read_endpoints(nb::handle endpoints) {
  std::vector<control::worker_endpoint> out;
  for (nb::handle e : endpoints) {
    control::worker_endpoint ep;
    if (PyUnicode_Check(e.ptr())) {
      std::string text = nb::cast<std::string>(e);
      auto colon = text.rfind(':');
      if (colon == std::string::npos)
        throw_error(errc::invalid_argument, "WorkerGroup: expected 'host:port', got '" + text + "'");
      ep.host = text.substr(0, colon);
      try {
        int port = std::stoi(text.substr(colon + 1));
        if (port <= 0 || port > 65535) throw std::out_of_range("port");
        ep.port = static_cast<std::uint16_t>(port);
      } catch (const std::exception&) {
        throw_error(errc::invalid_argument, "WorkerGroup: bad port in '" + text + "'");
      }
    } else {
      auto pair = nb::cast<std::pair<std::string, int>>(e);
      if (pair.second <= 0 || pair.second > 65535)
        throw_error(errc::invalid_argument, "WorkerGroup: bad port " + std::to_string(pair.second));
      ep.host = pair.first;
      ep.port = static_cast<std::uint16_t>(pair.second);
    }
    out.push_back(std::move(ep));
  }
  if (out.empty()) throw_error(errc::invalid_argument, "WorkerGroup: no endpoints");
  return out;
}

class py_worker_group {
 public:
  py_worker_group(nb::handle endpoints, std::int64_t timeout_ms, const std::optional<std::string>& secret_file) {
    if (timeout_ms <= 0) throw_error(errc::invalid_argument, "timeout_ms: expected a positive number");
    std::string secret = secret_file && !secret_file->empty() ? auth::read_secret_file(*secret_file) : std::string();
    group_ = std::make_unique<worker_group>(runtime::get().executor(), std::chrono::milliseconds(timeout_ms),
                                            std::move(secret), read_endpoints(endpoints));
  }
  ~py_worker_group() {
    if (runtime::get().stopped()) return;
    block_on(destroy(std::move(group_)));
  }
  static asio::awaitable<void> destroy(std::unique_ptr<worker_group> group) {
    group->close();
    group.reset();
    co_return;
  }

  asio::awaitable<void> connect() { co_await group_->connect(); }
  static asio::awaitable<json> init(worker_group* group, weight_sender* sender, json args,
                                    control::init_options options) {
    co_return co_await group->init(*sender, std::move(args), options);
  }
  static asio::awaitable<json> update(worker_group* group, weight_sender* sender, std::shared_ptr<held_tensors> held,
                                      std::shared_ptr<const update_metadata> meta, std::int64_t version,
                                      control::update_options options) {
    auto result = co_await group->update(*sender, *meta, held->views(), version, options);
    json out;
    out["version"] = result.version;
    out["seconds"] = result.seconds;
    out["verified"] = result.verified;
    out["workers"] = json::array();
    for (const auto& w : result.workers) out["workers"].push_back(json{{"seconds", w.seconds}, {"stats", w.stats}});
    co_return out;
  }
  static asio::awaitable<json> call_all(worker_group* group, std::string method, json params) {
    auto answers = co_await group->call_all(std::move(method), std::move(params));
    co_return json(answers);
  }
  static asio::awaitable<json> differences(worker_group* group, fingerprint_list expected, std::int64_t version) {
    auto diffs = co_await group->fingerprint_differences(std::move(expected), version);
    co_return json(diffs);
  }
  void close() {
    on_loop([this] {
      group_->close();
      return 0;
    });
  }
  std::size_t size() const { return group_->size(); }
  worker_group& group() { return *group_; }

 private:
  std::unique_ptr<worker_group> group_;
};

control::init_options make_init_options(const std::string& ranks) {
  control::init_options o;
  if (ranks == "per_worker")
    o.ranks = control::rank_layout::per_worker;
  else if (ranks == "shared")
    o.ranks = control::rank_layout::shared;
  else
    throw_error(errc::invalid_argument, "ranks: expected 'per_worker' or 'shared', got '" + ranks + "'");
  return o;
}

// A stream handle from Python (torch.cuda.Stream.cuda_stream: the cudaStream_t as an
// int) as send_options::producer_stream takes it.
std::optional<const void*> producer_stream(std::optional<std::uintptr_t> handle) {
  if (!handle) return std::nullopt;
  return reinterpret_cast<const void*>(*handle);
}

control::update_options make_update_options(bool verify, const std::optional<std::string>& commit,
                                            nb::handle update_info, nb::handle expected, std::optional<bool> delta,
                                            std::optional<std::uintptr_t> stream) {
  control::update_options o;
  o.verify = verify;
  o.delta = delta;
  o.producer_stream = producer_stream(stream);
  if (commit) {
    if (*commit == "in_place")
      o.commit = commit_mode::in_place;
    else if (*commit == "staged")
      o.commit = commit_mode::staged;
    else
      throw_error(errc::invalid_argument, "commit: expected 'in_place' or 'staged', got '" + *commit + "'");
  }
  if (!update_info.is_none()) o.update_info = to_json(update_info);
  if (!expected.is_none()) o.expected = fingerprints_from_python(expected);
  return o;
}

// ------------------------------------------------------------------ worker host

class py_worker_host {
 public:
  py_worker_host(const std::string& backend, const std::string& host, int port, nb::handle tensors,
                 nb::object load_weights, std::int64_t timeout_ms, const std::string& commit,
                 const std::optional<std::string>& secret_file, std::size_t processing_threads, const std::string& fw,
                 nb::object on_started, nb::object on_finished, nb::object on_failed,
                 std::optional<std::int64_t> session_timeout_ms, std::uint64_t max_stage_bytes) {
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
    load_weights_fn fn;
    if (!tensors.is_none()) {
      held_ = held_target::make(tensors, "WorkerHost(tensors=...)", ctx.device);
      ctx.model = held_->target.get();
      fn = held_->target->as_load_weights();
      if (!load_weights.is_none())
        throw_error(errc::invalid_argument, "WorkerHost: give tensors= or load_weights=, not both");
    } else if (!load_weights.is_none()) {
      fn = python_loader(std::move(load_weights), parse_framework(fw), nullptr);
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
    hooks.on_update_finished = [finished, target](std::int64_t version, const json& stats) {
      if (target) target->finish(version);
      if (!finished || finished.get().is_none()) return;
      nb::gil_scoped_acquire gil;
      call_hook("on_update_finished", [&] { nb::handle(finished.get())(version, to_python(stats)); });
    };
    hooks.on_update_failed = [failed, target](const std::string& reason) {
      if (target && target->updating()) target->abort(reason);
      if (!failed || failed.get().is_none()) return;
      nb::gil_scoped_acquire gil;
      call_hook("on_update_failed", [&] { nb::handle(failed.get())(reason); });
    };
    host_ = std::make_unique<worker_host>(config, ctx, std::move(fn), engine_factory::instance(), limits);
    host_->set_hooks(std::move(hooks));
    port_ = on_loop([&] { return host_->listen(host, static_cast<std::uint16_t>(port)); });
    asio::co_spawn(runtime::get().executor(), host_->serve(), [](std::exception_ptr) {});
  }
  ~py_worker_host() {
    if (runtime::get().stopped()) return;
    try {
      stop();
    } catch (...) {
    }
    block_on(destroy(std::move(host_)));
  }
  static asio::awaitable<void> destroy(std::unique_ptr<worker_host> host) {
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
  std::unique_ptr<worker_host> host_;
  int port_ = 0;
  bool stopped_ = false;
};

// ------------------------------------------------------------------ bindings

// Async forms: `_start_<name>(..., done)` returns a pending_call; refit/_loop.py
// turns it into an awaitable.
nb::object none_of(json&) { return nb::none(); }

}  // namespace
}  // namespace refit::py

NB_MODULE(_refit, m) {
  using namespace refit;
  using namespace refit::py;
  m.doc() = "refit's C++ engines (see the refit package for the documented API)";

  // refit errors thrown anywhere (constructors, properties) become refit.Error's
  // subclass for their kind.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::system_error&) {  // refit's kinds, and CUDA's or the OS's errors
      nb::object exc = python_exception(p);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  nb::class_<pending_call>(m, "_PendingCall").def("cancel", &pending_call::cancel);

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

  nb::class_<py_engine>(m, "_Engine")
      .def(nb::init<const std::string&, const std::string&, std::int64_t, const std::string&,
                    const std::optional<std::string>&, std::size_t, std::size_t, int, int, int, int, nb::handle,
                    const std::string&, std::uint64_t, nb::handle, bool>(),
           nb::arg("backend"), nb::arg("device"), nb::arg("timeout_ms"), nb::arg("commit"),
           nb::arg("auth_secret_file").none(), nb::arg("processing_threads"), nb::arg("socket_buffer_bytes"),
           nb::arg("tp_rank"), nb::arg("tp_size"), nb::arg("dp_rank"), nb::arg("dp_size"), nb::arg("tensors").none(),
           nb::arg("framework"), nb::arg("max_stage_bytes"), nb::arg("check_update").none(),
           nb::arg("keep_base") = false)
      .def_prop_ro("backend", &py_engine::backend)
      .def_prop_ro("defers_processing", &py_engine::defers_processing)
      .def("state", &py_engine::state)
      .def("fingerprint", &py_engine::fingerprint, nb::arg("names"))
      .def("shutdown", &py_engine::shutdown)
      .def("start_weight_update",
           [](py_engine& e) {
             on_loop([&] {
               e.start();
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

  auto to_py = [](json& j) { return to_python(j); };
  nb::class_<py_worker_group>(m, "_WorkerGroup")
      .def(nb::init<nb::handle, std::int64_t, const std::optional<std::string>&>(), nb::arg("endpoints"),
           nb::arg("timeout_ms"), nb::arg("auth_secret_file").none())
      .def("__len__", &py_worker_group::size)
      .def("close", &py_worker_group::close)
      .def("connect", [](py_worker_group& g) { block_on(g.connect()); })
      .def(
          "_start_connect",
          [](py_worker_group& g, nb::object done) { return start_void(g.connect(), std::move(done)); }, nb::arg("done"))
      .def(
          "init",
          [to_py](py_worker_group& g, py_sender& s, nb::handle args, const std::string& ranks) {
            json a = to_json(args);
            if (a.is_null()) a = json::object();
            json out = block_on(py_worker_group::init(&g.group(), &s.sender(), std::move(a), make_init_options(ranks)));
            return nb::cast<nb::dict>(to_py(out));
          },
          nb::arg("sender"), nb::arg("trainer_args").none(), nb::arg("ranks"))
      .def(
          "_start_init",
          [to_py](py_worker_group& g, py_sender& s, nb::handle args, const std::string& ranks, nb::object done) {
            json a = to_json(args);
            if (a.is_null()) a = json::object();
            return start<json>(py_worker_group::init(&g.group(), &s.sender(), std::move(a), make_init_options(ranks)),
                               to_py, std::move(done));
          },
          nb::arg("sender"), nb::arg("trainer_args").none(), nb::arg("ranks"), nb::arg("done"))
      .def(
          "update",
          [to_py](py_worker_group& g, py_sender& s, nb::handle tensors, std::int64_t version, bool verify,
                  std::optional<std::string> commit, nb::handle update_info, nb::handle expected, nb::handle metadata,
                  std::optional<bool> delta, std::optional<std::uintptr_t> stream) {
            auto [held, declared] = hold_for_send(tensors, metadata, "update", &s.cache());
            auto options = make_update_options(verify, commit, update_info, expected, delta, stream);
            json out = block_on(py_worker_group::update(&g.group(), &s.sender(), std::move(held), std::move(declared),
                                                        version, std::move(options)));
            return nb::cast<nb::dict>(to_py(out));
          },
          nb::arg("sender"), nb::arg("tensors"), nb::arg("version"), nb::arg("verify"), nb::arg("commit").none(),
          nb::arg("update_info").none(), nb::arg("expected").none(), nb::arg("metadata").none(),
          nb::arg("delta").none() = nb::none(), nb::arg("stream").none() = nb::none())
      .def(
          "_start_update",
          [to_py](py_worker_group& g, py_sender& s, nb::handle tensors, std::int64_t version, bool verify,
                  std::optional<std::string> commit, nb::handle update_info, nb::handle expected, nb::handle metadata,
                  std::optional<bool> delta, std::optional<std::uintptr_t> stream, nb::object done) {
            auto [held, declared] = hold_for_send(tensors, metadata, "update", &s.cache());
            auto options = make_update_options(verify, commit, update_info, expected, delta, stream);
            return start<json>(py_worker_group::update(&g.group(), &s.sender(), std::move(held), std::move(declared),
                                                       version, std::move(options)),
                               to_py, std::move(done));
          },
          nb::arg("sender"), nb::arg("tensors"), nb::arg("version"), nb::arg("verify"), nb::arg("commit").none(),
          nb::arg("update_info").none(), nb::arg("expected").none(), nb::arg("metadata").none(),
          nb::arg("delta").none(), nb::arg("stream").none(), nb::arg("done"))
      .def(
          "call_all",
          [to_py](py_worker_group& g, const std::string& method, nb::handle params) {
            json p = to_json(params);
            if (p.is_null()) p = json::object();
            json out = block_on(py_worker_group::call_all(&g.group(), method, std::move(p)));
            return nb::cast<nb::list>(to_py(out));
          },
          nb::arg("method"), nb::arg("params").none())
      .def(
          "_start_call_all",
          [to_py](py_worker_group& g, const std::string& method, nb::handle params, nb::object done) {
            json p = to_json(params);
            if (p.is_null()) p = json::object();
            return start<json>(py_worker_group::call_all(&g.group(), method, std::move(p)), to_py, std::move(done));
          },
          nb::arg("method"), nb::arg("params").none(), nb::arg("done"))
      .def(
          "fingerprint_differences",
          [to_py](py_worker_group& g, nb::handle expected, std::int64_t version) {
            json out = block_on(py_worker_group::differences(&g.group(), fingerprints_from_python(expected), version));
            return nb::cast<nb::list>(to_py(out));
          },
          nb::arg("expected"), nb::arg("version"));

  nb::class_<py_worker_host>(m, "_WorkerHost")
      .def(nb::init<const std::string&, const std::string&, int, nb::handle, nb::object, std::int64_t,
                    const std::string&, const std::optional<std::string>&, std::size_t, const std::string&, nb::object,
                    nb::object, nb::object, std::optional<std::int64_t>, std::uint64_t>(),
           nb::arg("backend"), nb::arg("host"), nb::arg("port"), nb::arg("tensors").none(),
           nb::arg("load_weights").none(), nb::arg("timeout_ms"), nb::arg("commit"), nb::arg("auth_secret_file").none(),
           nb::arg("processing_threads"), nb::arg("framework"), nb::arg("on_update_started").none(),
           nb::arg("on_update_finished").none(), nb::arg("on_update_failed").none(),
           nb::arg("session_timeout_ms").none(), nb::arg("max_stage_bytes"))
      .def_prop_ro("port", &py_worker_host::port)
      .def("stop", &py_worker_host::stop)
      .def("weight_info", &py_worker_host::weight_info)
      .def("fingerprint", &py_worker_host::fingerprint, nb::arg("names"))
      .def("add_method", &py_worker_host::add_method, nb::arg("name"), nb::arg("fn"));
}
