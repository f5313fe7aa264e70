// frozen_trainer and staged_kill_after_chunk: the trainer stops or dies between
// its chunk and its finish (suite.h).
#include "tests/fault/suite.h"

namespace refit::fault {

// frozen_trainer / staged_kill_after_chunk: the trainer stops (SIGSTOP) or dies
// (SIGKILL) once every worker has its chunk, before its finish.
void suite::session_scenario(const std::string& kind, const std::string& commit) {
  ++r_.scenarios;
  json& stats = count_injected(kind);
  const bool frozen = kind == "frozen_trainer";
  const int old_version = version_;
  // The frozen trainer's round is one no other trainer uses: if its late finish
  // were taken, the workers would say that version.
  const int round = frozen ? version_ + 1000 : version_ + 1;
  const std::string name = kind + "#" + std::to_string(r_.scenarios) + " (" + commit + ")";
  std::vector<std::string> missed;
  bool hang = false;
  say(name + ": running");
  // It holds between its chunk and its finish longer than the session timeout
  // (the workers' --timeout-ms); frozen, it resumes after the hold, so its
  // finish comes at once.
  running_trainer t =
      start_trainer({"--first-round", std::to_string(round), "--updates", "1", "--commit", commit, "--auth-secret-file",
                     secret_file_, "--hold-before-finish-ms", std::to_string(o_.timeout_ms * 3)},
                    dir_ + "/trainer-" + std::to_string(r_.scenarios) + "-" + kind + ".log");
  if (!every_chunk_received(std::chrono::milliseconds(o_.timeout_ms * 6) + 20s)) {
    missed.push_back("the workers never all held their chunk");
  }
  const auto stopped_at = clock_type::now();
  kill(t.proc.pid, frozen ? SIGSTOP : SIGKILL);
  // Every session ends (owner silent for the session timeout, or its connection
  // closed) and leaves the old weights: clean at the old version when staged.
  std::vector<std::optional<json>> after(workers_.size());
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    after[i] = settled_info(workers_[i]);
    if (!after[i]) {
      hang = true;
      missed.push_back("worker " + std::to_string(i) + " kept the session of a " + (frozen ? "frozen" : "dead") +
                       " trainer, or stopped answering");
      continue;
    }
    const std::string e = (*after[i])["last_error"].is_string() ? (*after[i])["last_error"].get<std::string>() : "";
    const char* says = frozen ? "sent nothing for" : "closed its connection";
    if (e.find(says) == std::string::npos)
      missed.push_back("worker " + std::to_string(i) + " did not say its session was aborted (" + says + "): '" + e +
                       "'");
    if (std::string why = not_at_a_version(i, *after[i], old_version, std::nullopt, commit); !why.empty()) {
      ++r_.lost;
      r_.problems.push_back(name + ": worker " + std::to_string(i) + " " + why);
    }
  }
  const double aborted_after = std::chrono::duration<double>(clock_type::now() - stopped_at).count();
  if (frozen) {
    // A replacement trainer takes over; then the frozen one resumes, and its
    // finish must be refused and change nothing.
    const bool recovered = recover(name);
    if (recovered)
      ++r_.recoveries;
    else
      ++r_.recoveries_failed;
    kill(t.proc.pid, SIGCONT);
    trainer_result late = wait_trainer(t, std::chrono::milliseconds(o_.timeout_ms * 6) + 20s);
    if (!late.exited) {
      hang = true;
      missed.push_back("the resumed trainer did not exit");
    } else if (WIFEXITED(late.status) && WEXITSTATUS(late.status) == 0) {
      missed.push_back("the resumed trainer's update succeeded");
    } else {
      const std::string e = late.last.is_object() && late.last.contains("error") ? late.last["error"].dump() : "";
      if (e.find("was aborted") == std::string::npos)
        missed.push_back("the resumed trainer was not told its session was aborted: " + e);
    }
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      auto info = settled_info(workers_[i]);
      if (!info) {
        hang = true;
        continue;
      }
      if (std::string why = not_at_a_version(i, *info, version_, std::nullopt, commit); !why.empty()) {
        ++r_.lost;
        r_.problems.push_back(name + ": after the frozen trainer resumed, worker " + std::to_string(i) + " " + why);
      }
    }
  } else {
    wait_trainer(t, 5s);
    if (recover(name))
      ++r_.recoveries;
    else
      ++r_.recoveries_failed;
  }
  if (hang) ++r_.hangs;
  count_verdict(stats, name, missed);
  char took[64];
  std::snprintf(took, sizeof took, "%.2f s", aborted_after);
  say(name + ": " +
      (missed.empty() ? std::string("every session aborted within ") + took +
                            (commit == "staged" ? ", the old weights clean at the old version"
                                                : ", the weights dirty (in_place)") +
                            (frozen ? "; the resumed trainer was refused" : "")
                      : "MISSED: " + missed.front()));
}

}  // namespace refit::fault
