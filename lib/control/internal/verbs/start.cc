// start_weight_update {"fleet_atomic": bool} (optional): opens a session owned by
// the calling connection and calls the application's on_update_started hook,
// which may refuse it. fleet_atomic makes it undoable (session::require_undo).
#include <refit/control/internal/verbs/verbs.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> start_weight_update(worker_state& w, rpc_connection& caller, json params) {
  auto r = params_reader(params, "start_weight_update");
  const bool fleet_atomic = r.maybe<bool>("fleet_atomic").value_or(false);
  r.finish();
  if (w.session.active() && !w.owner.is(caller))
    throw_error(errc::invalid_state,
                "start_weight_update: the weight update session started by " + w.owner.name() + " is open");
  w.session.start_weight_update();
  if (fleet_atomic) w.session.require_undo();
  w.owner.opened_by(caller);
  if (std::exception_ptr refused = w.update_started()) {
    // The application refused the session: it closes again before anything of
    // it was received (the weights are untouched).
    co_await w.session.abort_weight_update("the application's on_update_started hook refused it");
    w.owner.release();
    auto e = std::make_exception_ptr(hook_error("start_weight_update", "on_update_started", refused));
    w.note_error("start_weight_update", e);
    std::rethrow_exception(e);
  }
  co_return json::object();
}

}  // namespace refit::control::internal::verbs
