#include <refit/control/internal/worker_state.h>

#include <algorithm>

#include <refit/internal/engine_access.h>

namespace refit::control::internal {

namespace {

host_limits resolved(host_limits limits, const weight_transfer_config& config) {
  limits.handshake_timeout = std::min(limits.handshake_timeout, config.timeout);
  if (limits.session_timeout.count() <= 0) limits.session_timeout = config.timeout;
  return limits;
}

}  // namespace

worker_state::worker_state(weight_transfer_config config_in, engine_context context_in, load_weights_fn load_in,
                           engine_factory& factory, host_limits limits_in)
    : config(std::move(config_in)), context(std::move(context_in)), load_weights(std::move(load_in)),
      limits(resolved(limits_in, config)), engine(factory.create_engine(config, context)), session(*engine),
      server(
          context.executor, [this] { return refit::internal::engine_access::processing_executor(*engine); },
          config.auth_secret, config.timeout, limits,
          rpc_server::events{
              .frame_read = [this](const rpc_connection& c) { owner.heard_from(c); },
              .request_ended = [this](const rpc_connection& c) { owner.request_ended(c); },
              .closed = [this](const rpc_connection& c) { owner.connection_closed(c); },
          }),
      owner(
          context.executor, session, limits.session_timeout, [this](std::uint64_t id) { return server.in_flight(id); },
          [this](const std::string& why, errc kind) {
            set_error("weight update session aborted: " + why, kind);
            update_failed("the weight update session was aborted: " + why, kind);
          }) {}

void worker_state::note_error(const std::string& method, std::exception_ptr e) {
  errc kind = error_kind_of(e);
  // A code of another category, or past refit's kinds (a plugin's): no refit
  // kind, so what error_kind_of says of anything that is not a refit::error.
  if (kind == errc{} || kind > last_errc) kind = errc::io_error;
  set_error(method + ": " + std::string(errc_name(kind)) + ": " + error_message_of(e), kind);
}

void worker_state::set_error(std::string text, errc kind) {
  last_error = std::move(text);
  last_error_kind = kind;
}

void worker_state::clear_error() noexcept {
  last_error.clear();
  last_error_kind = errc{};
}

std::string worker_state::weight_state() const {
  if (engine->weights_dirty()) return "dirty";
  // A finish that is still committing is changing the model: not clean yet.
  return session.active() || session.finishing() ? "updating" : "clean";
}

json worker_state::update_stats() const {
  json stats = engine->last_update_stats().to_json();
  if (auto t = engine->transport_info(); !t.is_null()) stats["transport"] = std::move(t);
  return stats;
}

void worker_state::note_hook_error(const char* hook, std::exception_ptr e) noexcept {
  try {
    last_hook_error = std::string(hook) + ": " + std::string(errc_name(error_kind_of(e))) + ": " + error_message_of(e);
  } catch (...) {
  }
}

std::exception_ptr worker_state::update_started() noexcept {
  if (!hooks.on_update_started) return nullptr;
  try {
    auto hook = hooks.on_update_started;  // a copy: the hook may replace the hooks
    hook(owner.name());
  } catch (...) {
    note_hook_error("on_update_started", std::current_exception());
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr worker_state::update_finished(const json& stats) noexcept {
  if (!hooks.on_update_finished) return nullptr;
  try {
    auto hook = hooks.on_update_finished;
    hook(session.weight_version().value_or(-1), stats);
  } catch (...) {
    note_hook_error("on_update_finished", std::current_exception());
    return std::current_exception();
  }
  return nullptr;
}

void worker_state::update_failed(const std::string& reason, errc kind) noexcept {
  if (!hooks.on_update_failed) return;
  try {
    auto hook = hooks.on_update_failed;
    hook(reason, kind);
  } catch (...) {
    note_hook_error("on_update_failed", std::current_exception());
  }
}

error hook_error(const std::string& verb, const char* hook, std::exception_ptr e) {
  errc kind = errc::processing_failed;
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    if (x.kind() != errc{}) kind = x.kind();
  } catch (...) {
  }
  return error(kind, verb + ": the application's " + hook + " hook failed: " + error_message_of(e));
}

}  // namespace refit::control::internal
