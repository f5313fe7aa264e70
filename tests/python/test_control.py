"""refit's control plane from Python: WorkerHost workers driven by a WorkerGroup."""

import threading

import numpy as np
import pytest

import refit
from conftest import Background


def model(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((128, 32), dtype=np.float32),
        "layers.0.w": rng.standard_normal((32, 32), dtype=np.float32),
        "layers.0.b": rng.standard_normal(32).astype(np.float16),
        "head": rng.standard_normal((32, 128), dtype=np.float32),
    }


def test_a_worker_group_updates_worker_hosts_and_verifies_them():
    dests = [{k: np.zeros_like(v) for k, v in model(0).items()} for _ in range(2)]
    events = []
    hosts = [refit.WorkerHost("tcp", tensors=d, timeout_ms=10000,
                              on_update_started=lambda owner: events.append(("started", owner)),
                              on_update_finished=lambda v, stats: events.append(("finished", v)))
             for d in dests]
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{h.port}" for h in hosts], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        for version in (1, 2, 3):
            src = model(version)
            result = group.update(sender, src, version)
            assert result["verified"] and result["version"] == version
            assert len(result["workers"]) == 2
            for d in dests:
                assert all(d[k].tobytes() == src[k].tobytes() for k in src)
        for h in hosts:
            info = h.weight_info()
            assert info["weight_version"] == 3 and info["state"] == "clean"
            assert h.fingerprint() == refit.fingerprints(model(3))
        assert [e for e in events if e[0] == "finished"] == [("finished", v) for v in (1, 1, 2, 2, 3, 3)]
    sender.shutdown()
    for h in hosts:
        h.stop()


def test_a_fleet_atomic_update_commits_nowhere_unless_every_worker_votes_yes():
    # Worker 1 refuses update 2 from its on_update_started hook: no worker commits,
    # both keep update 1 whole, and the next update lands on both.
    dests = [{k: np.zeros_like(v) for k, v in model(0).items()} for _ in range(2)]
    refuse = {"next": False}

    def started(owner):
        if refuse["next"]:
            refuse["next"] = False
            raise RuntimeError("worker 1 is draining its requests")

    hosts = [refit.WorkerHost("tcp", tensors=dests[0], timeout_ms=10000),
             refit.WorkerHost("tcp", tensors=dests[1], timeout_ms=10000, on_update_started=started)]
    with refit.Sender("tcp", timeout_ms=10000) as sender, \
            refit.WorkerGroup([f"127.0.0.1:{h.port}" for h in hosts], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        assert group.update(sender, model(1), 1, fleet_atomic=True)["verified"]
        refuse["next"] = True
        with pytest.raises(refit.Error, match=r"(?s)no worker committed.*worker 1 .*draining") as e:
            group.update(sender, model(2), 2, fleet_atomic=True)
        assert "failed in start_weight_update" in str(e.value), e.value
        for h, d in zip(hosts, dests):
            info = h.weight_info()
            assert (info["weight_version"], info["state"], info["session_active"]) == (1, "clean", False), info
            assert all(d[k].tobytes() == model(1)[k].tobytes() for k in d)
        with pytest.raises(refit.InvalidArgumentError, match="in_place"):
            group.update(sender, model(3), 3, fleet_atomic=True, commit="in_place")
        assert group.update(sender, model(3), 3, fleet_atomic=True)["verified"]
        # Each worker keeps version 1 in its stage: the trainer can take update 3 back.
        assert [i["undo_version"] for i in group.call_all("weight_info")] == [1, 1]
        assert group.call_all("rollback_weight_update") == [{"weight_version": 1, "state": "clean"}] * 2
        assert group.fingerprint_differences(refit.fingerprints(model(1)), 1) == [[], []]
        for d in dests:
            assert all(d[k].tobytes() == model(1)[k].tobytes() for k in d)
        assert not any(i["holds_undo"] for i in group.call_all("weight_info"))
    for h in hosts:
        h.stop()


def test_a_worker_that_cannot_undo_refuses_a_fleet_atomic_update_before_a_byte_moves():
    got = {}
    host = refit.WorkerHost("tcp", load_weights=lambda batch: got.update(batch), framework="numpy",
                            timeout_ms=10000)
    with refit.Sender("tcp", timeout_ms=10000) as sender, \
            refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        cannot = r"(?s)worker 0 .*this worker cannot: its engine has no model target"
        with pytest.raises(refit.UnsupportedError, match=cannot):
            group.update(sender, model(1), 1, fleet_atomic=True, verify=False)
        assert not got
    host.stop()


def test_a_load_weights_host_with_keep_base_takes_deltas_and_fleet_atomic_updates():
    """WorkerHost(load_weights=..., keep_base=True) receives into a host copy: the
    trainer's deltas decode against it, and a fleet-atomic update's undo reads it
    back (its rollback reloads the previous version through load_weights)."""
    rng = np.random.default_rng(9)
    src = {"w": rng.standard_normal((256, 64)).astype(np.float16)}
    nbytes = src["w"].nbytes
    got = {}
    host = refit.WorkerHost("tcp", load_weights=lambda batch: got.update({k: v.copy() for k, v in batch}),
                            framework="numpy", timeout_ms=10000, keep_base=True)
    with pytest.raises(refit.InvalidArgumentError, match="keep_base= with tensors="):
        refit.WorkerHost("tcp", tensors={"w": np.zeros(4, np.float16)}, keep_base=True)
    with refit.Sender("tcp", timeout_ms=10000) as sender, \
            refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0, "delta": True})
        wire = []
        for version in (1, 2):
            bits = src["w"].reshape(-1).view(np.uint16)
            bits[rng.choice(bits.size, size=bits.size // 100, replace=False)] += 1
            result = group.update(sender, src, version, verify=False)
            wire.append(result["workers"][0]["stats"]["wire_bytes"] / nbytes)
            assert got["w"].tobytes() == src["w"].tobytes()
        assert wire[0] >= 1.0 and wire[1] < 0.1, wire
        previous = src["w"].copy()
        src["w"] += 1
        group.update(sender, src, 3, verify=False, fleet_atomic=True)
        assert got["w"].tobytes() == src["w"].tobytes()
        assert group.call_all("rollback_weight_update")[0]["weight_version"] == 2
        assert got["w"].tobytes() == previous.tobytes()
    host.stop()


def test_a_worker_that_holds_other_weights_is_named():
    dest = {k: np.zeros_like(v) for k, v in model(0).items()}
    host = refit.WorkerHost("tcp", tensors=dest, timeout_ms=10000)
    host.add_method("corrupt", lambda params: (dest["head"].__setitem__((0, 0), 42.0), {})[1])
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([("127.0.0.1", host.port)], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        group.update(sender, model(1), 1)
        group.call_all("corrupt")
        diffs = group.fingerprint_differences(refit.fingerprints(model(1)), 1)
        assert len(diffs) == 1 and any("head" in line for line in diffs[0]), diffs
        with pytest.raises(refit.IntegrityError, match="head"):
            group.update(sender, model(2), 2, expected={**refit.fingerprints(model(2)), "head": 1})
    sender.shutdown()
    host.stop()


def test_a_python_load_weights_worker_host_and_its_errors():
    got = {}

    def load(batch):
        for name, t in batch:
            if name == "head" and t.flat[0] > 1e9:
                raise ValueError("head is out of range")
            got[name] = t.copy()

    host = refit.WorkerHost("tcp", load_weights=load, framework="numpy", timeout_ms=10000)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        src = model(4)
        group.update(sender, src, 1, verify=False)
        assert all(got[k].tobytes() == src[k].tobytes() for k in src)
        bad = dict(src, head=np.full((32, 128), 1e10, dtype=np.float32))
        with pytest.raises(refit.ProcessingFailedError, match="head is out of range"):
            group.update(sender, bad, 2, verify=False)
        assert host.weight_info()["state"] == "dirty"
    sender.shutdown()
    host.stop()


def test_a_worker_host_aborts_the_session_of_a_silent_trainer():
    """A trainer that stops talking after its chunk (frozen) loses its session after
    session_timeout_ms; staged, the worker keeps its old weights and version."""
    failed = []
    aborted = threading.Event()

    def on_failed(reason):
        failed.append(reason)
        aborted.set()

    host = refit.WorkerHost("tcp", load_weights=lambda batch: None, framework="numpy", timeout_ms=10000,
                            commit="staged", session_timeout_ms=300, on_update_failed=on_failed)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        group.update(sender, model(1), 1, verify=False)
        group.call_all("start_weight_update")
        src = model(2)
        send = Background(sender.send_weights, src)
        group.call_all("update_weights", {"update_info": dict(refit.describe(src), commit="staged")})
        send.join()
        assert aborted.wait(timeout=5), "the silent trainer kept its session"
        info = host.weight_info()
        assert not info["session_active"], info
        assert info["state"] == "clean" and info["weight_version"] == 1, info
        assert "sent nothing for" in info["last_error"], info
        assert info["last_error_kind"] == "timeout", info
        assert failed and "sent nothing for" in failed[-1]
        # The kind is a field of the reason (a str), never parsed from its text.
        reason = failed[-1]
        assert isinstance(reason, refit.UpdateFailure) and isinstance(reason, str), repr(reason)
        assert reason.kind == "timeout", repr(reason)
        error = reason.error()
        assert isinstance(error, refit.TimeoutError) and isinstance(error, TimeoutError), repr(error)
        assert error.kind == "timeout" and error.message == str(reason)
        with pytest.raises(refit.InvalidStateError, match="was aborted"):
            group.call_all("finish_weight_update", {"weight_version": 2})
        assert host.weight_info()["weight_version"] == 1
    sender.shutdown()
    host.stop()


def test_a_trainers_abort_names_the_kind_the_hook_receives():
    """abort_weight_update's "kind" reaches on_update_failed as reason.kind and
    weight_info as last_error_kind; without one, "cancelled"."""
    failed = []
    host = refit.WorkerHost("tcp", load_weights=lambda batch: None, framework="numpy", timeout_ms=10000,
                            commit="staged", on_update_failed=failed.append)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        group.call_all("start_weight_update")
        group.call_all("abort_weight_update", {"why": "x", "kind": "integrity_error"})
        assert len(failed) == 1, failed
        reason = failed[0]
        assert isinstance(reason, refit.UpdateFailure), repr(reason)
        assert reason.kind == "integrity_error", repr(reason)
        assert "the trainer aborted it: x" in reason, reason
        assert isinstance(reason.error(), refit.IntegrityError), repr(reason.error())
        info = host.weight_info()
        assert info["last_error_kind"] == "integrity_error", info
        group.call_all("start_weight_update")
        group.call_all("abort_weight_update", {"why": "y"})
        assert failed[-1].kind == "cancelled" and isinstance(failed[-1].error(), refit.CancelledError)
        assert host.weight_info()["last_error_kind"] == "cancelled"
        group.call_all("start_weight_update")
        with pytest.raises(refit.InvalidArgumentError, match="'kind' must name an error kind"):
            group.call_all("abort_weight_update", {"kind": "no_such_kind"})
        assert len(failed) == 2, failed
        group.call_all("abort_weight_update")
    sender.shutdown()
    host.stop()


def test_a_worker_another_worker_failed_learns_the_failures_kind():
    """A failed update aborts every other worker's session with the failure's kind:
    worker 0 staged its chunk, worker 1's stage bound refused it; worker 0's hook
    gets resource_exhausted as a field."""
    failed = []
    ok = refit.WorkerHost("tcp", load_weights=lambda batch: None, framework="numpy", timeout_ms=10000,
                          commit="staged", on_update_failed=failed.append)
    small = refit.WorkerHost("tcp", load_weights=lambda batch: None, framework="numpy", timeout_ms=10000,
                             commit="staged", max_stage_bytes=64)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{ok.port}", f"127.0.0.1:{small.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        with pytest.raises(refit.ResourceExhaustedError):
            group.update(sender, model(1), 1, verify=False, commit="staged")
    assert failed and failed[-1].kind == "resource_exhausted", [(str(f), f.kind) for f in failed]
    assert isinstance(failed[-1].error(), refit.ResourceExhaustedError)
    assert ok.weight_info()["last_error_kind"] == "resource_exhausted"
    sender.shutdown()
    ok.stop()
    small.stop()


def test_an_update_failure_is_a_str_with_its_kind():
    reason = refit.UpdateFailure("the weight update session was aborted: its owner ...", "peer_lost")
    assert reason == "the weight update session was aborted: its owner ..." and reason.startswith("the weight")
    assert reason.kind == "peer_lost"
    assert isinstance(reason.error(), refit.PeerLostError) and isinstance(reason.error(), ConnectionError)
    import copy
    import pickle
    for again in (pickle.loads(pickle.dumps(reason)), copy.copy(reason)):
        assert again == reason and again.kind == "peer_lost" and type(again) is refit.UpdateFailure
    assert "peer_lost" in repr(reason)
    assert refit.UpdateFailure("?", "not_a_kind").error().kind == "not_a_kind"


def test_a_worker_group_sends_deltas_and_a_worker_whose_tensors_changed_gets_the_update_full():
    """trainer_args "delta": True through a WorkerGroup (tcp star): after the first
    update each worker gets what changed; a worker whose tensors were written
    behind refit's back refuses the base and gets that update full. Every update
    verified by fingerprints on every worker."""
    rng = np.random.default_rng(5)
    src = {"w": rng.standard_normal((256, 64)).astype(np.float16),
           "b": rng.standard_normal(1000).astype(np.float16)}
    nbytes = sum(a.nbytes for a in src.values())
    dests = [{k: np.zeros_like(v) for k, v in src.items()} for _ in range(2)]
    hosts = [refit.WorkerHost("tcp", tensors=d, timeout_ms=10000) for d in dests]
    sender = refit.Sender("tcp", timeout_ms=10000)

    def step():  # about 1% of the elements move by one unit in the last place
        for a in src.values():
            bits = a.reshape(-1).view(np.uint16)
            at = rng.choice(bits.size, size=max(1, bits.size // 100), replace=False)
            bits[at] += 1

    with refit.WorkerGroup([f"127.0.0.1:{h.port}" for h in hosts], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0, "delta": True, "topology": "star"})
        wire = []
        for version in (1, 2, 3):
            if version > 1:
                step()
            result = group.update(sender, src, version)
            assert result["verified"], result
            wire.append([w["stats"]["wire_bytes"] / nbytes for w in result["workers"]])
        assert all(w >= 1.0 for w in wire[0]), wire  # no base yet: full
        assert all(w < 0.1 for row in wire[1:] for w in row), wire
        # Worker 1's model is reloaded behind refit's back (its record of the
        # version it holds still matches the trainer's offer).
        dests[1]["w"][:] = 0
        step()
        result = group.update(sender, src, 4)
        assert result["verified"], result
        got = [w["stats"]["wire_bytes"] / nbytes for w in result["workers"]]
        assert got[0] < 0.1 and got[1] >= 1.0, got
        for d in dests:
            assert all(d[k].tobytes() == src[k].tobytes() for k in src)
        # And it takes deltas again from the next update on.
        step()
        result = group.update(sender, src, 5)
        assert result["verified"] and all(w["stats"]["wire_bytes"] / nbytes < 0.1 for w in result["workers"])
        # One update forced full (delta=False), then deltas again.
        step()
        result = group.update(sender, src, 6, delta=False)
        assert result["verified"] and all(w["stats"]["wire_bytes"] >= nbytes for w in result["workers"]), result
        assert sender.last_send_info["delta"]["base_version"] == 0
        step()
        result = group.update(sender, src, 7, delta=True)
        assert result["verified"] and all(w["stats"]["wire_bytes"] / nbytes < 0.1 for w in result["workers"])
    sender.shutdown()
    for h in hosts:
        h.stop()


def test_a_delta_update_asked_of_a_sender_without_deltas_is_a_typed_error():
    """delta=True needs a sender prepared with "delta": True (tcp), or an engine
    that sends deltas at all: refused before any worker is told."""
    src = {"w": np.ones(64, dtype=np.float16)}
    dest = {"w": np.zeros(64, dtype=np.float16)}
    host = refit.WorkerHost("tcp", tensors=dest, timeout_ms=10000)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        with pytest.raises(refit.InvalidArgumentError, match="prepared without"):
            group.update(sender, src, 1, delta=True)
        # Nothing was started: the next update runs as usual.
        assert group.update(sender, src, 1, delta=False)["verified"]
    sender.shutdown()
    host.stop()


def test_a_producer_stream_is_checked_and_host_senders_take_a_raw_handle():
    # stream= orders a GPU sender's reads (tests/cuda/python_gpu_check.py proves it on a
    # GPU); a host sender refuses a stream object it cannot use, and takes a raw handle
    # (ignored by host engines) so code written for both runs on either.
    dests = [{k: np.zeros_like(v) for k, v in model(0).items()}]
    host = refit.WorkerHost("tcp", tensors=dests[0], timeout_ms=10000)
    sender = refit.Sender("tcp", timeout_ms=10000)
    with pytest.raises(refit.InvalidArgumentError, match="stream="):
        sender.send_weights(model(1), stream=object())
    with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
        group.connect()
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        with pytest.raises(refit.InvalidArgumentError, match="stream="):
            group.update(sender, model(1), 1, stream="side")
        result = group.update(sender, model(2), 2, stream=0)
        assert result["verified"]
        assert all(dests[0][k].tobytes() == model(2)[k].tobytes() for k in dests[0])
    sender.shutdown()
    host.stop()
