// The faults the fault suite injects in a stream through a proxy: kill_trainer,
// kill_worker, corrupt, stall, impostor, slow, stale_trainer (its verdict:
// suite_stale.cc), chain_kill_middle and chain_corrupt (suite.h).
#include "tests/fault/suite.h"

namespace refit::fault {

void suite::scenario(const std::string& kind, const std::string& commit) {
  ++r_.scenarios;
  const bool chain = kind.rfind("chain_", 0) == 0;
  // The stream the fault is injected in (a chain's only proxied stream is the
  // first hop's), and the worker a kill hits (a chain's: the middle one).
  const int target = chain ? 0 : std::uniform_int_distribution<int>(0, o_.workers - 1)(rng_);
  const int victim = chain ? 1 : target;
  // Up to half of the stream: the rest (over 10 MB) is more than the socket
  // buffers between trainer and proxy hold, so a killed trainer truly cuts it.
  const double fraction = std::uniform_real_distribution<double>(0.05, 0.5)(rng_);
  const std::uint64_t model = 24ull << 20;
  // Over ucx, into the update's part of the side channel (measured: calibrate());
  // a corruption there into one bucket's checksum (see the top of suite.cc).
  const bool corrupts = kind == "corrupt" || kind == "chain_corrupt";
  std::uint64_t at = 300 + static_cast<std::uint64_t>(fraction * model);
  if (!o_.data_proxied()) {
    const auto& [init, update] = side_.at(std::string(chain ? "chain" : "star") + (corrupts ? "+checksums" : ""));
    at = init[target] + static_cast<std::uint64_t>(fraction * update[target]);
    if (corrupts) {
      constexpr std::uint64_t header = 48, done = 24, checksum_at = 16;
      if (update[target] <= header || (update[target] - header) % done != 0)
        throw_error(errc::io_error, "ucx side channel: " + std::to_string(update[target]) +
                                        " bytes per update are not a 48-byte header and 24-byte dones");
      const std::uint64_t buckets = (update[target] - header) / done;
      const auto k = std::uniform_int_distribution<std::uint64_t>(0, buckets - 1)(rng_);
      const auto j = std::uniform_int_distribution<std::uint64_t>(0, 7)(rng_);
      at = init[target] + header + k * done + checksum_at + j;
    }
  }
  const int round = version_ + 1;
  const std::string name = kind + "#" + std::to_string(r_.scenarios) + " (" + commit + ", worker " +
                           std::to_string(target) + ", byte " + std::to_string(at) + ")";
  std::vector<json> before(workers_.size());
  for (std::size_t i = 0; i < workers_.size(); ++i) before[i] = run_sync(call(*workers_[i].client, "weight_info"));

  auto [proxies, advertise] = make_proxies();
  process trainer_proc;
  bool killed_worker = false;
  auto& px = *proxies[target];
  px.at = at;
  if (kind == "kill_trainer") {
    px.act = action::kill_trainer;
    px.kill = [&trainer_proc] { kill(trainer_proc.pid, SIGKILL); };
  } else if (kind == "kill_worker" || kind == "chain_kill_middle") {
    px.act = action::kill_worker;
    pid_t pid = workers_[victim].proc.pid;
    px.kill = [pid, &killed_worker] {
      kill(pid, SIGKILL);
      killed_worker = true;
    };
  } else if (kind == "corrupt" || kind == "chain_corrupt") {
    px.act = action::corrupt;
  } else if (kind == "stall") {
    px.act = action::stall;
    px.stall = std::chrono::milliseconds(o_.timeout_ms * 2);
  } else if (kind == "slow") {
    for (auto& p : proxies) {
      p->act = action::throttle;
      p->throttle_bytes_per_s = 40e6;
    }
  }
  // The stale trainer's calls on worker `target`, mid-stream: each outcome is the
  // error kind it got ("" if it was accepted).
  auto stale = std::make_shared<std::vector<std::pair<std::string, std::string>>>();
  auto stale_done = std::make_shared<bool>(false);
  stale_finished_ = false;
  if (kind == "stale_trainer") {
    px.act = action::hook;
    px.kill = [this, target, stale, stale_done] {
      asio::co_spawn(io_, stale_calls(workers_[target].port, stale, stale_done, true), asio::detached);
    };
    px.hold = [stale_done] { return !*stale_done; };
  }
  for (auto& p : proxies) p->start();

  // fleet_atomic: two-phase (the trainer's --fleet-atomic, staged on every worker).
  const bool atomic = commit == "fleet_atomic";
  std::vector<std::string> extra = {"--first-round",      std::to_string(round),
                                    "--updates",          "1",
                                    "--advertise-port",   advertise,
                                    "--auth-secret-file", kind == "impostor" ? wrong_secret_file_ : secret_file_};
  if (atomic)
    extra.push_back("--fleet-atomic");
  else
    extra.insert(extra.end(), {"--commit", commit});
  extra.insert(extra.end(), {"--topology", chain ? "chain" : "star"});
  if (kind == "corrupt" || kind == "chain_corrupt") extra.push_back("--checksums");
  if (kind == "stale_trainer") {
    extra.push_back("--hold-before-finish-ms");
    extra.push_back(std::to_string(o_.timeout_ms / 2));
  }
  say(name + ": running");
  auto result = run_trainer(extra, &proxies, dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + kind + ".log",
                            &trainer_proc);
  bool hang = !result.exited;
  const std::string trainer_error =
      result.last.is_object() && result.last.contains("error") ? result.last["error"].get<std::string>() : "";

  if (kind == "stale_trainer") {
    stale_verdict(name, px, *stale, result, hang, round);
    return;
  }
  if (kind == "slow") {
    const bool ok = !hang && result.last.is_object() && result.last.value("verified", false);
    if (ok) {
      ++r_.slow_ok;
      version_ = round;
      fingerprints_[round] = fingerprint_of(workers_[0]);
    } else {
      ++r_.slow_failed;
      r_.problems.push_back(name + ": a slow stream within the deadline failed: " +
                            (result.last.is_object() ? result.last.dump() : "no JSON"));
    }
    if (hang) ++r_.hangs;
    say(name + (ok ? ": completed and verified" : ": FAILED"));
    return;
  }
  json& stats = count_injected(kind);

  // Why the trainer's result holds no error: it reported success, or it printed
  // no result at all (it crashed: under a sanitizer, a report ends the process).
  auto no_trainer_error = [&]() -> std::string {
    if (result.last.is_object()) return "the trainer reported success";
    std::string status = !result.exited               ? "it did not exit"
                         : WIFEXITED(result.status)   ? "exit status " + std::to_string(WEXITSTATUS(result.status))
                         : WIFSIGNALED(result.status) ? "killed by signal " + std::to_string(WTERMSIG(result.status))
                                                      : "status " + std::to_string(result.status);
    return "the trainer printed no result (" + status + "; its log is in " + dir_ + ")";
  };
  // What each side reported.
  bool detected = true;
  std::vector<std::string> missed;
  std::vector<std::optional<json>> after(workers_.size());
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    if (static_cast<int>(i) == victim && killed_worker) continue;
    after[i] = settled_info(workers_[i]);
    if (!after[i]) {
      hang = true;
      missed.push_back("worker " + std::to_string(i) + " stayed busy or stopped answering");
    }
  }
  auto worker_error = [&](std::size_t i) -> std::string {
    if (!after[i]) return {};
    const json& e = (*after[i])["last_error"];
    // A new error since the scenario began.
    if (!e.is_string() || e == before[i]["last_error"]) return {};
    return e.get<std::string>();
  };
  const std::string rank = "rank " + std::to_string(victim + 1);
  if (kind == "kill_trainer") {
    if (!px.fired) missed.push_back("the kill point was never reached");
    // The cut stream must fail; another worker may have received all of its
    // stream before the kill (then its session waits for a finish that never
    // comes: "updating"; or, once the trainer's control connection closed, it
    // was aborted: "dirty", the new weights claimed by no version).
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      const bool aborted = after[i] && before[i]["state"] == "clean" && (*after[i])["state"] == "dirty" &&
                           (*after[i])["dirty_reason"].is_string() &&
                           (*after[i])["dirty_reason"].get<std::string>().find("aborted") != std::string::npos;
      const bool completed = after[i] && ((*after[i])["session_active"] == true || aborted);
      if (worker_error(i).empty() && (static_cast<int>(i) == target || !completed))
        missed.push_back("worker " + std::to_string(i) + " reported no error (" +
                         (after[i] ? after[i]->dump() : std::string("no answer")) + ")");
    }
  } else if (kind == "kill_worker") {
    if (!killed_worker) missed.push_back("the kill point was never reached");
    if (trainer_error.find(rank) == std::string::npos)
      missed.push_back("the trainer did not name the lost " + rank + ": '" + trainer_error + "'");
  } else if (kind == "corrupt") {
    const std::string e = worker_error(target);
    if (e.find("integrity_error") == std::string::npos && e.find("protocol_error") == std::string::npos)
      missed.push_back("worker " + std::to_string(target) + " did not report the corruption: '" + e + "'");
    if (trainer_error.empty()) missed.push_back(no_trainer_error());
  } else if (kind == "chain_kill_middle") {
    if (!killed_worker) missed.push_back("the kill point was never reached");
    if (trainer_error.find(rank) == std::string::npos)
      missed.push_back("the trainer did not name the lost " + rank + ": '" + trainer_error + "'");
    // Every successor fails at once: upstream lost, not a deadline.
    for (std::size_t i = static_cast<std::size_t>(victim) + 1; i < workers_.size(); ++i) {
      const std::string e = worker_error(i);
      if (e.find("peer_lost") == std::string::npos)
        missed.push_back("worker " + std::to_string(i) +
                         " (after the lost one) did not fail at once with peer_lost: '" + e + "'");
      else if (e.find(rank) == std::string::npos && i == static_cast<std::size_t>(victim) + 1)
        missed.push_back("worker " + std::to_string(i) + " did not name the lost " + rank + ": '" + e + "'");
    }
  } else if (kind == "chain_corrupt") {
    const std::string e = worker_error(0);
    if (e.find("integrity_error") == std::string::npos && e.find("protocol_error") == std::string::npos)
      missed.push_back("worker 0 did not report the corruption: '" + e + "'");
    for (std::size_t i = 1; i < workers_.size(); ++i)
      if (worker_error(i).empty())
        missed.push_back("worker " + std::to_string(i) + " (sent the corrupted byte) reported no error");
    if (trainer_error.empty()) missed.push_back(no_trainer_error());
  } else if (kind == "stall") {
    const std::string e = worker_error(target);
    if (e.find("timeout") == std::string::npos)
      missed.push_back("worker " + std::to_string(target) + " did not time out: '" + e + "'");
    if (trainer_error.empty()) missed.push_back(no_trainer_error());
  } else if (kind == "impostor") {
    if (trainer_error.find("auth_error") == std::string::npos)
      missed.push_back("the impostor trainer was not refused: '" + trainer_error + "'");
    // It gives up at the first worker that refuses it.
    bool recorded = false;
    for (std::size_t i = 0; i < workers_.size(); ++i)
      recorded |= after[i] && (*after[i])["last_refused_connection"].is_string() &&
                  (*after[i])["last_refused_connection"] != before[i]["last_refused_connection"];
    if (!recorded) missed.push_back("no worker recorded the refused connection");
  }
  if (result.exited && WIFEXITED(result.status) && WEXITSTATUS(result.status) == 0)
    missed.push_back("the trainer exited with success");
  detected = missed.empty();
  if (hang) ++r_.hangs;

  // Nothing lost: a worker that says clean holds its version's weights; where the
  // update failed, staged left the old weights intact and clean, and in_place
  // either did too or says dirty. (Where it completed but the trainer died before
  // finishing, the worker says "updating": new weights, not yet claimed.) A
  // fleet-atomic update that failed anywhere left every worker at the old version.
  const bool failed_somewhere = !(result.exited && WIFEXITED(result.status) && WEXITSTATUS(result.status) == 0);
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    if (!after[i]) continue;
    // Exactly at the old version or the new one (not the new one where its
    // staged update failed), or, in_place only, dirty: claiming no version.
    const bool failed_here = !worker_error(i).empty();
    const bool staged_failure = (failed_here && commit == "staged") || (atomic && failed_somewhere);
    std::string lost = not_at_a_version(
        i, *after[i], version_, staged_failure ? std::nullopt : std::optional<int>(round), atomic ? "staged" : commit);
    if (atomic && failed_somewhere && !lost.empty()) lost = "a failed fleet-atomic update changed it: " + lost;
    if (staged_failure && !lost.empty()) lost = "a failed staged update changed the weights: " + lost;
    if (!lost.empty()) {
      ++r_.lost;
      r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + lost);
    }
  }
  count_verdict(stats, name, missed);
  say(name + ": " + (detected ? "detected" : "MISSED: " + missed.front()) +
      (trainer_error.empty() ? "" : "; trainer: " + trainer_error.substr(0, 160)));

  // Recovery: restart a killed worker, then a full update everyone verifies.
  if (killed_worker) {
    wait_exit(workers_[victim].proc.pid, 5s);
    close(workers_[victim].proc.out);
    workers_[victim].client->close();
    workers_[victim] = start_worker(victim);
  }
  if (recover(name))
    ++r_.recoveries;
  else
    ++r_.recoveries_failed;
}

}  // namespace refit::fault
