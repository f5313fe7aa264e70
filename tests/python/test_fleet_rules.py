"""The fleet protocol's rules from Python (refit.integration.fleet, the functions
refit's C++ worker_group runs), and refit.vllm's FleetClient deciding by them
against replicas stood in for by a table (no vLLM server: tests/vllm_serve runs
the real ones)."""

import os

import pytest

import refit
from refit.integration import fleet


def test_the_rules_from_python():
    s = fleet.settle_failed_commit(["ok", "failed", "unknown"], ["unknown", "ok", "ok"])
    assert s["phases"] == ["in_doubt", "failed", "in_doubt"], s
    assert "reconcile()" in s["summary"], s
    with pytest.raises(refit.InvalidArgumentError, match="outcome"):
        fleet.settle_failed_commit(["maybe"], ["ok"])
    plan = fleet.plan_reconcile([{"name": "a", "clean": True, "version": 5, "holds_undo": True, "undo_version": 4},
                                 {"name": "b", "clean": True, "version": 4},
                                 {"name": "c", "clean": False}])
    assert plan == {"version": 4, "actions": ["roll_back", "none", "fence"]}, plan
    with pytest.raises(refit.InvalidStateError, match="a: clean at 4, undo to none"):
        fleet.plan_reconcile([{"name": "a", "clean": True, "version": 4}, {"name": "b", "clean": True, "version": 5}])
    assert fleet.outcome_of(None) == "ok"
    assert fleet.outcome_of(refit.TimeoutError("t")) == "unknown"
    assert fleet.outcome_of(ConnectionResetError()) == "unknown"
    assert fleet.outcome_of(RuntimeError("no")) == "failed"


# vLLM picks its platform at its first import: without a GPU, the CPU one (as
# test_vllm_conformance.py does; this module may be imported first).
torch = pytest.importorskip("torch")
if torch.accelerator.device_count() == 0:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm_fleet = pytest.importorskip("refit.vllm._fleet", reason="refit.vllm needs vLLM's weight_transfer package")


class Replicas(vllm_fleet.FleetClient):
    """FleetClient over a table of replicas: each route answers from it, and
    ``fail`` says which (url, route) raise what."""

    def __init__(self, states, versions, fail=None):
        super().__init__(list(states))
        self.states, self.versions, self.fail, self.calls = states, versions, fail or {}, []
        self._fleet_atomic = True
        self._versions = dict(versions)

    def _request(self, method, url, route, body=None):
        self.calls.append((url, route, body))
        if (url, route) in self.fail:
            raise self.fail[(url, route)]
        if route == "weight_info":
            return {"weight_version": self.versions[url]}
        if route == "update_weight_version":
            self.versions[url] = body["new_version"]
        return {}

    def _rpc(self, url, method, *args):
        self.calls.append((url, method, args))
        if (url, method) in self.fail:
            raise self.fail[(url, method)]
        if method == "refit_weight_state":
            return self.states[url]
        if method == "refit_abort_weight_update":
            return [{"state": w} for w in self.states[url]]
        return [{} for _ in self.states[url]]


def test_a_commit_without_an_answer_is_in_doubt_never_at_a_version():
    clean = [{"weights_dirty": False}]
    r = Replicas({"http://a": clean, "http://b": clean}, {"http://a": "v1", "http://b": "v1"},
                 fail={("http://b", "finish_weight_update"): refit.TimeoutError("no answer within 300 s")})
    with pytest.raises(vllm_fleet.FleetUpdateError) as e:
        r.finish_weight_update("v2")
    out = e.value.outcomes
    assert out["http://a"] == {"phase": "rolled_back", "version": "v1"}, out
    assert out["http://b"]["phase"] == "in_doubt" and out["http://b"]["at"] == "commit", out
    assert "reconcile() brings those in doubt" in str(e.value)
    # The one in doubt is not touched: it may still be committing.
    assert not [c for c in r.calls if c[0] == "http://b" and c[1] != "finish_weight_update"], r.calls


def test_reconcile_rolls_back_the_replica_that_committed_and_aborts_the_open_one():
    r = Replicas({"http://a": [{"holds_undo": True}, {"holds_undo": True}],
                  "http://b": [{"update_open": True}, {"session_active": True}]},
                 {"http://a": "lost", "http://b": "v1"})
    report = r.reconcile()
    assert report["http://a"]["action"] == "rolled_back" and report["http://a"]["version"] == "v1", report
    assert report["http://b"] == {"action": "aborted", "version": "v1"}, report
    assert r.versions["http://a"] == "v1"


def test_reconcile_refuses_replicas_no_version_joins():
    r = Replicas({"http://a": [{}], "http://b": [{}]}, {"http://a": "v1", "http://b": "v2"})
    with pytest.raises(vllm_fleet.FleetUpdateError, match="no version every member holds"):
        r.reconcile()
