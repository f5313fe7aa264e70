// The fault-injection suite: real worker and trainer processes (the main job's
// binary, examples/weight_sync) with faults injected at random points of the
// weight stream, through one data proxy per worker:
//
//   kill_trainer  SIGKILL the trainer when worker k's stream reaches a random bucket
//   kill_worker   SIGKILL worker k there (it is restarted for the recovery)
//   corrupt       flip one byte of worker k's stream there (checksums on)
//   stall         stop forwarding worker k's stream there for twice the deadline
//   impostor      a trainer with the wrong shared secret tries to drive the workers
//   stale_trainer a second control client with the right secret (a stale trainer, a
//                 fail-over gone wrong) calls finish, init, update and start on
//                 worker k when its stream reaches a random bucket, and again
//                 between the live update's last chunk and its finish (the trainer
//                 holds there): each must be refused, and the live update must
//                 complete and verify
//   frozen_trainer  SIGSTOP the trainer once every worker holds its chunk, before
//                 its finish (it holds there): every worker must abort the session
//                 within its session timeout ("sent nothing for"), keeping the old
//                 weights; a replacement trainer then updates everyone; the frozen
//                 trainer, resumed (SIGCONT), must fail, told its session was
//                 aborted, and change nothing (its round is one no other trainer
//                 uses, so a finish taken late would show)
//   staged_kill_after_chunk  (always staged) SIGKILL the trainer at the same point:
//                 every worker must end the session ("closed its connection") and
//                 stay clean at the old version, with the old weights
//   slow          (not a fault) throttle every stream, within the deadline: must succeed
//   chain_kill_middle  (3+ workers, relay chain trainer -> 0 -> 1 -> 2 ...) SIGKILL
//                 worker 1 when worker 0's stream reaches a random bucket: its
//                 successor fails at once (peer_lost, before any deadline) naming
//                 the lost rank, and so does the trainer
//   delta_wrong_base  (tcp) a trainer with deltas on (--delta) sends two updates;
//                 between them one worker's model is reloaded (load_model: its
//                 tensors zeroed) behind refit's back, so the second update's base
//                 is not what it holds: it must refuse the base and be sent the
//                 update full (one full fallback), the others take the delta, and
//                 every worker ends exactly at the new version
//   chain_corrupt (3+ workers, chain, checksums) flip one byte of the first hop:
//                 worker 0 reports the corruption, every worker after it fails too
//                 (the byte was forwarded), none claims the update
//   fleet_kill_worker, fleet_kill_trainer, fleet_corrupt, fleet_stall  the
//                 same faults of a fleet-atomic update (--fleet-atomic): every
//                 worker that lives ends at the old version, with the old weights
// The other kinds run as a star (--topology star); every recovery update uses the
// engine's default topology (a chain from 3 workers on).
//
// --engine ucx runs the same processes over the ucx engine. Its bytes do not cross
// the proxies (UCX moves them: shared memory here); its side channel does (the
// update header, a grant and a "done" per bucket), so the proxies still kill,
// stall and hold at a point inside the update: the suite first measures, with two
// clean updates, how many side-channel bytes each worker gets at init and per
// update, and aims into the update's part. corrupt and chain_corrupt flip a byte of
// one bucket's checksum as its "done" crosses the proxy (the bucket's bytes do not:
// with checksums on, the worker must find them not to match, as it would a flipped
// byte of data): the suite calibrates the side channel with checksums on too and
// requires each update's part to be the update header and one 24-byte "done" per
// bucket (engines/ucx/wire.h), aiming at a random bucket's checksum field. slow,
// which throttles the data, does not run for ucx.
//
// After each fault: every side that should see an error saw one within its
// deadline (detected), every process finished or answered in time and every
// session ended (no hang), and every worker is exactly at the old or the new
// version: it says "clean" at one of the two and holds exactly that version's
// weights; a failed staged update left it at the old one; only an in_place worker
// may instead say "dirty" (claiming no version). Anything else counts as a lost
// update. Then a new trainer runs a full update, which every worker must verify
// (recovery). Worker descriptors and threads are compared at the start and the
// end (nothing leaks across failures).
//
//   bazel run //tests/fault:suite -- [--rounds N] [--seed S] [--short] [--engine tcp|ucx]
//
// Progress goes to stderr; the last stdout line is one JSON object with
// faults_injected, faults_detected, lost_updates, hangs and the rest. Exit status
// 0 only when every fault was detected, nothing was lost and nothing hung.
//
// suite.h lists the files the suite is split into and what each holds.
#include "tests/fault/suite.h"

namespace refit::fault {

suite::suite(options o) : o_(std::move(o)), rng_(o_.seed) {
  char tmpl[] = "/tmp/refit-fault-XXXXXX";
  if (!mkdtemp(tmpl)) throw_error(errc::io_error, "mkdtemp failed");
  dir_ = tmpl;
  secret_file_ = dir_ + "/secret";
  wrong_secret_file_ = dir_ + "/wrong-secret";
  write_secret(secret_file_, "fault-suite-secret-" + std::to_string(o_.seed));
  write_secret(wrong_secret_file_, "not-the-secret");
  secret_ = auth::read_secret_file(secret_file_);
}

json suite::run() {
  const auto t0 = clock_type::now();
  for (int i = 0; i < o_.workers; ++i) workers_.push_back(start_worker(i));
  // A baseline: every worker holds a known version.
  if (!recover("baseline"))
    throw_error(errc::io_error, "the baseline update failed (" +
                                    (r_.problems.empty() ? std::string("?") : r_.problems.back()) + "); see " + dir_);
  for (auto& w : workers_) {
    w.fds = count_entries("/proc/" + std::to_string(w.proc.pid) + "/fd");
    w.threads = count_entries("/proc/" + std::to_string(w.proc.pid) + "/task");
  }
  std::vector<std::string> kinds = {"kill_trainer",  "kill_worker", "corrupt",       "stall",
                                    "impostor",      "slow",        "stale_trainer", "staged_kill_after_chunk",
                                    "frozen_trainer"};
  if (!o_.data_proxied()) {
    std::erase_if(kinds, [](const std::string& k) { return k == "slow"; });
    calibrate("star");
    calibrate("star", true);  // (corrupt aims at a "done" of an update with checksums on)
    // A chain's init tells worker 0 more (its successors), so its own count.
    if (o_.workers >= 3) {
      calibrate("chain");
      calibrate("chain", true);
    }
  }
  if (o_.workers >= 3) {
    kinds.push_back("chain_kill_middle");
    kinds.push_back("chain_corrupt");
  }
  if (o_.engine == "tcp") kinds.push_back("delta_wrong_base");
  // Fleet-atomic updates: a worker killed, the trainer killed, a corrupt stream,
  // a stalled one; afterwards every worker is at the old version.
  for (const char* k : {"fleet_kill_worker", "fleet_kill_trainer", "fleet_corrupt", "fleet_stall"}) kinds.push_back(k);
  for (int r = 0; r < o_.rounds; ++r)
    for (std::size_t k = 0; k < kinds.size(); ++k) {
      // Both commit modes for every kind over the rounds (alternating).
      const char* commit = (r + k) % 2 == 0 || kinds[k] == "staged_kill_after_chunk" ? "staged" : "in_place";
      try {
        if (kinds[k] == "frozen_trainer" || kinds[k] == "staged_kill_after_chunk")
          session_scenario(kinds[k], commit);
        else if (kinds[k] == "delta_wrong_base")
          delta_scenario(kinds[k]);  // in place: deltas refuse staged sessions
        else if (kinds[k].rfind("fleet_", 0) == 0)
          scenario(kinds[k].substr(6), "fleet_atomic");
        else
          scenario(kinds[k], commit);
      } catch (const std::exception& e) {
        ++r_.recoveries_failed;
        r_.problems.push_back(kinds[k] + ": the suite could not complete the scenario: " + e.what());
        say(kinds[k] + ": suite error: " + e.what());
      }
    }
  // Leak check on the workers that lived through every fault.
  int fd_growth = 0, thread_growth = 0;
  for (auto& w : workers_) {
    if (w.fds == 0) continue;  // restarted: no baseline
    fd_growth = std::max(fd_growth, count_entries("/proc/" + std::to_string(w.proc.pid) + "/fd") - w.fds);
    thread_growth = std::max(thread_growth, count_entries("/proc/" + std::to_string(w.proc.pid) + "/task") - w.threads);
  }
  if (fd_growth > 0) r_.problems.push_back("worker descriptors grew by " + std::to_string(fd_growth));
  if (thread_growth > 0) r_.problems.push_back("worker threads grew by " + std::to_string(thread_growth));
  for (auto& w : workers_) stop_worker(w);
  const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  const bool ok = r_.detected == r_.injected && r_.lost == 0 && r_.hangs == 0 && r_.recoveries_failed == 0 &&
                  r_.slow_failed == 0 && fd_growth <= 0 && thread_growth <= 0;
  if (ok) {
    std::string cmd = "rm -rf '" + dir_ + "'";
    if (std::system(cmd.c_str()) != 0) say("could not remove " + dir_);
  } else {
    say("logs kept in " + dir_);
  }
  json problems = r_.problems;
  return {{"scenarios", r_.scenarios},
          {"faults_injected", r_.injected},
          {"faults_detected", r_.detected},
          {"lost_updates", r_.lost},
          {"hangs", r_.hangs},
          {"recoveries", r_.recoveries},
          {"recoveries_failed", r_.recoveries_failed},
          {"slow_within_deadline_ok", r_.slow_ok},
          {"slow_within_deadline_failed", r_.slow_failed},
          {"worker_fd_growth", fd_growth},
          {"worker_thread_growth", thread_growth},
          {"by_kind", r_.by_kind},
          {"problems", problems},
          {"seed", o_.seed},
          {"workers", o_.workers},
          {"model_bytes", o_.model_bytes},
          {"engine", o_.engine},
          {"timeout_ms", o_.timeout_ms},
          {"seconds", seconds},
          {"passed", ok}};
}

void suite::write_secret(const std::string& path, const std::string& value) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::write(fd, value.data(), value.size()) != static_cast<ssize_t>(value.size()))
    throw_error(errc::io_error, "cannot write " + path);
  ::close(fd);
}

// A full update by a new trainer that every worker must verify.
bool suite::recover(const std::string& why) {
  const int round = ++version_;
  std::vector<std::string> args = {"--first-round",      std::to_string(round), "--updates", "1",
                                   "--auth-secret-file", secret_file_};
  args.push_back("--checksums");
  auto r = run_trainer(args, nullptr, dir_ + "/trainer-" + std::to_string(round) + "-recover.log");
  const bool ok = r.exited && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && r.last.is_object() &&
                  r.last.value("verified", false);
  if (!ok) {
    if (!r.exited) ++r_.hangs;
    r_.problems.push_back("recovery after " + why + " failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
    --version_;
    return false;
  }
  fingerprints_[round] = fingerprint_of(workers_[0]);
  return true;
}

}  // namespace refit::fault

int main(int argc, char** argv) {
  using namespace refit::fault;
  using refit::json;
  signal(SIGPIPE, SIG_IGN);
  options o;
  o.seed = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) % 1000000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "suite: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--binary")
      o.binary = value();
    else if (a == "--rounds")
      o.rounds = std::max(1, std::atoi(value().c_str()));
    else if (a == "--seed")
      o.seed = std::strtoull(value().c_str(), nullptr, 10);
    else if (a == "--workers")
      o.workers = std::max(1, std::atoi(value().c_str()));
    else if (a == "--timeout-ms")
      o.timeout_ms = std::max(200, std::atoi(value().c_str()));
    else if (a == "--short")
      o.rounds = 1;
    else if (a == "--engine")
      o.engine = value();
    else {
      std::fprintf(stderr,
                   "usage: suite --binary PATH/weight_sync [--rounds N] [--seed S] [--workers N] [--timeout-ms MS] "
                   "[--short] [--engine tcp|ucx]\n");
      return 2;
    }
  }
  if (o.binary.empty()) {
    std::fprintf(stderr, "suite: --binary is required (bazel run //tests/fault:suite passes it)\n");
    return 2;
  }
  if (o.binary.find('/') != std::string::npos && o.binary[0] != '/') {
    char cwd[4096];
    if (getcwd(cwd, sizeof cwd)) o.binary = std::string(cwd) + "/" + o.binary;
  }
  say("seed " + std::to_string(o.seed) + ", " + std::to_string(o.rounds) + " round(s) of every fault, " +
      std::to_string(o.workers) + " workers, engine " + o.engine);
  try {
    suite s(o);
    json r = s.run();
    std::cout << r.dump() << std::endl;
    return r["passed"].get<bool>() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[fault] suite error: %s\n", e.what());
    std::cout << json{{"error", e.what()},  {"faults_injected", 0}, {"faults_detected", 0},
                      {"lost_updates", -1}, {"hangs", -1},          {"passed", false}}
                     .dump()
              << std::endl;
    return 1;
  }
}
