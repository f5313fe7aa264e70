// delta_wrong_base: a worker's model reloaded between two delta updates (suite.h).
#include "tests/fault/suite.h"

namespace refit::fault {

// delta_wrong_base: a delta trainer's two updates, worker `target`'s model
// reloaded between them (the proxy holds the first byte of the second update
// while the suite calls load_model on it).
void suite::delta_scenario(const std::string& kind) {
  ++r_.scenarios;
  json& stats = count_injected(kind);
  const int target = std::uniform_int_distribution<int>(0, o_.workers - 1)(rng_);
  const std::string name =
      kind + "#" + std::to_string(r_.scenarios) + " (in_place, worker " + std::to_string(target) + ")";
  say(name + ": running");
  const std::vector<std::string> delta = {
      "--delta",  "--change-fraction", "0.01",        "--topology",         "star",
      "--commit", "in_place",          "--checksums", "--auth-secret-file", secret_file_};
  const auto run = [&](int round, int updates, const std::string& tag, proxy_set& set) {
    std::vector<std::string> args = {"--first-round",         std::to_string(round), "--updates",
                                     std::to_string(updates), "--advertise-port",    set.advertise};
    args.insert(args.end(), delta.begin(), delta.end());
    for (auto& p : set.proxies) p->start();
    return run_trainer(args, &set.proxies, dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + tag + ".log");
  };
  std::vector<std::string> missed;
  // Where the second update starts on the target's stream: the bytes a one-update
  // trainer with deltas on sends it (init and a full update).
  std::uint64_t first_update_bytes = 0;
  {
    auto set = make_proxies();
    const int round = version_ + 1;
    auto r = run(round, 1, kind + "-measure", set);
    if (!(r.exited && r.last.is_object() && r.last.value("verified", false)))
      throw_error(errc::io_error,
                  "the measuring delta trainer failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
    version_ = round;
    fingerprints_[round] = fingerprint_of(workers_[0]);
    first_update_bytes = set.proxies[target]->downstream_bytes;
  }
  auto set = make_proxies();
  auto& px = *set.proxies[target];
  px.act = action::hook;
  px.at = first_update_bytes;
  auto reloaded = std::make_shared<std::optional<std::string>>();  // "" once done, else the error
  px.kill = [this, target, reloaded] {
    asio::co_spawn(io_, reload_model(workers_[target].port, reloaded), asio::detached);
  };
  px.hold = [reloaded] { return !reloaded->has_value(); };
  const int round = version_ + 1;
  auto result = run(round, 2, kind, set);
  const bool hang = !result.exited;
  if (!px.fired) missed.push_back("the second update never reached worker " + std::to_string(target));
  if (!reloaded->has_value() || !(*reloaded)->empty())
    missed.push_back("the reload did not complete: " + reloaded->value_or("no answer"));
  const bool verified = !hang && result.last.is_object() && result.last.value("verified", false);
  if (!verified)
    missed.push_back("the delta trainer did not verify both updates: " +
                     (result.last.is_object() ? result.last.dump() : "no JSON"));
  const json d = result.last.is_object() ? result.last.value("delta", json()) : json();
  if (verified && !(d.is_object() && d.value("full_fallbacks", -1) == 1 && d.value("encoded_buckets", 0) > 0))
    missed.push_back("expected one full fallback and delta buckets for the others: " + d.dump());
  if (verified) {
    version_ = round + 1;
    fingerprints_[version_] = fingerprint_of(workers_[0]);
  }
  if (hang) ++r_.hangs;
  // Every worker clean at the new version, holding exactly its weights (where
  // the trainer failed, that is missed above and the recovery decides).
  for (std::size_t i = 0; verified && i < workers_.size(); ++i) {
    auto info = settled_info(workers_[i]);
    if (!info) {
      missed.push_back("worker " + std::to_string(i) + " stayed busy or stopped answering");
      continue;
    }
    // (As after a staged commit: no worker may say dirty.)
    const std::string lost = not_at_a_version(i, *info, version_, std::nullopt, "staged");
    if (!lost.empty()) {
      ++r_.lost;
      r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + lost);
    }
  }
  count_verdict(stats, name, missed);
  say(name + ": " +
      (missed.empty() ? "the reloaded worker refused the base and got the update full; every worker exact at version " +
                            std::to_string(version_)
                      : "MISSED: " + missed.front()));
  if (!verified) {
    if (recover(name))
      ++r_.recoveries;
    else
      ++r_.recoveries_failed;
  }
}

// load_model on the worker at `port`: the trainer's layout, tensors zeroed (a
// reloaded model). `out`: "" once it answered, else what went wrong.
asio::awaitable<void> suite::reload_model(std::uint16_t port, std::shared_ptr<std::optional<std::string>> out) {
  control::client c(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
  try {
    json layout = json::object();
    write_update_metadata(
        example::make_layout(example::parse_bytes(o_.model_bytes, "--model-bytes"), model_layers, model_vocab).meta,
        layout);
    co_await c.connect("127.0.0.1", port);
    co_await c.call("load_model", layout);
    *out = "";
  } catch (const std::exception& e) {
    *out = e.what();
  }
  c.close();
}

}  // namespace refit::fault
