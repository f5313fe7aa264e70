// The fleet protocol's decisions, written once: what a fleet-atomic update's
// failed commit leaves on each member, and how reconcile brings a fleet a lost
// trainer left at two versions back to one. Pure functions over what the members
// report: every driver runs them, whatever carries its calls (worker_group over
// refit's control plane; refit.vllm's FleetClient over vLLM's HTTP routes, through
// the Python binding refit.integration.fleet). docs/control-plane.md describes
// the protocol.
//
// A member is whatever answers for one version: a worker, or a replica of several
// workers (their states together). Versions are JSON values (refit's integers,
// vLLM's labels), compared for equality; null is "no version".
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::control {

using json = nlohmann::json;

/// How a call that decides a member's version (commit, rollback) ended.
enum class call_outcome {
  ok,       ///< it answered success
  failed,   ///< it answered failure: the member says where it stands
  unknown,  ///< no answer (timeout, connection lost): it may still run, or have ended either way
};
/// ok for none; unknown for refit's timeout and peer_lost; failed otherwise.
call_outcome outcome_of(std::exception_ptr e) noexcept;

/// Where a member stands after a fleet-atomic update that failed at a commit.
enum class settled_phase {
  rolled_back,  ///< it committed, and its rollback brought it back
  failed,       ///< its own commit failed; it loaded its previous version back itself
  in_doubt,     ///< its commit or rollback did not answer: reconcile once it does
  fenced,       ///< it committed and its rollback failed: it holds no whole version
};
std::string_view to_string(settled_phase p) noexcept;

/// After a failed commit. `commits[i]`: how member i's commit ended (at least one
/// is not ok); `rollbacks[i]`: how its rollback ended, for the members whose commit
/// was ok (every one of those is rolled back; the others' entries are ignored).
struct settlement {
  std::vector<settled_phase> phases;
  /// "every worker keeps its previous version:", or what the in-doubt and fenced
  /// members change about that; the caller appends each member's line.
  std::string summary;
};
settlement settle_failed_commit(const std::vector<call_outcome>& commits, const std::vector<call_outcome>& rollbacks);

/// One member as reconcile reads it.
struct fleet_member {
  std::string name;
  bool session_open = false;  ///< a session is open on it (a trainer may still be updating it)
  bool clean = false;         ///< it holds a whole version (not dirty)
  json version;               ///< the version it serves; null: none
  bool holds_undo = false;    ///< it holds the undo of its last fleet-atomic commit
  json undo_version;          ///< the version that undo loads back; null: not known to it
};

enum class reconcile_action {
  none,       ///< at the fleet's version, or fenced already: nothing to do
  roll_back,  ///< committed an update the others never did: roll it back
  fence,      ///< dirty: it claims no version until a full update
};
std::string_view to_string(reconcile_action a) noexcept;

struct reconcile_plan {
  json version;  ///< the fleet's version after the plan; null when no member is clean
  std::vector<reconcile_action> actions;
};

/// The rule: a member with a session open refuses the plan (invalid_state: a
/// trainer may still be updating it; a driver that knows its trainer is gone
/// aborts that session first and asks again). A dirty member is fenced. The clean
/// members at one version: nothing to do. Otherwise the fleet's version is the
/// first clean member's version V (in member order) that every clean member is
/// at or can roll back to: its undo's version is V, or, where a member does not
/// know its undo's version (vLLM's labels), V is the version of a clean member
/// that holds no undo (one that never committed the lost update). Those ahead
/// of V are rolled back. No such V: invalid_state naming every member's version
/// and undo (a full update brings them together).
reconcile_plan plan_reconcile(const std::vector<fleet_member>& members);

}  // namespace refit::control
