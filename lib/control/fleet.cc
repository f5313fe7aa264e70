#include <refit/control/fleet.h>

#include <optional>

#include <refit/error.h>

namespace refit::control {

call_outcome outcome_of(std::exception_ptr e) noexcept {
  if (!e) return call_outcome::ok;
  const errc k = error_kind_of(e);
  return k == errc::timeout || k == errc::peer_lost ? call_outcome::unknown : call_outcome::failed;
}

std::string_view to_string(settled_phase p) noexcept {
  switch (p) {
    case settled_phase::rolled_back:
      return "rolled_back";
    case settled_phase::failed:
      return "failed";
    case settled_phase::in_doubt:
      return "in_doubt";
    case settled_phase::fenced:
      return "fenced";
  }
  return "?";
}

std::string_view to_string(reconcile_action a) noexcept {
  switch (a) {
    case reconcile_action::none:
      return "none";
    case reconcile_action::roll_back:
      return "roll_back";
    case reconcile_action::fence:
      return "fence";
  }
  return "?";
}

settlement settle_failed_commit(const std::vector<call_outcome>& commits, const std::vector<call_outcome>& rollbacks) {
  if (rollbacks.size() != commits.size())
    throw_error(errc::invalid_argument, "settle_failed_commit: " + std::to_string(commits.size()) + " commits and " +
                                            std::to_string(rollbacks.size()) + " rollbacks");
  settlement s;
  bool fenced = false, in_doubt = false;
  for (std::size_t i = 0; i < commits.size(); ++i) {
    settled_phase p;
    if (commits[i] == call_outcome::unknown)
      p = settled_phase::in_doubt;
    else if (commits[i] == call_outcome::failed)
      p = settled_phase::failed;
    else if (rollbacks[i] == call_outcome::unknown)
      p = settled_phase::in_doubt;
    else if (rollbacks[i] == call_outcome::failed)
      p = settled_phase::fenced;
    else
      p = settled_phase::rolled_back;
    in_doubt = in_doubt || p == settled_phase::in_doubt;
    fenced = fenced || p == settled_phase::fenced;
    s.phases.push_back(p);
  }
  if (in_doubt)
    s.summary = std::string("the workers not ") + (fenced ? "fenced or " : "") +
                "in doubt keep their previous version; reconcile() brings those in doubt to it once they answer:";
  else if (fenced)
    s.summary = "the workers not fenced keep their previous version:";
  else
    s.summary = "every worker keeps its previous version:";
  return s;
}

namespace {

// Whether member m is at v or can roll back to it (see plan_reconcile).
bool reaches(const fleet_member& m, const json& v, bool held_without_undo) {
  if (m.version == v) return true;
  if (!m.holds_undo) return false;
  return m.undo_version.is_null() ? held_without_undo : m.undo_version == v;
}

std::optional<json> fleet_version(const std::vector<fleet_member>& members) {
  std::vector<const fleet_member*> clean;
  for (const auto& m : members)
    if (m.clean) clean.push_back(&m);
  if (clean.empty()) return json(nullptr);
  bool one = true;
  for (const auto* m : clean) one = one && m->version == clean.front()->version;
  if (one) return clean.front()->version;
  for (const auto* c : clean) {
    const json& v = c->version;
    if (v.is_null()) continue;
    bool held_without_undo = false;
    for (const auto* m : clean) held_without_undo = held_without_undo || (m->version == v && !m->holds_undo);
    bool all = true;
    for (const auto* m : clean) all = all && reaches(*m, v, held_without_undo);
    if (all) return v;
  }
  return std::nullopt;
}

}  // namespace

reconcile_plan plan_reconcile(const std::vector<fleet_member>& members) {
  for (const auto& m : members)
    if (m.session_open)
      throw_error(errc::invalid_state, "reconcile: " + m.name +
                                           " has a weight update session open: a trainer is still updating it; "
                                           "reconcile after its session deadline");
  const std::optional<json> target = fleet_version(members);
  if (!target) {
    std::string lines;
    for (const auto& m : members)
      lines += "\n  " + m.name + ": " + (m.clean ? "clean" : "dirty") + " at " + m.version.dump() + ", undo to " +
               (m.holds_undo ? m.undo_version.dump() : std::string("none"));
    throw_error(
        errc::invalid_state,
        "reconcile: no version every member holds or can roll back to; a full update brings them together:" + lines);
  }
  reconcile_plan plan;
  plan.version = *target;
  for (const auto& m : members)
    plan.actions.push_back(!m.clean               ? reconcile_action::fence
                           : m.version == *target ? reconcile_action::none
                                                  : reconcile_action::roll_back);
  return plan;
}

}  // namespace refit::control
