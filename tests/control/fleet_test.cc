// The fleet protocol's rules (lib/control/fleet.h): what a failed commit leaves on
// each member, and reconcile's plan, with refit's integer versions and with the
// labels of members that do not know their undo's version (vLLM replicas).
#include <refit/control/fleet.h>

#include <gtest/gtest.h>

#include <refit/error.h>

namespace refit::control {
namespace {

using enum call_outcome;

fleet_member member(std::string name, json version, bool clean = true, bool undo = false, json undo_version = nullptr) {
  fleet_member m;
  m.name = std::move(name);
  m.version = std::move(version);
  m.clean = clean;
  m.holds_undo = undo;
  m.undo_version = std::move(undo_version);
  return m;
}

std::vector<std::string> actions(const reconcile_plan& p) {
  std::vector<std::string> out;
  for (auto a : p.actions) out.emplace_back(to_string(a));
  return out;
}

std::string refusal(const std::vector<fleet_member>& members) {
  try {
    plan_reconcile(members);
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_state);
    return e.what();
  }
  return "";
}

TEST(fleet_test, outcomes_of_calls) {
  EXPECT_EQ(outcome_of(nullptr), ok);
  EXPECT_EQ(outcome_of(std::make_exception_ptr(error(errc::timeout, "t"))), unknown);
  EXPECT_EQ(outcome_of(std::make_exception_ptr(error(errc::peer_lost, "p"))), unknown);
  EXPECT_EQ(outcome_of(std::make_exception_ptr(error(errc::processing_failed, "x"))), failed);
  EXPECT_EQ(outcome_of(std::make_exception_ptr(std::runtime_error("x"))), failed);
}

TEST(fleet_test, a_failed_commit_rolls_back_the_committed_and_names_each_phase) {
  settlement s = settle_failed_commit({ok, failed, ok}, {ok, ok, ok});
  ASSERT_EQ(s.phases.size(), 3u);
  EXPECT_EQ(s.phases[0], settled_phase::rolled_back);
  EXPECT_EQ(s.phases[1], settled_phase::failed);
  EXPECT_EQ(s.phases[2], settled_phase::rolled_back);
  EXPECT_EQ(s.summary, "every worker keeps its previous version:");

  s = settle_failed_commit({ok, failed}, {failed, ok});
  EXPECT_EQ(s.phases[0], settled_phase::fenced);
  EXPECT_EQ(s.summary, "the workers not fenced keep their previous version:");

  s = settle_failed_commit({unknown, ok, ok}, {ok, unknown, failed});
  EXPECT_EQ(s.phases[0], settled_phase::in_doubt);  // its commit: no answer
  EXPECT_EQ(s.phases[1], settled_phase::in_doubt);  // its rollback: no answer
  EXPECT_EQ(s.phases[2], settled_phase::fenced);
  EXPECT_NE(s.summary.find("not fenced or in doubt"), std::string::npos) << s.summary;
  EXPECT_NE(s.summary.find("reconcile()"), std::string::npos) << s.summary;

  EXPECT_THROW(settle_failed_commit({ok}, {}), error);
}

TEST(fleet_test, one_version_is_nothing_to_do_and_dirty_members_are_fenced) {
  reconcile_plan p = plan_reconcile({member("a", 3), member("b", 3), member("c", nullptr, false)});
  EXPECT_EQ(p.version, 3);
  EXPECT_EQ(actions(p), (std::vector<std::string>{"none", "none", "fence"}));

  p = plan_reconcile({member("a", nullptr, false)});
  EXPECT_TRUE(p.version.is_null());
  EXPECT_EQ(actions(p), (std::vector<std::string>{"fence"}));
}

TEST(fleet_test, members_ahead_with_an_undo_to_the_others_version_are_rolled_back) {
  // a and c committed 5 (undo to 4); b never did.
  reconcile_plan p = plan_reconcile({member("a", 5, true, true, 4), member("b", 4), member("c", 5, true, true, 4)});
  EXPECT_EQ(p.version, 4);
  EXPECT_EQ(actions(p), (std::vector<std::string>{"roll_back", "none", "roll_back"}));
  // An undo from an earlier, whole update at the fleet's version changes nothing.
  p = plan_reconcile({member("a", 4, true, true, 3), member("b", 4)});
  EXPECT_EQ(actions(p), (std::vector<std::string>{"none", "none"}));
}

TEST(fleet_test, labels_whose_undo_version_is_unknown_roll_back_to_the_members_that_never_committed) {
  // vLLM replicas: versions are labels, and a replica's undo does not know its label.
  reconcile_plan p = plan_reconcile({member("r0", "fleet-lost", true, true), member("r1", "fleet-0")});
  EXPECT_EQ(p.version, "fleet-0");
  EXPECT_EQ(actions(p), (std::vector<std::string>{"roll_back", "none"}));
  // Every member committed something with an unknown undo, at two labels: no
  // member vouches for either version.
  EXPECT_NE(refusal({member("r0", "x", true, true), member("r1", "y", true, true)}).find("no version every member"),
            std::string::npos);
}

TEST(fleet_test, members_at_versions_no_undo_joins_are_refused_naming_each) {
  const std::string why = refusal({member("a", 4), member("b", 5), member("c", 6, true, true, 5)});
  EXPECT_NE(why.find("a: clean at 4, undo to none"), std::string::npos) << why;
  EXPECT_NE(why.find("c: clean at 6, undo to 5"), std::string::npos) << why;
  EXPECT_NE(why.find("a full update"), std::string::npos) << why;
}

TEST(fleet_test, an_open_session_refuses_the_plan) {
  fleet_member open = member("b", 4);
  open.session_open = true;
  EXPECT_NE(refusal({member("a", 4), open}).find("b has a weight update session open"), std::string::npos);
}

}  // namespace
}  // namespace refit::control
