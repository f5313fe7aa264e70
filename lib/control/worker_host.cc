// The worker host: an RPC server (internal/rpc_server.h) serving the verbs of
// internal/verbs/ over the state they share (internal/worker_state.h).
#include <refit/control/worker_host.h>

#include <refit/control/internal/verbs/verbs.h>
#include <refit/control/internal/worker_state.h>

namespace refit::control {

namespace {

using internal::rpc_connection;
using internal::worker_state;
using verb_fn = asio::awaitable<json> (*)(worker_state&, rpc_connection&, json);

// An application's method, run with its own copy (the application may replace
// it while it runs) and its params kept in this frame.
asio::awaitable<json> call_method(worker_host::method m, json params) { co_return co_await m(params); }

}  // namespace

worker_host::worker_host(weight_transfer_config config, engine_context context, load_weights_fn load_weights,
                         engine_factory& factory, host_limits limits)
    : state_(std::make_unique<worker_state>(std::move(config), std::move(context), std::move(load_weights), factory,
                                            limits)) {
  namespace verbs = internal::verbs;
  const std::pair<const char*, verb_fn> builtins[] = {
      {"init_weight_transfer_engine", &verbs::init_weight_transfer_engine},
      {"start_weight_update", &verbs::start_weight_update},
      {"update_weights", &verbs::update_weights},
      {"prepare_weight_update", &verbs::prepare_weight_update},
      {"finish_weight_update", &verbs::finish_weight_update},
      {"abort_weight_update", &verbs::abort_weight_update},
      {"rollback_weight_update", &verbs::rollback_weight_update},
      {"release_weight_undo", &verbs::release_weight_undo},
      {"weight_fingerprint", &verbs::weight_fingerprint},
      {"weight_info", &verbs::weight_info},
  };
  worker_state* w = state_.get();
  for (const auto& [name, fn] : builtins)
    state_->server.add_builtin(
        name, [w, fn = fn](rpc_connection& caller, json params) { return fn(*w, caller, std::move(params)); });
}

worker_host::~worker_host() { stop(); }

std::uint16_t worker_host::listen(const std::string& host, std::uint16_t port) {
  return state_->server.listen(host, port);
}

asio::awaitable<void> worker_host::serve() { return state_->server.serve(); }

void worker_host::add_method(const std::string& name, method m) {
  if (state_->server.is_builtin(name))
    throw_error(errc::invalid_argument, "worker_host: '" + name + "' is a built-in verb and cannot be replaced");
  state_->server.add_method(
      name, [m = std::move(m)](rpc_connection&, json params) { return call_method(m, std::move(params)); });
}

void worker_host::set_hooks(update_hooks hooks) { state_->hooks = std::move(hooks); }

json worker_host::weight_info() const { return internal::verbs::weight_info_of(*state_); }

const weight_transfer_engine& worker_host::engine() const { return *state_->engine; }

const weight_update_session& worker_host::session() const { return state_->session; }

std::size_t worker_host::connection_count() const noexcept { return state_->server.connection_count(); }

void worker_host::stop() {
  state_->owner.end_watch();
  state_->server.stop();
  // Refused while deferred processing runs (it reads staging): the engine then
  // shuts down when it is destroyed. stop() itself never throws.
  if (state_->engine) {
    try {
      state_->engine->shutdown();
    } catch (const error&) {
    }
  }
}

asio::awaitable<void> worker_host::drain_pending() { co_await state_->engine->drain_pending(); }

update_hooks tensor_map_hooks(const worker_host& host, tensor_map_target& target, update_hooks also) {
  update_hooks hooks;
  hooks.on_update_started = std::move(also.on_update_started);
  hooks.on_update_finished = [&target, then = std::move(also.on_update_finished)](std::int64_t version,
                                                                                  const json& stats) {
    target.finish(version);
    if (then) then(version, stats);
  };
  hooks.on_update_failed = [&host, &target, then = std::move(also.on_update_failed)](const std::string& reason,
                                                                                     errc kind) {
    if (target.updating()) {
      if (host.engine().weights_dirty()) {
        target.abort(reason);
      } else {
        // The model holds a version whole again (a failed fleet-atomic commit
        // loaded it back): serve it, labelled as the host labels it.
        const json v = host.weight_info()["weight_version"];
        target.finish(v.is_number_integer() ? std::optional<std::int64_t>(v.get<std::int64_t>()) : std::nullopt);
      }
    }
    if (then) then(reason, kind);
  };
  return hooks;
}

}  // namespace refit::control
