// update_weights {"update_info": {...}}: receives one chunk of the owner's
// session. A chunk that fails (or is refused before its first byte) ends the
// session; a refusal is also told to the trainer on the data path.
#include <refit/control/internal/verbs/verbs.h>

#include <refit/internal/engine_access.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> update_weights(worker_state& w, rpc_connection& caller, json params) {
  w.owner.require(caller, "update_weights");
  std::exception_ptr failure;
  try {
    // Refused before its update_info is read (off the loop) as after.
    if (w.session.receiving())
      throw_error(errc::invalid_state, "update_weights: another chunk of this update is still being received");
    std::unique_ptr<update_info> info;
    try {
      auto r = params_reader(params, "update_weights");
      if (!r.has("update_info")) r.fail("missing required member 'update_info'");  // read in place, not copied
      r.finish();
      info = co_await w.engine->read_update_info(params["update_info"]);
    } catch (const error& e) {
      // The trainer is about to send this update: tell it at once why it is
      // refused rather than let it wait for a worker that reads nothing.
      refit::internal::engine_access::refuse_update(*w.engine, e.kind(), "update_weights: " + e.message());
      throw;
    }
    params = json();  // the typed info is all that is needed now: free the parsed frame
    const commit_mode mode = info->commit.value_or(w.config.commit);
    if (!w.session.receiving()) w.receiving_commit = mode;  // else refused below: another chunk is
    co_await w.session.update_weights(*info, w.load_weights);
    w.applied_commit = mode;
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // A failed chunk ends the session: the next start_weight_update begins clean.
    w.note_error("update_weights", failure);
    const bool was_active = w.session.active();
    co_await w.session.abort_weight_update("its chunk failed: " + error_message_of(failure));
    w.owner.release();
    if (was_active && !w.session.active()) w.update_failed();
    std::rethrow_exception(failure);
  }
  if (w.owner.left()) co_await w.owner.end_after_owner_left();
  co_return json{{"stats", w.update_stats()}};
}

}  // namespace refit::control::internal::verbs
