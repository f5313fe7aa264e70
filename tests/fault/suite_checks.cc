// What the fault suite asks the workers after a fault, and how it counts a
// scenario's verdict (suite.h).
#include "tests/fault/suite.h"

namespace refit::fault {

fingerprint_list suite::fingerprint_of(worker& w) {
  json a = run_sync(call(*w.client, "weight_fingerprint"));
  return fingerprints_from_json(json{{"algorithm", a["algorithm"]}, {"tensors", a["tensors"]}});
}

// Polls a worker until no update is being received there and no session is open;
// nullopt if it stays busy (a hang) or stops answering. Every session ends once
// its trainer is gone: at once when its connection closes, else when its owner's
// silence reaches the worker's session timeout (the --timeout-ms here).
std::optional<json> suite::settled_info(worker& w) {
  std::optional<json> settled;
  testing::poll_until(
      [&] {
        try {
          json info = run_sync(call(*w.client, "weight_info"));
          if (info["receiving"].get<bool>() || info["session_active"].get<bool>()) return false;
          settled = std::move(info);
        } catch (const error&) {
        }
        return true;  // settled, or it stopped answering
      },
      std::chrono::milliseconds(o_.timeout_ms * 4), 20ms);
  return settled;
}

// Polls until every worker has received its chunk and waits for the finish
// (session open, nothing being received); false if that is not seen in time.
bool suite::every_chunk_received(std::chrono::milliseconds limit) {
  const auto until = clock_type::now() + limit;
  while (clock_type::now() < until) {
    bool all = true;
    for (auto& w : workers_) {
      json info = run_sync(call(*w.client, "weight_info"));
      all = all && info["session_active"].get<bool>() && !info["receiving"].get<bool>() &&
            info["session_chunks"].is_number_integer() && info["session_chunks"].get<int>() > 0;
      if (!all) break;
    }
    if (all) return true;
    io_.restart();
    io_.run_for(10ms);  // the trainer's stdout reader runs meanwhile
  }
  return false;
}

// Whether worker i's answer `info` holds exactly a version the scenario allows
// (`old_version`, or `new_version` when it may have landed) and says so; staged
// workers must, in_place ones may instead say dirty (they claim no version).
// Returns why not ("" when it does).
std::string suite::not_at_a_version(std::size_t i, const json& info, int old_version, std::optional<int> new_version,
                                    const std::string& commit) {
  const std::string state = info["state"];
  const int v = info["weight_version"].is_number_integer() ? info["weight_version"].get<int>() : -1;
  if (state == "updating") return "still says updating: a session outlived its trainer";
  if (state == "dirty") {
    if (commit == "staged") return "is dirty after a staged update (" + info["dirty_reason"].dump() + ")";
    return {};
  }
  if (v != old_version && (!new_version || v != *new_version))
    return "says clean at version " + std::to_string(v) + ", neither the old (" + std::to_string(old_version) + ")" +
           (new_version ? " nor the new (" + std::to_string(*new_version) + ")" : std::string());
  auto known = fingerprints_.find(v);
  if (known == fingerprints_.end() || !compare_fingerprints(known->second, fingerprint_of(workers_[i])).empty())
    return "says clean at version " + std::to_string(v) + " but holds other weights";
  return {};
}

// One more fault of `kind` injected; returns its entry of the report's by_kind.
json& suite::count_injected(const std::string& kind) {
  ++r_.injected;
  json& stats = r_.by_kind[kind];
  if (stats.is_null()) stats = {{"injected", 0}, {"detected", 0}};
  stats["injected"] = stats["injected"].get<int>() + 1;
  return stats;
}

// A scenario's verdict: detected when nothing was missed, else each miss is one
// of the report's problems.
void suite::count_verdict(json& stats, const std::string& name, const std::vector<std::string>& missed) {
  if (missed.empty()) {
    ++r_.detected;
    stats["detected"] = stats["detected"].get<int>() + 1;
  } else {
    for (const auto& m : missed) r_.problems.push_back(name + ": " + m);
  }
}

}  // namespace refit::fault
