// weight_info {}: the worker's state (the members are listed in
// docs/control-plane.md, "weight_info").
#include <refit/control/internal/verbs/verbs.h>

namespace refit::control::internal::verbs {

json weight_info_of(const worker_state& w) {
  const auto& engine = *w.engine;
  const auto& session = w.session;
  json info = {
      {"backend", engine.backend()},
      {"initialized", engine.initialized()},
      {"defers_processing", engine.defers_processing()},
      {"session_active", session.active()},
      {"receiving", engine.receiving()},
      {"state", w.weight_state()},
      {"commit", to_string(session.receiving() && w.receiving_commit ? *w.receiving_commit
                                                                     : w.applied_commit.value_or(w.config.commit))},
      {"default_commit", to_string(w.config.commit)},
      {"last_update", engine.last_update_stats().to_json()},
      {"connections", w.server.connection_count()},
      {"accept_errors", w.server.accept_errors()},
      {"transport", engine.transport_info()}};
  const bool owned = session.active() && w.owner.has_owner();
  info["session_owner"] = owned ? json(w.owner.name()) : json(nullptr);
  info["session_timeout_ms"] = w.owner.timeout().count();
  info["session_chunks"] = session.active() ? json(session.chunks()) : json(nullptr);
  info["session_idle_ms"] =
      owned ? json(w.owner.busy() ? std::int64_t{0} : static_cast<std::int64_t>(w.owner.silence().count()))
            : json(nullptr);
  info["weight_version"] = session.weight_version() ? json(*session.weight_version()) : json(nullptr);
  info["holds_undo"] = session.holds_undo();
  info["undo_version"] = session.undo_version() ? json(*session.undo_version()) : json(nullptr);
  info["dirty_reason"] = engine.weights_dirty() ? json(engine.dirty_reason()) : json(nullptr);
  info["last_error"] = w.last_error.empty() ? json(nullptr) : json(w.last_error);
  info["last_error_kind"] = w.last_error_kind == errc{} ? json(nullptr) : json(errc_name(w.last_error_kind));
  info["last_hook_error"] = w.last_hook_error.empty() ? json(nullptr) : json(w.last_hook_error);
  const std::string& refused = w.server.last_refused();
  info["last_refused_connection"] = refused.empty() ? json(nullptr) : json(refused);
  const std::string& accept_error = w.server.last_accept_error();
  info["last_accept_error"] = accept_error.empty() ? json(nullptr) : json(accept_error);
  return info;
}

asio::awaitable<json> weight_info(worker_state& w, rpc_connection&, json params) {
  auto r = params_reader(params, "weight_info");
  r.finish();
  co_return weight_info_of(w);
}

}  // namespace refit::control::internal::verbs
