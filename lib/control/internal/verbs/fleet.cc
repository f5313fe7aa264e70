// The verbs of fleet-atomic updates (docs/control-plane.md, "Fleet-atomic
// updates"): prepare_weight_update {} votes: it answers once the owner's staged
// session holds its whole update, nothing of it applied (the vote is yes), or
// fails with why it cannot commit (the vote is no; the session stays open for the
// trainer to abort). abort_weight_update {"why": str, "kind": str} (both
// optional) closes the owner's session: a staged one leaves the model, its
// version and its state exactly as before; "kind" (an error kind's name, default
// "cancelled") is what the trainer says ended it. rollback_weight_update {}
// returns a committed fleet-atomic update to the version before it;
// release_weight_undo {} drops that undo.
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
  const std::optional<std::string> kind_name = r.maybe<std::string>("kind");
  r.finish();
  const errc kind = kind_name ? parse_errc(*kind_name) : errc::cancelled;
  if (kind == errc{})
    r.fail("member 'kind' must name an error kind (\"timeout\", \"peer_lost\", \"cancelled\", ...), got \"" +
           *kind_name + "\"");
  // Nothing to abort (the session already ended: its chunk failed, or it was
  // never started) is not an error: the trainer aborts every worker it told.
  if (!w.session.active()) co_return json{{"aborted", false}, {"state", w.weight_state()}};
  w.owner.require(caller, "abort_weight_update");
  const std::string reason = "the trainer aborted it" + (why.empty() ? std::string() : ": " + why);
  co_await w.session.abort_weight_update(reason);
  w.owner.release();
  w.set_error("weight update session aborted: " + reason, kind);
  w.update_failed();
  co_return json{{"aborted", true}, {"state", w.weight_state()}};
}

asio::awaitable<json> rollback_weight_update(worker_state& w, rpc_connection&, json params) {
  auto r = params_reader(params, "rollback_weight_update");
  r.finish();
  const std::optional<std::int64_t> from = w.session.weight_version();
  std::exception_ptr failure;
  try {
    co_await w.session.rollback_weight_update();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    w.note_error("rollback_weight_update", failure);
    if (w.engine->weights_dirty()) w.update_failed();  // the model changed: servers must know
    std::rethrow_exception(failure);
  }
  // Nothing failed here: the trainer took the committed update back (another
  // worker's commit failed), as an abort cancels one not yet committed.
  w.set_error(
      "update " + (from ? std::to_string(*from) : std::string("(unlabelled)")) + " was rolled back by the trainer",
      errc::cancelled);
  json stats = w.update_stats();
  if (std::exception_ptr failed = w.update_finished(stats)) {
    auto e = std::make_exception_ptr(hook_error("rollback_weight_update", "on_update_finished", failed));
    w.note_error("rollback_weight_update", e);
    std::rethrow_exception(e);
  }
  co_return json{{"weight_version", w.session.weight_version() ? json(*w.session.weight_version()) : json(nullptr)},
                 {"state", w.weight_state()}};
}

asio::awaitable<json> release_weight_undo(worker_state& w, rpc_connection&, json params) {
  auto r = params_reader(params, "release_weight_undo");
  r.finish();
  const bool held = w.session.holds_undo();
  w.session.release_undo();
  co_return json{{"released", held}};
}

}  // namespace refit::control::internal::verbs
