"""refit as verl's checkpoint engine, through verl's own registry and flow
(ranks.py: separate processes, driven as CheckpointEngineManager does). Every step
is checked byte for byte against the actor's tensors on every rollout rank."""

from __future__ import annotations

import os
import signal
import time

import pytest

if os.environ.get("REFIT_REQUIRE_VERL"):  # tests/verl/run.sh: a missing verl fails, never skips
    import verl.checkpoint_engine.base  # noqa: F401
else:
    pytest.importorskip("verl.checkpoint_engine.base", reason="verl is not installed (tests/verl/run.sh: its venv)")

from ranks import Rank, digests, model, step, tensors_of  # noqa: E402

OPTS = {"address": "127.0.0.1", "buffer_bytes": 256 << 10, "timeout_ms": 5000}


@pytest.fixture
def ranks():
    made: list[Rank] = []

    def make(role: str, **kwargs):
        r = Rank(role, **{**OPTS, **kwargs})  # its process starts now; its first command waits for it
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def expect_step(out: dict, number: int, kind: str = "model") -> None:
    want = digests(tensors_of(number, kind))
    for a in out["actors"]:
        assert a[0] == "ok", a
    for i, r in enumerate(out["rollouts"]):
        assert r[0] == "ok", f"rollout {i}: {r}"
        got = r[1]
        assert got["digests"] == want, f"rollout {i}: step {number} differs"
        assert got["order"] == [n for n, _ in model(number)], "tensors are yielded in the actor's order"
        assert got["version"] == number


def test_the_registry_makes_refit_and_refuses_bad_options():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import refit.verl  # noqa: F401

    assert CheckpointEngineRegistry.get("refit").__name__ == "RefitCheckpointEngine"
    gpu = "nccl" in refit.backends()  # a CUDA build: tests/verl/gpu_check.py covers its refusals
    for bad, says in (({"engine": "nope"}, "engine"), *(() if gpu else (({"engine": "nccl"}, "CUDA build"),)),
                      ({"device": "cuda:0"}, "device"), ({"engine": "cuda_ipc", "device": "gpu0"}, "device"),
                      ({"commit": "later"}, "commit"),
                      ({"timeout_ms": 0}, "timeout_ms"), ({"topology": "ring"}, "topology"),
                      ({"num_buffers": "2"}, "num_buffers"), ({"auth_secret_file": "/no/such"}, "auth_secret_file"),
                      ({"delta": True, "commit": "staged"}, "delta")):
        with pytest.raises(refit.InvalidArgumentError, match=says):
            CheckpointEngineRegistry.new("refit", bucket_size=1 << 20, **bad)
    with pytest.raises(refit.InvalidArgumentError, match="bucket_size"):
        CheckpointEngineRegistry.new("refit", bucket_size=0)


def test_one_actor_to_two_rollouts_three_steps_on_the_same_engines(ranks):
    actors = [ranks("master")]
    rollouts = [ranks("rollout"), ranks("rollout")]
    for number in (1, 2, 3):
        expect_step(step(actors, rollouts, number), number)
    # The topology was built once: the same connections served every step.
    assert actors[0].attr("connects") == 1


def test_two_actors_to_two_rollouts_with_checksums_staged(ranks):
    actors = [ranks("master", checksums=True), ranks("actor", checksums=True)]
    rollouts = [ranks("rollout", checksums=True, commit="staged"), ranks("rollout", checksums=True, commit="staged")]
    for number in (4, 5):
        out = step(actors, rollouts, number)
        expect_step(out, number)
        assert out["actors"][1][1]["stats"] == {}, "only the master sends"


def test_deltas_carry_each_step_after_the_first(ranks):
    actors = [ranks("master", delta=True)]
    rollouts = [ranks("rollout", delta=True), ranks("rollout", delta=True)]
    for number in (1, 2, 3):
        out = step(actors, rollouts, number, kind="trajectory")
        expect_step(out, number, "trajectory")
        stats = out["actors"][0][1]["stats"]
        assert stats["refit/full_fallbacks"] == 0 and stats["refit/chunks"] == 1, stats
        if number > 1:  # the first step is the base: sent full
            assert 0 < stats["refit/delta_bytes"] < stats["refit/bytes"] / 4, stats


def test_a_killed_sender_fails_every_receive_in_time_and_a_restarted_one_takes_the_next_step(ranks):
    actors = [ranks("master")]
    rollouts = [ranks("rollout"), ranks("rollout")]
    expect_step(step(actors, rollouts, 1), 1)
    t0 = time.monotonic()
    out = step(actors, rollouts, 2, delay_s=0.05, during=lambda: (time.sleep(0.3), actors[0].kill()))
    took = time.monotonic() - t0
    assert out["actors"][0] == ("dead",)
    for i, r in enumerate(out["rollouts"]):
        assert r[0] == "error" and r[1] in ("PeerLostError", "CancelledError", "TimeoutError"), f"rollout {i}: {r}"
    assert took < 15, f"the rollouts took {took:.1f} s to fail (deadline 5 s)"
    actors[0] = ranks("master")  # verl restarts the actor process
    expect_step(step(actors, rollouts, 3), 3)


def test_a_frozen_sender_fails_every_receive_at_the_deadline(ranks):
    actors = [ranks("master")]
    rollouts = [ranks("rollout"), ranks("rollout")]
    expect_step(step(actors, rollouts, 1), 1)
    out = step(actors, rollouts, 2, delay_s=0.05, timeout_s=10,
               during=lambda: (time.sleep(0.3), actors[0].signal(signal.SIGSTOP)))
    assert out["actors"][0] == ("no answer",)
    actors[0].kill()
    for i, r in enumerate(out["rollouts"]):
        assert r[0] == "error" and r[1] in ("CancelledError", "TimeoutError", "PeerLostError"), f"rollout {i}: {r}"
        assert "sent nothing" in r[2] or "timeout" in r[2] or "within" in r[2], r[2]
    assert out["rollouts_s"] < 12, f"the rollouts failed after {out['rollouts_s']:.1f} s (deadline 5 s)"
    actors[0] = ranks("master")
    expect_step(step(actors, rollouts, 3), 3)


def test_over_ucx(ranks):
    opts = {"engine": "ucx"}
    actors = [ranks("master", **opts)]
    rollouts = [ranks("rollout", **opts), ranks("rollout", **opts)]
    for number in (1, 2):
        expect_step(step(actors, rollouts, number), number)
    assert actors[0].attr("connects") == 1


def test_a_killed_rollout_fails_the_send_naming_it_and_the_others_take_the_next_step(ranks):
    actors = [ranks("master")]
    rollouts = [ranks("rollout"), ranks("rollout")]
    expect_step(step(actors, rollouts, 1), 1)
    out = step(actors, rollouts, 2, delay_s=0.05, during=lambda: (time.sleep(0.3), rollouts[1].kill()))
    sent = out["actors"][0]
    assert sent[0] == "error" and "worker 1" in sent[2], sent
    assert out["rollouts"][0][0] == "error", "the live rollout's step was aborted"
    # verl removes the replica; the next step rebuilds the topology.
    expect_step(step(actors, rollouts[:1], 3), 3)
    assert actors[0].attr("connects") == 2


def test_gpu_engines_through_verl():
    """nccl and cuda_ipc through refit.verl (tests/verl/gpu_check.py, the GPU
    check's verl_gpu step): runs where there is a GPU and refit's CUDA build."""
    import gpu_check

    out = gpu_check.run()
    if out.get("skipped"):
        pytest.skip(out["reason"])
    assert out["passed"], out
