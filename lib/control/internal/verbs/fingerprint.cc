// weight_fingerprint {"names": [str]} (optional; all weights when absent):
// hashes of the model's tensors, computed off the loop (lib/integrity/fingerprint.h).
#include <refit/control/internal/verbs/verbs.h>

#include <refit/backend/async/offload.h>
#include <refit/integrity/fingerprint.h>
#include <refit/internal/engine_access.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> weight_fingerprint(worker_state& w, rpc_connection&, json params) {
  auto r = params_reader(params, "weight_fingerprint");
  auto names = r.optional<std::vector<std::string>>("names", {});
  r.finish();
  if (!w.context.model)
    throw_error(errc::unsupported, "weight_fingerprint: this worker was created without a model target");
  // Hashing a model reads all of it: not on the event loop.
  auto* model = w.context.model;
  // (Captures by pointer and reference only: GCC 12 may destroy a lambda that owns
  // memory twice when it is a temporary of a co_await expression.)
  // (Its JSON is built there too: a map of every tensor.)
  json answer = co_await async::offload(refit::internal::engine_access::processing_executor(*w.engine),
                                        [model, &names] { return fingerprints_to_json(model->fingerprint(names)); });
  answer["weight_version"] = w.session.weight_version() ? json(*w.session.weight_version()) : json(nullptr);
  answer["state"] = w.weight_state();
  co_return answer;
}

}  // namespace refit::control::internal::verbs
