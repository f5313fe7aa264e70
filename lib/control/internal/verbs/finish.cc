// finish_weight_update {"weight_version": int} (optional member): closes the
// owner's session (a staged one commits here) and calls on_update_finished when
// the weights are clean at the version, else on_update_failed.
#include <refit/control/internal/verbs/verbs.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> finish_weight_update(worker_state& w, rpc_connection& caller, json params) {
  w.owner.require(caller, "finish_weight_update");
  auto r = params_reader(params, "finish_weight_update");
  auto version = r.maybe<std::int64_t>("weight_version");
  r.finish();
  std::exception_ptr failure;
  try {
    co_await w.session.finish_weight_update(version);
  } catch (...) {
    failure = std::current_exception();
  }
  if (!w.session.active()) w.owner.release();
  if (failure) {
    w.note_error("finish_weight_update", failure);
    if (!w.session.active()) w.update_failed();  // it closed, unrecorded
    std::rethrow_exception(failure);
  }
  w.clear_error();
  json stats = w.update_stats();
  if (w.engine->weights_dirty()) {
    // The update arrived, but the model holds no whole version.
    w.update_failed("finish_weight_update: the session finished with the weights dirty: " + w.engine->dirty_reason(),
                    errc::invalid_state);
  } else if (std::exception_ptr failed = w.update_finished(stats)) {
    auto e = std::make_exception_ptr(hook_error("finish_weight_update", "on_update_finished", failed));
    w.note_error("finish_weight_update", e);
    std::rethrow_exception(e);
  }
  co_return json{{"stats", std::move(stats)}};
}

}  // namespace refit::control::internal::verbs
