// prepare_weight_update {} and abort_weight_update {"why": str} (optional): the
// first phase of a fleet-atomic update and its way back (docs/control-plane.md,
// "Fleet-atomic updates"). prepare votes: it answers once the owner's staged
// session holds its whole update, nothing of it applied (the vote is yes), or
// fails with why it cannot commit (the vote is no; the session stays open for
// the trainer to abort). abort closes the owner's session: a staged one leaves
// the model, its version and its state exactly as before.
#include <refit/control/internal/verbs/verbs.h>

#include <refit/internal/engine_access.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> prepare_weight_update(worker_state& w, rpc_connection& caller, json params) {
  w.owner.require(caller, "prepare_weight_update");
  auto r = params_reader(params, "prepare_weight_update");
  r.finish();
  std::exception_ptr failure;
  try {
    co_await w.session.prepare_weight_update();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    w.note_error("prepare_weight_update", failure);
    std::rethrow_exception(failure);
  }
  co_return json{{"vote", "yes"},
                 {"chunks", w.session.chunks()},
                 {"staged_bytes", w.engine->staged_bytes()},
                 {"weight_version", w.session.weight_version() ? json(*w.session.weight_version()) : json(nullptr)}};
}

asio::awaitable<json> abort_weight_update(worker_state& w, rpc_connection& caller, json params) {
  auto r = params_reader(params, "abort_weight_update");
  const std::string why = r.maybe<std::string>("why").value_or("");
  r.finish();
  // Nothing to abort (the session already ended: its chunk failed, or it was
  // never started) is not an error: the trainer aborts every worker it told.
  if (!w.session.active()) co_return json{{"aborted", false}, {"state", w.weight_state()}};
  w.owner.require(caller, "abort_weight_update");
  const std::string reason = "the trainer aborted it" + (why.empty() ? std::string() : ": " + why);
  co_await w.session.abort_weight_update(reason);
  w.owner.release();
  w.last_error = "weight update session aborted: " + reason;
  w.update_failed(w.last_error);
  co_return json{{"aborted", true}, {"state", w.weight_state()}};
}

}  // namespace refit::control::internal::verbs
