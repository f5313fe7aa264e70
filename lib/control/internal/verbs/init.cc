// init_weight_transfer_engine {"init_info": {...}}: (re)initialises the engine;
// refused while another connection's session is open. The owner's own init
// aborts its session first (refused while a chunk is being received).
#include <refit/control/internal/verbs/verbs.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> init_weight_transfer_engine(worker_state& w, rpc_connection& caller, json params) {
  auto r = params_reader(params, "init_weight_transfer_engine");
  json init_info = r.required<json>("init_info");
  r.finish();
  if (w.session.active()) {
    if (!w.owner.is(caller)) {
      throw_error(errc::invalid_state,
                  "init_weight_transfer_engine: refused while the weight update session started by " + w.owner.name() +
                      " is open (finish it, or close that connection; its owner has been silent for " +
                      std::to_string(w.owner.silence().count()) + " ms, and the session is aborted after " +
                      std::to_string(w.owner.timeout().count()) + " ms of silence)");
    }
    if (w.session.receiving())
      throw_error(errc::invalid_state,
                  "init_weight_transfer_engine: a chunk of this connection's update is "
                  "still being received");
  }
  std::exception_ptr failure;
  try {
    auto info = w.engine->parse_init_info(init_info);
    // The owner re-initialises during its own session: that session ends here
    // (dirty if any of it was applied).
    const bool ends_session = w.session.active();
    co_await w.session.abort_weight_update("the engine was re-initialised during it");
    w.owner.release();
    // Its owner gave it up (cancelled), as an abort_weight_update does.
    if (ends_session)
      w.update_failed(
          "init_weight_transfer_engine: the weight update session was aborted: the engine was "
          "re-initialised during it",
          errc::cancelled);
    co_await w.engine->init_transfer_engine(*info);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    w.note_error("init_weight_transfer_engine", failure);
    std::rethrow_exception(failure);
  }
  json answer = json::object();
  if (auto t = w.engine->transport_info(); !t.is_null()) answer["transport"] = std::move(t);
  co_return answer;
}

}  // namespace refit::control::internal::verbs
