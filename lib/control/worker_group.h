// The trainer side of a weight transfer to N workers: one control connection per
// worker, vLLM's weight-transfer verbs called on all of them at once, and the whole
// sequence of an update:
//
//   control::worker_group workers(ex, timeout, secret, {{"10.0.0.2", 4001}, {"10.0.0.3", 4001}});
//   co_await workers.connect();
//   auto sender = engine_factory::instance().create_sender(config, trainer_context{ex, {}});
//   co_await workers.init(*sender, trainer_args);   // prepare, every worker's init, connect_workers
//   for (std::int64_t v = 1;; ++v) {
//     ...  // train
//     auto result = co_await workers.update(*sender, meta, views, v);  // verified by default
//   }
//   workers.close();
//   sender->shutdown();
//
// Every call runs on every worker at once; the group waits for all of them (none
// is abandoned half way) and then rethrows the FIRST error, its message prefixed
// with the worker's name ("worker 1 (10.0.0.3:4001): update_weights failed ...").
// asio's `&&` would wait too, but reports two failures as "multiple exceptions".
//
// Not thread-safe: use a group from its executor's thread (one call at a time,
// each awaited before the next, unless stated).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>

#include <refit/config.h>
#include <refit/control/client.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>
#include <refit/tensor.h>
#include <refit/trainer.h>

namespace refit::control {

/// Awaits `op` and drops its result.
template <class T>
asio::awaitable<void> discard(asio::awaitable<T> op) {
  co_await std::move(op);
}

/// Both at once; waits for both, then rethrows the first error (asio's && would
/// report two as "multiple exceptions").
asio::awaitable<void> both_void(asio::awaitable<void> a, asio::awaitable<void> b);

/// The same for awaitables of any result (dropped). Typical: the sender's
/// connect_workers() alongside a worker's init, or update_weights alongside the
/// send.
template <class A, class B>
asio::awaitable<void> both(asio::awaitable<A> a, asio::awaitable<B> b) {
  co_await both_void(discard(std::move(a)), discard(std::move(b)));
}

namespace detail {
struct fleet_state;  // worker_group.cc: where an update stands on each worker
}  // namespace detail

/// A worker's control address.
struct worker_endpoint {
  std::string host;
  std::uint16_t port = 0;
};

/// How init() tells each worker its data rank.
enum class rank_layout {
  /// Each worker is an inference engine of its own: worker i gets rank_offset 1 + i
  /// (where the backend's init_info has a rank_offset).
  per_worker,
  /// The workers are the ranks of ONE engine (tensor parallel): every worker gets
  /// the sender's init_info unchanged and joins as rank_offset + its own rank.
  shared,
};

// The option structs declare their constructor, so they are not aggregates: GCC 12
// destroys an aggregate temporary passed by value to a coroutine inside co_await
// twice (a default `options = {}` included), which for update_options' json is a
// double free. With a constructor, `co_await group.update(..., version)` is safe.
// Set members after construction (no designated initialisers).
struct init_options {
  init_options() = default;
  rank_layout ranks = rank_layout::per_worker;
  /// Called with each worker's index and init_info before it is sent, e.g. to
  /// advertise another master_port (a proxy in front of the trainer). Optional.
  std::function<void(std::size_t worker, json& init_info)> adjust;
};

struct update_options {
  update_options() = default;
  /// Written into update_info's "commit"; nullopt: leave it out (each worker's
  /// configured mode).
  std::optional<commit_mode> commit;
  /// After finish: every worker's weight_fingerprint must equal the trainer's own
  /// fingerprints, with state "clean" at the update's version (else integrity_error
  /// naming the worker and its first difference). The trainer's fingerprints are
  /// computed from the views before the update starts (host tensors only), or
  /// taken from `expected`. The worker's whole model is compared: an update of part
  /// of a model passes the whole model's fingerprints in `expected`.
  bool verify = true;
  /// The trainer's fingerprints to verify against instead of the views' (required
  /// with verify for the tensor_source overload).
  std::optional<fingerprint_list> expected;
  /// Two-phase: every worker receives the update into its stage (the commit is
  /// staged; commit in_place is invalid_argument), then votes
  /// (prepare_weight_update: its whole update is staged, nothing of it applied,
  /// no chunk failed). Only when every worker voted yes is any told to commit.
  /// Before that, any failure (a worker refusing, losing its stream, voting no,
  /// the send failing) aborts every worker's session: each keeps its previous
  /// version and weights, untouched, and the error names every worker with its
  /// phase (docs/control-plane.md, "Fleet-atomic updates"). Every worker must be
  /// able to undo its commit (its model reads its tensors back,
  /// model_target::read_back), else it refuses before any byte moves
  /// (unsupported, naming it). A worker that fails at its commit, after every
  /// vote, loads its previous version back, and every worker that committed is
  /// rolled back (rollback_weight_update): the fleet stays at one version, and
  /// the error names each worker's outcome; a worker whose rollback fails is
  /// fenced (dirty, claiming no version).
  bool fleet_atomic = false;
  /// A pause between update_weights and finish_weight_update (fault tests: a
  /// window in which every worker holds the whole stream but has not committed).
  /// The group sends nothing meanwhile: a pause longer than a worker's session
  /// timeout (host_limits::session_timeout) loses the session there.
  std::chrono::milliseconds hold_before_finish{0};
  /// Members added to every worker's update_info besides the metadata and commit
  /// (backend-specific per-update info). Optional.
  json update_info = json::object();
  /// Deltas for this update (send_options::delta, given to the sender's
  /// set_next_send): nullopt as the sender was prepared, false full, true a
  /// delta where workers hold the base (the sender must be prepared with deltas).
  std::optional<bool> delta;
  /// The stream the views were last written on, for senders of device tensors
  /// (send_options::producer_stream, given to the sender's set_next_send).
  std::optional<const void*> producer_stream;
};

/// One worker's part of an update.
struct worker_update {
  /// finish_weight_update's answer ({"stats": {...}}) and its "stats".
  json finish;
  json stats;
  /// From start_weight_update's start to this worker's finish answer.
  double seconds = 0;
};

struct update_result {
  std::int64_t version = 0;
  /// From start_weight_update to the last finish answer (the fingerprint check,
  /// when on, is not included).
  double seconds = 0;
  /// By worker index.
  std::vector<worker_update> workers;
  /// The fingerprint check ran (and passed: a mismatch throws).
  bool verified = false;
};

class worker_group {
 public:
  using name_fn = std::function<std::string(std::size_t)>;

  /// Worker i is `endpoints[i]`. `timeout` bounds every control call and
  /// connection; a non-empty `secret` authenticates them (lib/integrity/auth.h). `name_of(i)`
  /// names worker i in errors; default "worker i (host:port)".
  worker_group(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret,
               std::vector<worker_endpoint> endpoints, name_fn name_of = {});
  ~worker_group();
  worker_group(const worker_group&) = delete;
  worker_group& operator=(const worker_group&) = delete;

  /// Connects to every worker at once (retrying refused connections until the
  /// timeout); again after close() reconnects.
  asio::awaitable<void> connect();

  /// sender.prepare(trainer_args), then every worker's init_weight_transfer_engine
  /// (init_info per options.ranks) alongside sender.connect_workers(). A worker's
  /// refusal shuts the sender down, so its wait for connections ends now rather
  /// than at its deadline. Returns the sender's init_info.
  asio::awaitable<json> init(weight_sender& sender, json trainer_args, init_options options = {});

  /// One update of every worker: start_weight_update; update_weights alongside
  /// trainer_send_weights(sender, meta, tensors); finish_weight_update with
  /// `version`; then, by default, the fingerprint check (update_options::verify).
  /// `tensors` must stay valid until it completes.
  asio::awaitable<update_result> update(weight_sender& sender, update_metadata meta,
                                        std::span<const tensor_view> tensors, std::int64_t version,
                                        update_options options = {});
  /// The same, streaming what `source` yields (e.g. lib/torch's torch_source);
  /// verify needs options.expected (invalid_argument otherwise).
  asio::awaitable<update_result> update(weight_sender& sender, update_metadata meta, tensor_source& source,
                                        std::int64_t version, update_options options = {});

  /// Every worker's differences from `expected`: compare_fingerprints' lines (in
  /// the trainer's order), then "state is ..." unless clean and "version is ..."
  /// unless `version`. Empty for a worker that holds exactly `expected`.
  asio::awaitable<std::vector<std::vector<std::string>>> fingerprint_differences(fingerprint_list expected,
                                                                                 std::int64_t version);
  /// The same with each worker's own expectation (`expected[i]` for worker i): the
  /// workers of a sharded transfer each hold their own slice.
  asio::awaitable<std::vector<std::vector<std::string>>> fingerprint_differences(std::vector<fingerprint_list> expected,
                                                                                 std::int64_t version);
  /// Throws integrity_error naming the first worker (by index) that differs and
  /// its first difference (and how many more it has).
  asio::awaitable<void> verify(fingerprint_list expected, std::int64_t version);

  /// Brings a fleet that a lost trainer left at two versions back to one (a new
  /// trainer calls it before its first update; docs/control-plane.md, "A lost
  /// trainer"). Reads every worker's weight_info. Clean workers all at one version:
  /// nothing to do. Otherwise, when there is a version V such that every clean
  /// worker is at V or holds an undo back to V (it committed a fleet-atomic update
  /// after V), those are rolled back to V. Dirty workers claim no version and are
  /// reported as fenced (only a full update makes them whole). Returns
  /// {"version": V or null, "workers": [{"worker", "weight_version", "state",
  /// "action": "none" | "rolled back" | "fenced", "error"?}]}. Throws
  /// invalid_state when a worker has a session open (a trainer is still updating
  /// it: call again after its session deadline) or no such V exists (naming each
  /// worker's version; a full update brings them together), and the rollback's
  /// error (naming the worker, which is then fenced) when one fails.
  asio::awaitable<json> reconcile();

  /// `method` on every worker at once with params_for(i); the answers by worker.
  asio::awaitable<std::vector<json>> call_each(std::string method, std::function<json(std::size_t)> params_for);
  /// The same `params` for every worker.
  asio::awaitable<std::vector<json>> call_all(std::string method, json params = json::object());

  std::size_t size() const noexcept { return clients_.size(); }
  /// Worker i's own connection, for calls that are not the same on every worker.
  client& at(std::size_t i) { return *clients_.at(i); }
  const worker_endpoint& endpoint(std::size_t i) const { return endpoints_.at(i); }
  /// Worker i's name in errors.
  std::string name(std::size_t i) const;

  /// Closes every connection. Idempotent.
  void close();

 private:
  asio::awaitable<update_result> run_update(weight_sender& sender, update_metadata meta, tensor_source& source,
                                            std::int64_t version, update_options options);
  asio::awaitable<std::vector<json>> call_with(std::string method, std::vector<json> params);
  // `method` on every worker that has not failed yet, its errors kept in `f`.
  asio::awaitable<void> each_kept(std::string method, json params, detail::fleet_state& f);
  asio::awaitable<void> abort_all(detail::fleet_state& f, std::int64_t version, bool fleet_atomic);
  asio::awaitable<void> roll_back_committed(detail::fleet_state& f, std::int64_t version);
  asio::awaitable<void> init_workers(weight_sender& sender, std::vector<json> bodies);

  asio::any_io_executor executor_;
  std::chrono::milliseconds timeout_;
  std::string secret_;
  std::vector<worker_endpoint> endpoints_;
  name_fn name_of_;
  std::vector<std::unique_ptr<client>> clients_;
};

}  // namespace refit::control
