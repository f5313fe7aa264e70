#include <refit/control/worker_group.h>

#include <refit/backend/async/all_of.h>

#include <exception>
#include <utility>

#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/control/fleet.h>
#include <refit/error.h>

namespace refit::control {

asio::awaitable<void> both_void(asio::awaitable<void> a, asio::awaitable<void> b) {
  std::vector<asio::awaitable<void>> ops;
  ops.push_back(std::move(a));
  ops.push_back(std::move(b));
  co_await async::all_of(std::move(ops));
}

namespace {

using clock_type = std::chrono::steady_clock;

// Rethrows `failure`, a refit::error with `name` in front of its message.
[[noreturn]] void rethrow_named(std::exception_ptr failure, const std::string& name) {
  try {
    std::rethrow_exception(failure);
  } catch (const error& e) {
    throw error(e.code(), name + ": " + e.message());
  }
}

// One call whose error names the worker.
asio::awaitable<void> call_one(client& c, std::string name, std::string method, json params, json* out) {
  std::exception_ptr failure;
  try {
    *out = co_await c.call(std::move(method), std::move(params));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) rethrow_named(failure, name);
}

asio::awaitable<void> connect_one(client& c, std::string name, worker_endpoint at) {
  std::exception_ptr failure;
  try {
    co_await c.connect(std::move(at.host), at.port);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) rethrow_named(failure, name);
}

}  // namespace

worker_group::worker_group(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret,
                           std::vector<worker_endpoint> endpoints, name_fn name_of)
    : executor_(std::move(executor)), timeout_(timeout), secret_(std::move(secret)), endpoints_(std::move(endpoints)),
      name_of_(std::move(name_of)) {
  for (std::size_t i = 0; i < endpoints_.size(); ++i)
    clients_.push_back(std::make_unique<client>(executor_, timeout_, secret_));
}

worker_group::~worker_group() { close(); }

std::string worker_group::name(std::size_t i) const {
  if (name_of_) return name_of_(i);
  const auto& e = endpoints_.at(i);
  return "worker " + std::to_string(i) + " (" + e.host + ":" + std::to_string(e.port) + ")";
}

asio::awaitable<void> worker_group::connect() {
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i) ops.push_back(connect_one(*clients_[i], name(i), endpoints_[i]));
  co_await async::all_of(std::move(ops));
}

asio::awaitable<std::vector<json>> worker_group::call_with(std::string method, std::vector<json> params) {
  std::vector<json> results(clients_.size());
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i)
    ops.push_back(call_one(*clients_[i], name(i), method, std::move(params[i]), &results[i]));
  co_await async::all_of(std::move(ops));
  co_return results;
}

asio::awaitable<std::vector<json>> worker_group::call_each(std::string method,
                                                           std::function<json(std::size_t)> params_for) {
  std::vector<json> params;
  for (std::size_t i = 0; i < clients_.size(); ++i) params.push_back(params_for(i));
  co_return co_await call_with(std::move(method), std::move(params));
}

asio::awaitable<std::vector<json>> worker_group::call_all(std::string method, json params) {
  std::vector<json> each(clients_.size(), params);
  co_return co_await call_with(std::move(method), std::move(each));
}

// Every worker's init; a refusal shuts the sender down so that its wait for the
// workers' connections ends at once (the refusal is the first error, and wins).
asio::awaitable<void> worker_group::init_workers(weight_sender& sender, std::vector<json> bodies) {
  std::exception_ptr failure;
  try {
    co_await call_with("init_weight_transfer_engine", std::move(bodies));
  } catch (...) {
    failure = std::current_exception();
  }
  if (!failure) co_return;
  sender.shutdown();
  std::rethrow_exception(failure);
}

asio::awaitable<json> worker_group::init(weight_sender& sender, json trainer_args, init_options options) {
  const json init_info = sender.prepare(trainer_args);
  std::vector<json> bodies;
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    json info = init_info;
    if (options.ranks == rank_layout::per_worker && info.contains("rank_offset") &&
        info["rank_offset"].is_number_integer())
      info["rank_offset"] = info["rank_offset"].get<std::int64_t>() + static_cast<std::int64_t>(i);
    if (options.adjust) options.adjust(i, info);
    json body = json::object();
    body["init_info"] = std::move(info);
    bodies.push_back(std::move(body));
  }
  co_await both(sender.connect_workers(), init_workers(sender, std::move(bodies)));
  co_return init_info;
}

asio::awaitable<update_result> worker_group::update(weight_sender& sender, update_metadata meta,
                                                    std::span<const tensor_view> tensors, std::int64_t version,
                                                    update_options options) {
  if (options.verify && !options.expected) options.expected = fingerprint_all(tensors);
  range_source<std::span<const tensor_view>> source(tensors);
  co_return co_await run_update(sender, std::move(meta), source, version, std::move(options));
}

asio::awaitable<update_result> worker_group::update(weight_sender& sender, update_metadata meta, tensor_source& source,
                                                    std::int64_t version, update_options options) {
  if (options.verify && !options.expected)
    throw_error(errc::invalid_argument,
                "worker_group::update: verify needs the trainer's fingerprints (update_options::expected) when "
                "the tensors come from a tensor_source");
  co_return co_await run_update(sender, std::move(meta), source, version, std::move(options));
}

namespace {}  // namespace

// Where an update stands on each worker, and its failures: each worker's (and
// the send's) first error, kept rather than thrown, and the first of all in time
// (the one an update that is not fleet-atomic throws, named).
struct detail::fleet_state {
  explicit fleet_state(std::size_t n) : phase(n), errors(n), answers(n) {}
  std::vector<std::string> phase;          // the verb each worker is at (or failed in)
  std::vector<std::exception_ptr> errors;  // as the worker said it (fleet errors name it themselves)
  std::vector<json> answers;
  std::exception_ptr send_error;
  std::exception_ptr first;  // named
  bool failed() const noexcept { return first != nullptr; }
};

namespace {

using detail::fleet_state;

// Keeps `e` as worker `w`'s error (or the send's, w = npos), named.
void keep(fleet_state& f, std::size_t w, const std::string& name, std::exception_ptr e) {
  std::exception_ptr named = e;
  if (!name.empty()) {
    try {
      rethrow_named(e, name);
    } catch (const error&) {
      named = std::current_exception();
    } catch (...) {
    }
  }
  if (w == static_cast<std::size_t>(-1))
    f.send_error = e;
  else if (!f.errors[w])
    f.errors[w] = e;
  if (!f.first) f.first = named;
}

asio::awaitable<void> call_kept(client& c, std::string name, std::string method, json params, fleet_state* f,
                                std::size_t w) {
  f->phase[w] = method;
  try {
    f->answers[w] = co_await c.call(std::move(method), std::move(params));
  } catch (...) {
    keep(*f, w, name, std::current_exception());
  }
}

asio::awaitable<void> send_kept(weight_sender& sender, const update_metadata& meta, tensor_source& source,
                                fleet_state* f) {
  try {
    co_await sender.send_weights(meta, source);
  } catch (...) {
    keep(*f, static_cast<std::size_t>(-1), "", std::current_exception());
  }
}

// One call whose error is kept in *error, not thrown (its answer is not needed).
asio::awaitable<void> call_keeping(client& c, std::string method, json params, std::exception_ptr* error) {
  try {
    co_await c.call(std::move(method), std::move(params));
  } catch (...) {
    *error = std::current_exception();
  }
}

// finish_weight_update on one worker, timed from `t0`; its error kept.
asio::awaitable<void> finish_one(client& c, std::string name, json params, worker_update* out,
                                 clock_type::time_point t0, fleet_state* f, std::size_t w) {
  f->phase[w] = "finish_weight_update";
  try {
    out->finish = co_await c.call("finish_weight_update", std::move(params));
  } catch (...) {
    keep(*f, w, name, std::current_exception());
    co_return;
  }
  out->seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  if (out->finish.is_object() && out->finish.contains("stats")) out->stats = out->finish["stats"];
}

}  // namespace

asio::awaitable<void> worker_group::each_kept(std::string method, json params, detail::fleet_state& f) {
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i)
    if (!f.errors[i]) ops.push_back(call_kept(*clients_[i], name(i), method, params, &f, i));
  co_await async::all_of(std::move(ops));
}

asio::awaitable<update_result> worker_group::run_update(weight_sender& sender, update_metadata meta,
                                                        tensor_source& source, std::int64_t version,
                                                        update_options options) {
  if (options.fleet_atomic) {
    if (options.commit == commit_mode::in_place)
      throw_error(errc::invalid_argument,
                  "worker_group::update: a fleet-atomic update is staged (every worker votes before any commits); "
                  "commit in_place cannot be fleet-atomic");
    options.commit = commit_mode::staged;
  }
  // Bodies built before any co_await (GCC 12 and braced lists across suspension).
  json update_info = options.update_info.is_object() ? options.update_info : json::object();
  write_update_metadata(meta, update_info);
  if (options.commit) update_info["commit"] = to_string(*options.commit);
  json update_body = json::object();
  update_body["update_info"] = std::move(update_info);
  json finish_body = json::object();
  finish_body["weight_version"] = version;

  update_result result;
  result.version = version;
  result.workers.resize(clients_.size());
  // Before any worker is told (a sender that cannot do it refuses here).
  if (options.delta || options.producer_stream)
    sender.set_next_send({.delta = options.delta, .producer_stream = options.producer_stream});
  const auto t0 = clock_type::now();
  fleet_state f(clients_.size());
  json start_body = json::object();
  if (options.fleet_atomic) start_body["fleet_atomic"] = true;
  co_await each_kept("start_weight_update", std::move(start_body), f);
  if (!f.failed()) {
    std::vector<asio::awaitable<void>> ops;
    ops.push_back(each_kept("update_weights", std::move(update_body), f));
    ops.push_back(send_kept(sender, meta, source, &f));
    co_await async::all_of(std::move(ops));
  }
  if (!f.failed() && options.hold_before_finish.count() > 0) {
    asio::steady_timer hold(executor_, options.hold_before_finish);
    co_await hold.async_wait(asio::use_awaitable);
  }
  if (!f.failed() && options.fleet_atomic) co_await each_kept("prepare_weight_update", json::object(), f);
  if (f.failed()) co_await abort_all(f, version, options.fleet_atomic);

  std::vector<asio::awaitable<void>> finishes;
  for (std::size_t i = 0; i < clients_.size(); ++i)
    finishes.push_back(finish_one(*clients_[i], name(i), finish_body, &result.workers[i], t0, &f, i));
  co_await async::all_of(std::move(finishes));
  if (f.failed()) {
    if (!options.fleet_atomic) std::rethrow_exception(f.first);
    co_await roll_back_committed(f, version);
  }
  result.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();

  if (options.verify) {
    co_await verify(std::move(*options.expected), version);
    result.verified = true;
  }
  co_return result;
}

// After a failure before any commit: every worker's session is aborted (a worker
// whose session already ended answers that it had none), then the failure is
// thrown. Fleet-atomic: one error naming every worker's phase; otherwise the first
// error, as it came.
asio::awaitable<void> worker_group::abort_all(detail::fleet_state& f, std::int64_t version, bool fleet_atomic) {
  const std::string why = "update " + std::to_string(version) + " failed: " + describe_error(f.first);
  // What ended the update, as a field: each worker's on_update_failed gets it.
  json params{{"why", why}};
  if (const errc kind = error_kind_of(f.first); kind != errc{}) params["kind"] = std::string(errc_name(kind));
  std::vector<std::exception_ptr> abort_errors(clients_.size());
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i)
    ops.push_back(call_keeping(*clients_[i], "abort_weight_update", params, &abort_errors[i]));
  co_await async::all_of(std::move(ops));
  if (!fleet_atomic) std::rethrow_exception(f.first);
  std::string message = "fleet-atomic update " + std::to_string(version) +
                        ": no worker committed; every worker keeps its previous version:";
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    message += "\n  " + name(i) + ": ";
    if (f.errors[i])
      message += "failed in " + f.phase[i] + ": " + describe_error(f.errors[i]);
    else
      message += "aborted after " + f.phase[i];
    if (abort_errors[i]) message += " (its abort failed: " + describe_error(abort_errors[i]) + ")";
  }
  if (f.send_error) message += "\n  the trainer's send: " + describe_error(f.send_error);
  throw_error(error_kind_of(f.first), message);
}

// A fleet-atomic update that failed at a commit, after every vote: every worker
// that committed is rolled back (a worker whose own commit failed loaded its
// previous version back itself), then the failure is thrown naming each worker's
// outcome. A worker whose rollback fails is fenced: dirty, claiming no version.
asio::awaitable<void> worker_group::roll_back_committed(detail::fleet_state& f, std::int64_t version) {
  std::vector<std::exception_ptr> rollback_errors(clients_.size());
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    if (!f.errors[i])
      ops.push_back(call_keeping(*clients_[i], "rollback_weight_update", json::object(), &rollback_errors[i]));
  }
  co_await async::all_of(std::move(ops));
  std::vector<call_outcome> commits, rollbacks;
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    commits.push_back(outcome_of(f.errors[i]));
    rollbacks.push_back(outcome_of(rollback_errors[i]));
  }
  const settlement settled = settle_failed_commit(commits, rollbacks);
  std::string lines;
  errc kind{};  // the first failed commit's, by worker
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    lines += "\n  " + name(i) + ": ";
    switch (settled.phases[i]) {
      case settled_phase::in_doubt:
        lines += f.errors[i]
                     ? "its commit's outcome is unknown (in doubt): " + describe_error(f.errors[i])
                     : "committed; its rollback's outcome is unknown (in doubt): " + describe_error(rollback_errors[i]);
        break;
      case settled_phase::failed:
        lines += "failed at its commit: " + describe_error(f.errors[i]);
        break;
      case settled_phase::fenced:
        lines +=
            "committed, and its rollback failed (fenced: dirty, no version): " + describe_error(rollback_errors[i]);
        break;
      case settled_phase::rolled_back:
        lines += "committed, rolled back";
        break;
    }
    if (f.errors[i] && kind == errc{}) kind = error_kind_of(f.errors[i]);
  }
  const std::string& outcome = settled.summary;
  throw_error(kind, "fleet-atomic update " + std::to_string(version) + ": a commit failed after every worker voted; " +
                        outcome + lines);
}

asio::awaitable<json> worker_group::reconcile() {
  const std::vector<json> infos = co_await call_all("weight_info");
  const std::size_t n = infos.size();
  std::vector<fleet_member> members(n);
  for (std::size_t i = 0; i < n; ++i) {
    const json& info = infos[i];
    fleet_member& m = members[i];
    m.name = name(i);
    m.session_open = info.value("session_active", false);
    if (m.session_open) m.name += " (session owner " + info.value("session_owner", json("?")).dump() + ")";
    m.clean = info.value("state", std::string()) == "clean";
    m.version = info.contains("weight_version") && info["weight_version"].is_number_integer() ? info["weight_version"]
                                                                                              : json(nullptr);
    m.holds_undo =
        info.value("holds_undo", false) && info.contains("undo_version") && info["undo_version"].is_number_integer();
    if (m.holds_undo) m.undo_version = info["undo_version"];
  }
  const reconcile_plan plan = plan_reconcile(members);
  json workers = json::array();
  std::vector<std::exception_ptr> errors(n);
  std::vector<asio::awaitable<void>> ops;
  for (std::size_t i = 0; i < n; ++i) {
    json w = json::object();
    w["worker"] = name(i);
    w["weight_version"] = infos[i].contains("weight_version") ? infos[i]["weight_version"] : json(nullptr);
    w["state"] = infos[i].value("state", std::string());
    switch (plan.actions[i]) {
      case reconcile_action::none:
        w["action"] = "none";
        break;
      case reconcile_action::fence:
        w["action"] = "fenced";
        break;  // dirty already: it claims no version
      case reconcile_action::roll_back:
        w["action"] = "rolled back";
        ops.push_back(call_keeping(*clients_[i], "rollback_weight_update", json::object(), &errors[i]));
        break;
    }
    workers.push_back(std::move(w));
  }
  co_await async::all_of(std::move(ops));
  for (std::size_t i = 0; i < n; ++i)
    if (errors[i]) rethrow_named(errors[i], name(i));
  json out = json::object();
  out["version"] = plan.version;
  out["workers"] = std::move(workers);
  co_return out;
}

asio::awaitable<std::vector<std::vector<std::string>>> worker_group::fingerprint_differences(fingerprint_list expected,
                                                                                             std::int64_t version) {
  std::vector<fingerprint_list> each(clients_.size(), expected);
  co_return co_await fingerprint_differences(std::move(each), version);
}

asio::awaitable<std::vector<std::vector<std::string>>> worker_group::fingerprint_differences(
    std::vector<fingerprint_list> expected, std::int64_t version) {
  if (expected.size() != clients_.size())
    throw_error(errc::invalid_argument, "worker_group::fingerprint_differences: " + std::to_string(expected.size()) +
                                            " expectations for " + std::to_string(clients_.size()) + " workers");
  const auto answers = co_await call_all("weight_fingerprint");
  std::vector<std::vector<std::string>> out(answers.size());
  for (std::size_t w = 0; w < answers.size(); ++w) {
    const json& a = answers[w];
    fingerprint_list got;
    try {
      if (!a.is_object() || !a.contains("algorithm") || !a.contains("tensors"))
        throw_error(errc::protocol_error, "weight_fingerprint answer without algorithm and tensors: " + a.dump());
      json list = json::object();
      list["algorithm"] = a["algorithm"];
      list["tensors"] = a["tensors"];
      got = fingerprints_from_json(list);
    } catch (const error& e) {
      throw error(e.code(), name(w) + ": " + e.message());
    }
    out[w] = compare_fingerprints(expected[w], got);
    const json state = a.contains("state") ? a["state"] : json(nullptr);
    const json got_version = a.contains("weight_version") ? a["weight_version"] : json(nullptr);
    if (state != "clean") out[w].push_back("state is " + state.dump());
    if (got_version != version) out[w].push_back("version is " + got_version.dump());
  }
  co_return out;
}

asio::awaitable<void> worker_group::verify(fingerprint_list expected, std::int64_t version) {
  const auto diffs = co_await fingerprint_differences(std::move(expected), version);
  for (std::size_t w = 0; w < diffs.size(); ++w) {
    if (diffs[w].empty()) continue;
    std::string message =
        name(w) + ": weight fingerprints after update " + std::to_string(version) + ": " + diffs[w][0];
    if (diffs[w].size() > 1) message += " (and " + std::to_string(diffs[w].size() - 1) + " more differences)";
    throw_error(errc::integrity_error, message);
  }
}

void worker_group::close() {
  for (auto& c : clients_) c->close();
}

}  // namespace refit::control
