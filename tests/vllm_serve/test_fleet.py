"""Fleet-atomic updates across two real ``vllm serve`` replicas (vLLM-CPU).

The replicas are conftest's shared server and a second one (conftest starts it
beside test_serve.py's tests), both served with refit's worker extension
(``fault_extension``). refit's trainer engine drives them through
``refit.vllm.FleetClient`` with ``fleet_atomic=True``. The second replica's commit
fails half-way through its load. The first replica has
already committed, so it rolls back; the second loads its previous version back
itself. Both then answer token for token with the old weights, at the old
version, and vLLM's own weight checksums equal the ones from before the update.
A trainer lost between the two replicas' commits leaves them mixed until a new
trainer's ``FleetClient.reconcile()`` rolls the committed one back. The next
update then lands on both.

Run by tests/vllm_serve/run.sh, after test_serve.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import requests

from refit.vllm import FleetClient, FleetUpdateError, RefitTrainerInitInfo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import fleet_replica  # noqa: E402
from weights import DictSource, checkpoint_tensors  # noqa: E402

PROMPT = "The quick brown fox"
DEADLINE_MS = 8000
TRAINER_TIMEOUT_MS = 30000


@pytest.fixture(scope="module")
def fleet(served):
    log = served["log"] + ".fleet"
    ahead = served["fleet_replica"]  # started by conftest beside test_serve.py's tests
    if ahead is not None:
        second = ahead.result()
    else:
        second = fleet_replica(served["model"], served["log"], served["secret"]).start()
    try:
        yield {**served, "servers": [served["server"], second]}
    finally:
        alive = second.alive()
        second.stop()
        assert alive, f"the second vllm serve died during the tests; see {log}"


def trainer(fleet, tensors, client_class=FleetClient):
    """vLLM's trainer path over both replicas, fleet-atomic."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    info = RefitTrainerInitInfo(
        master_address="127.0.0.1", world_size=1 + len(fleet["servers"]) * fleet["ranks"], rank=0,
        timeout_ms=TRAINER_TIMEOUT_MS,
        auth_secret_file=fleet["secret"], fleet_atomic=True, worker_options={"timeout_ms": DEADLINE_MS},
    )
    client = client_class([s.url for s in fleet["servers"]])
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=DictSource.make(tensors))


def checksums(server) -> dict[str, str]:
    """vLLM's own checksum of every weight the server holds."""
    r = requests.post(server.url + "/weight_checker", json={"action": "checksum"}, timeout=120)
    assert r.status_code == 200, r.text[:500]
    return r.json()["checksums"]


def snapshot(fleet):
    """Per replica: (version, greedy completion, weight checksums)."""
    out = []
    for s in fleet["servers"]:
        c = s.complete(PROMPT)
        out.append((s.weight_version(), (c.tokens, c.logprobs), checksums(s)))
    return out


def send(fleet, tensors, version):
    t = trainer(fleet, tensors)
    try:
        t.send_weights(version)
    finally:
        t.shutdown()


def test_a_fleet_atomic_update_lands_on_every_replica(fleet):
    """Both replicas at one version with the same weights, from any start (the
    second replica's first update is undoable: its host copy starts as the
    checkpoint)."""
    send(fleet, checkpoint_tensors(fleet["model"], seed=60), "fleet-0")
    (v1, out1, sums1), (v2, out2, sums2) = snapshot(fleet)
    assert v1 == v2 == "fleet-0"
    assert out1 == out2, "the replicas answer differently after one update"
    assert sums1 == sums2, "the replicas hold different weights after one update"


def test_a_commit_that_fails_on_one_replica_leaves_both_at_the_old_version(fleet):
    before = snapshot(fleet)
    assert before[0][0] == before[1][0] == "fleet-0"
    second = fleet["servers"][1]
    r = requests.post(second.url + "/collective_rpc", json={"method": "refit_test_fail_next_load"}, timeout=60)
    assert r.status_code == 200, r.text[:500]
    with pytest.raises(FleetUpdateError) as failed:
        send(fleet, checkpoint_tensors(fleet["model"], seed=61), "fleet-1")
    outcomes = failed.value.outcomes
    first_url, second_url = (s.url for s in fleet["servers"])
    assert outcomes[first_url]["phase"] == "rolled_back", outcomes
    assert outcomes[second_url]["phase"] == "failed" and outcomes[second_url]["at"] == "commit", outcomes
    assert "half-way on purpose" in outcomes[second_url]["error"], outcomes
    after = snapshot(fleet)
    for i, (was, now) in enumerate(zip(before, after)):
        assert now[0] == was[0], f"replica {i}: /weight_info moved to {now[0]}"
        assert now[1] == was[1], f"replica {i}: the served output changed"
        changed = sorted(k for k in was[2] if now[2].get(k) != was[2][k])
        assert not changed, f"replica {i}: weights not back at the old version: {changed[:5]}"


class LostAfterOneCommit(FleetClient):
    """A trainer that dies between its commits: the first replica commits, the
    second has voted yes and never hears again."""

    def finish_weight_update(self, weight_version=None):
        self._post(self.urls[0], "finish_weight_update", {"weight_version": weight_version})
        raise RuntimeError("the trainer died between its commits")


def test_reconcile_brings_back_a_fleet_its_lost_trainer_left_between_commits(fleet):
    before = snapshot(fleet)
    urls = [s.url for s in fleet["servers"]]
    t = trainer(fleet, checkpoint_tensors(fleet["model"], seed=62), client_class=LostAfterOneCommit)
    with pytest.raises(RuntimeError, match="died between its commits"):
        t.send_weights("fleet-lost")
    t.shutdown()
    assert fleet["servers"][0].weight_version() == "fleet-lost"  # the fleet is mixed now
    assert fleet["servers"][1].weight_version() == before[1][0]
    report = FleetClient(urls).reconcile()
    assert report[urls[0]]["action"] == "rolled_back", report
    assert report[urls[1]]["action"] == "aborted", report
    after = snapshot(fleet)
    for i, (was, now) in enumerate(zip(before, after)):
        assert now[0] == was[0], f"replica {i}: /weight_info at {now[0]}"
        assert now[1] == was[1], f"replica {i}: the served output changed"
        assert now[2] == was[2], f"replica {i}: weights not back at the old version"
    # Once at one version, reconcile has nothing to do.
    assert {r["action"] for r in FleetClient(urls).reconcile().values()} == {"none"}


def test_the_next_update_lands_on_both_after_a_failed_one(fleet):
    before = snapshot(fleet)
    send(fleet, checkpoint_tensors(fleet["model"], seed=61), "fleet-2")
    (v1, out1, sums1), (v2, out2, sums2) = snapshot(fleet)
    assert v1 == v2 == "fleet-2"
    assert out1 == out2 and sums1 == sums2
    assert sums1 != before[0][2], "the update did not change the weights"
    for s in fleet["servers"]:
        assert s.alive()
