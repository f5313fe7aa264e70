"""refit's engines from Python: round trips, zero-copy views, errors, deadlines, the GIL."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import refit
from conftest import Background, Recorder, connect, transfer

try:
    import torch
except ImportError:  # numpy-only venvs run the numpy tests
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed in this venv")


def numpy_model():
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((64, 16), dtype=np.float32),
        "layer.0.bias": rng.standard_normal(16).astype(np.float64),
        "layer.0.half": rng.standard_normal((3, 5, 7)).astype(np.float16),
        "ids": rng.integers(-2**40, 2**40, size=33, dtype=np.int64),
        "mask": rng.integers(0, 2, size=(4, 4)).astype(np.bool_),
        "bytes": rng.integers(0, 255, size=1000, dtype=np.uint8),
        "small.int8": rng.integers(-100, 100, size=9, dtype=np.int8),
        "small.int16": rng.integers(-1000, 1000, size=9, dtype=np.int16),
        "small.int32": rng.integers(-10**6, 10**6, size=9, dtype=np.int32),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


# The host-memory engines of the default wheel: tcp, and ucx (UCX picks shared
# memory here: one-sided puts into the worker's registered staging).
HOST_BACKENDS = ["tcp", "ucx"]


def test_backends_lists_the_built_in_engines():
    assert {"tcp", "loopback", "ucx"} <= set(refit.backends())


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_numpy_round_trip_of_mixed_dtypes_and_shapes(backend):
    src = numpy_model()
    with refit.Sender(backend, timeout_ms=10000) as sender:
        engine = refit.Engine(backend, timeout_ms=10000, framework="numpy")
        connect(sender, [engine])
        rec = Recorder()
        transfer(sender, [engine], src, rec)
        assert set(rec.got) == set(src)
        for name, a in src.items():
            b = rec.got[name]
            assert b.dtype == a.dtype and b.shape == a.shape, name
            assert a.tobytes() == b.tobytes(), name
        stats = engine.last_update_stats
        assert stats["tensors"] == len(src)
        assert stats["bytes"] == sum(a.nbytes for a in src.values())


@needs_torch
def test_torch_round_trip_bf16_fp8_and_parameters_that_require_grad():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)  # requires_grad parameters
    src = dict(layer.named_parameters())
    src["h"] = torch.randn(5, 3, dtype=torch.float16)
    src["i64"] = torch.arange(10, dtype=torch.int64)
    src["flag"] = torch.tensor([True, False, True])
    fp8 = [d for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)]
    for d in fp8:
        src[d] = torch.randn(4, 8).to(getattr(torch, d))
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, framework="torch")
        connect(sender, [engine])
        rec = Recorder()
        transfer(sender, [engine], src, rec)
        for name, a in src.items():
            b = rec.got[name]
            assert isinstance(b, torch.Tensor)
            assert b.dtype == a.dtype and b.shape == a.shape, name
            assert torch.equal(a.detach().view(torch.uint8), b.view(torch.uint8)), name
    meta = refit.describe(src)
    assert meta["dtype_names"][0] == "bfloat16"
    for d in fp8:
        assert d in meta["dtype_names"]


@needs_torch
def test_load_weights_gets_views_of_refits_memory_not_copies():
    src = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    seen = []

    def load(batch):
        for _name, t in batch:
            seen.append((t.data_ptr(), t.is_contiguous(), t.device.type))

    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000)
        connect(sender, [engine], buffer_bytes=1 << 20, num_buffers=2)
        transfer(sender, [engine], src, load)
        transfer(sender, [engine], src, load)
    # Both updates were handed views of the engine's staging slots (two buffers),
    # not fresh allocations per call.
    assert len(seen) == 2 and all(c and d == "cpu" for _, c, d in seen)
    assert len({p for p, _, _ in seen}) <= 2


def test_ucx_reports_what_ucx_chose_and_refuses_transports_it_did_not():
    """The ucx engine's state says which transports carry the data (shared memory
    here, with one-sided puts); require_transports it cannot meet fails init on
    both sides, naming what UCX offered, instead of falling back silently."""
    src = {"w": np.arange(1 << 12, dtype=np.float32)}
    with refit.Sender("ucx", timeout_ms=10000) as sender:
        engine = refit.Engine("ucx", timeout_ms=10000, framework="numpy")
        assert engine.state()["transport"] is None
        connect(sender, [engine])
        transport = engine.state()["transport"]
        assert transport["rank"] == 1 and transport["mode"] in ("put", "tag")
        assert transport["transports"], transport
        rec = Recorder()
        transfer(sender, [engine], src, rec)
        assert rec.got["w"].tobytes() == src["w"].tobytes()
        assert engine.last_update_stats["bytes"] == src["w"].nbytes
    with refit.Sender("ucx", timeout_ms=10000) as sender:
        engine = refit.Engine("ucx", timeout_ms=10000)
        info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
        accept = Background(sender.connect_workers)
        with pytest.raises(refit.UnsupportedError, match="require_transports \\[rc_mlx5\\] not met"):
            engine.init(dict(info, rank_offset=1, require_transports=["rc_mlx5"]))
        with pytest.raises(refit.Error, match="require_transports"):
            accept.join()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_receive_straight_into_given_tensors_and_fingerprints(backend):
    src = numpy_model()
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    addresses = {k: v.ctypes.data for k, v in dest.items()}
    with refit.Sender(backend, timeout_ms=10000) as sender:
        engine = refit.Engine(backend, timeout_ms=10000, tensors=dest)
        connect(sender, [engine])
        transfer(sender, [engine], src)
        for k in src:
            assert dest[k].tobytes() == src[k].tobytes(), k
            assert dest[k].ctypes.data == addresses[k]
        assert engine.fingerprint() == refit.fingerprints(src)
        assert engine.fingerprint(["ids"]) == refit.fingerprints(src, ["ids"])


def test_an_update_that_does_not_fit_the_given_tensors_is_refused_before_a_byte_moves():
    src = numpy_model()
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    wrong = dict(src, **{"embed.weight": np.ones((64, 17), dtype=np.float32)})
    with refit.Sender("tcp", timeout_ms=5000) as sender:
        engine = refit.Engine("tcp", timeout_ms=5000, tensors=dest)
        connect(sender, [engine])
        with pytest.raises(refit.InvalidArgumentError, match="embed.weight"):
            transfer(sender, [engine], wrong)
        assert all(not d.any() for d in dest.values() if d.size and d.dtype != np.bool_)


def test_session_verbs_record_the_version():
    src = numpy_model()
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, tensors=dest)
        connect(sender, [engine])
        meta = refit.describe(src)
        engine.start_weight_update()
        send = Background(sender.send_weights, src)
        engine.update_weights(meta)
        send.join()
        engine.finish_weight_update(7)
        assert engine.weight_version == 7 and not engine.weights_dirty
        with pytest.raises(refit.InvalidStateError):
            engine.finish_weight_update(8)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_staged_session_lands_whole_at_finish_and_an_aborted_one_not_at_all(backend):
    """commit="staged": no load_weights runs during update_weights; finish calls each
    chunk's own load_weights, in order, then records the version; an aborted session
    (or one whose chunk failed) leaves the weights and the version as they were."""
    src = numpy_model()
    names = sorted(src)
    first = {k: src[k] for k in names[: len(names) // 2]}
    second = {k: src[k] for k in names[len(names) // 2:]}
    calls = []

    def loader(tag, into):
        def load(batch):
            calls.append(tag)
            for name, t in batch:
                into[name] = t.copy()
        return load

    got = {}
    with refit.Sender(backend, timeout_ms=10000) as sender:
        engine = refit.Engine(backend, timeout_ms=10000, commit="staged", framework="numpy")
        connect(sender, [engine])
        engine.start_weight_update()
        for tag, chunk in (("first", first), ("second", second)):
            send = Background(sender.send_weights, chunk)
            engine.update_weights(refit.describe(chunk), loader(tag, got))
            send.join()
            assert calls == [], "a staged chunk reached load_weights before finish_weight_update"
        assert engine.weight_version is None
        engine.finish_weight_update(3)
        assert calls == ["first", "second"]
        assert all(got[k].tobytes() == src[k].tobytes() for k in src)
        assert engine.weight_version == 3 and not engine.weights_dirty

        # Aborted after its chunk arrived: nothing reaches load_weights.
        calls.clear()
        engine.start_weight_update()
        send = Background(sender.send_weights, first)
        engine.update_weights(refit.describe(first), loader("aborted", {}))
        send.join()
        engine.abort_weight_update("the trainer went away")
        assert calls == []
        assert engine.weight_version == 3 and not engine.weights_dirty

        # A chunk that fails (the trainer sends other tensors) fails the session:
        # finish raises, records nothing, and nothing was loaded.
        engine.start_weight_update()
        other = {"elsewhere": np.zeros(7, dtype=np.float32)}
        send = Background(sender.send_weights, other)
        with pytest.raises(refit.Error):
            engine.update_weights(refit.describe(first), loader("failed", {}))
        with pytest.raises(refit.Error):
            send.join()
        with pytest.raises(refit.InvalidStateError, match="chunk 1 failed"):
            engine.finish_weight_update(4)
        assert calls == []
        assert engine.weight_version == 3 and not engine.weights_dirty


def test_a_staged_chunk_beyond_max_stage_bytes_is_refused_and_the_trainer_told_at_once():
    src = {"big": np.ones(4096, dtype=np.float32)}  # 16 KiB
    with refit.Sender("tcp", timeout_ms=30000) as sender:
        engine = refit.Engine("tcp", timeout_ms=30000, commit="staged", max_stage_bytes=4096, framework="numpy")
        connect(sender, [engine])
        engine.start_weight_update()
        t0 = time.monotonic()
        send = Background(sender.send_weights, src)
        with pytest.raises(refit.ResourceExhaustedError, match="max_stage_bytes 4096"):
            engine.update_weights(refit.describe(src), lambda batch: None)
        with pytest.raises(refit.ResourceExhaustedError, match="worker rank 1 refused the update"):
            send.join()
        assert time.monotonic() - t0 < 5, "the trainer waited for its deadline"
        engine.abort_weight_update()
        assert not engine.weights_dirty


def test_errors_are_exceptions_of_refits_kinds():
    with pytest.raises(refit.NotRegisteredError, match="available backends") as e:
        refit.Engine("no_such_backend")
    assert e.value.kind == "not_registered" and isinstance(e.value, LookupError)
    with pytest.raises(refit.InvalidArgumentError, match="commit"):
        refit.Engine("tcp", commit="sometimes")
    with pytest.raises(refit.InvalidArgumentError, match="complex"):
        refit.describe({"z": np.zeros(3, dtype=np.complex64)})
    with pytest.raises(refit.InvalidArgumentError, match="not contiguous"):
        refit.describe({"t": np.zeros((4, 4), dtype=np.float32).T})
    with pytest.raises(refit.InvalidArgumentError, match="no DLPack"):
        refit.describe({"l": [1, 2, 3]})
    engine = refit.Engine("tcp", timeout_ms=2000)
    with pytest.raises(refit.InvalidStateError):
        engine.receive({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}, lambda b: None)
    with pytest.raises(refit.InvalidArgumentError, match="master_address"):
        engine.init({"master_port": 1})


def test_the_first_divergent_parameter_is_named():
    src = numpy_model()
    declared = refit.describe(src)
    declared["shapes"][3] = [34]  # "ids"
    with refit.Sender("tcp", timeout_ms=5000) as sender:
        engine = refit.Engine("tcp", timeout_ms=5000, framework="numpy")
        connect(sender, [engine])
        send = Background(sender.send_weights, src, declared)
        with pytest.raises(refit.InvalidArgumentError, match="ids"):
            send.join()


class CustomError(Exception):
    pass


def test_an_exception_raised_in_load_weights_comes_back_as_itself():
    src = numpy_model()
    marker = CustomError("the model refused it")

    def load(batch):
        raise marker

    with refit.Sender("tcp", timeout_ms=5000) as sender:
        engine = refit.Engine("tcp", timeout_ms=5000, framework="numpy")
        connect(sender, [engine])
        meta = refit.describe(src)
        send = Background(sender.send_weights, src)
        with pytest.raises(CustomError) as e:
            engine.receive(meta, load)
            engine.drain()
        assert e.value is marker
        send.join()
        assert engine.weights_dirty


def test_a_blocking_call_releases_the_gil():
    # While the main thread waits in a receive (the trainer sends only after 0.3 s),
    # another Python thread keeps counting.
    src = {"w": np.ones(1 << 20, dtype=np.float32)}
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, framework="numpy")
        connect(sender, [engine])
        meta = refit.describe(src)

        def late_send():
            time.sleep(0.3)
            sender.send_weights(src)

        send = Background(late_send)
        counting = Background(count)
        before = counter[0]
        engine.receive(meta, lambda b: None)
        engine.drain()
        during = counter[0] - before
        stop.set()
        counting.join()
        send.join()
    assert during > 10000, f"the counting thread ran only {during} times during a 0.3 s receive"


TRAINER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import refit
    sender = refit.Sender("tcp", timeout_ms=int(sys.argv[1]))
    info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
    print(json.dumps(info), flush=True)
    sender.connect_workers()
    print("connected", flush=True)
    time.sleep(600)  # never sends: the test kills it, or the worker's deadline passes
""")


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "silent"])
def test_a_dead_or_silent_trainer_is_an_error_within_the_deadline(kill):
    import json

    timeout_ms = 3000
    # The trainer's timeout travels in its init_info: the worker's deadline is it.
    child = subprocess.Popen([sys.executable, "-c", TRAINER, str(timeout_ms)], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        assert info["timeout_ms"] == timeout_ms
        engine = refit.Engine("tcp", timeout_ms=60000, framework="numpy")
        engine.init(info)
        assert child.stdout.readline().strip() == "connected"
        meta = refit.describe({"w": np.zeros(1 << 20, dtype=np.float32)})
        if kill:
            threading.Timer(0.5, child.kill).start()
        start = time.monotonic()
        with pytest.raises((refit.PeerLostError, refit.TimeoutError)) as e:
            engine.receive(meta, lambda b: None)
            engine.drain()
        elapsed = time.monotonic() - start
        assert elapsed < timeout_ms / 1000 + 2, f"the failure took {elapsed:.1f} s"
        if kill:
            assert isinstance(e.value, refit.PeerLostError), e.value
            assert elapsed < 2.5
        else:
            assert isinstance(e.value, refit.TimeoutError), e.value
            assert elapsed >= timeout_ms / 1000 * 0.9
    finally:
        child.kill()
        child.wait()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_and_reference_counts_stay_flat_over_100_updates():
    src = {f"t{i}": np.full(1 << 14, i, dtype=np.float32) for i in range(32)}  # 2 MiB
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    sink = {}

    def load(batch):
        for name, t in batch:
            sink[name] = float(t[0])

    with refit.Sender("tcp", timeout_ms=10000) as sender:
        direct = refit.Engine("tcp", timeout_ms=10000, tensors=dest)
        viewed = refit.Engine("tcp", timeout_ms=10000, framework="numpy")
        connect(sender, [direct, viewed])
        meta = refit.describe(src)

        def one():
            send = Background(sender.send_weights, src, meta)
            a = Background(lambda: (direct.receive(meta), direct.drain()))
            b = Background(lambda: (viewed.receive(meta, load), viewed.drain()))
            a.join(), b.join(), send.join()

        for _ in range(10):
            one()
        gc.collect()
        refs = [sys.getrefcount(v) for v in src.values()] + [sys.getrefcount(v) for v in dest.values()]
        objects = len(gc.get_objects())
        rss = rss_bytes()
        for _ in range(100):
            one()
        gc.collect()
        assert [sys.getrefcount(v) for v in src.values()] + [sys.getrefcount(v) for v in dest.values()] == refs
        grown = len(gc.get_objects()) - objects
        assert grown < 200, f"{grown} more Python objects after 100 updates"
        growth = rss_bytes() - rss
        assert growth < 8 << 20, f"RSS grew {growth / 2**20:.1f} MiB over 100 updates"
        assert sink == {k: float(v[0]) for k, v in src.items()}
        assert direct.fingerprint() == refit.fingerprints(src)


def test_auth_secret_files_must_agree(tmp_path):
    good = tmp_path / "secret"
    good.write_text("correct horse battery staple\n")
    good.chmod(0o600)
    other = tmp_path / "other"
    other.write_text("a different secret entirely\n")
    other.chmod(0o600)
    src = {"w": np.arange(10, dtype=np.float32)}
    with refit.Sender("tcp", timeout_ms=5000, auth_secret_file=str(good)) as sender:
        engine = refit.Engine("tcp", timeout_ms=5000, auth_secret_file=str(good), framework="numpy")
        connect(sender, [engine])
        rec = Recorder()
        transfer(sender, [engine], src, rec)
        assert rec.got["w"].tobytes() == src["w"].tobytes()
    with refit.Sender("tcp", timeout_ms=3000, auth_secret_file=str(good)) as sender:
        engine = refit.Engine("tcp", timeout_ms=3000, auth_secret_file=str(other), framework="numpy")
        with pytest.raises(refit.AuthError):
            connect(sender, [engine])
    loose = tmp_path / "loose"
    loose.write_text("readable by everyone\n")
    loose.chmod(0o644)
    with pytest.raises(refit.Error, match="0600|mode|permission"):
        refit.Sender("tcp", auth_secret_file=str(loose))


def test_checksummed_updates_round_trip():
    src = numpy_model()
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engines = [refit.Engine("tcp", timeout_ms=10000, framework="numpy") for _ in range(2)]
        info = connect(sender, engines, checksums=True)
        assert info["checksums"] is True
        recs = [Recorder(), Recorder()]
        meta = refit.describe(src)
        send = Background(sender.send_weights, src, meta)
        receivers = [Background(lambda e=e, r=r: (e.receive(meta, r), e.drain())) for e, r in zip(engines, recs)]
        for t in receivers + [send]:
            t.join()
        for r in recs:
            assert all(r.got[k].tobytes() == src[k].tobytes() for k in src)


@needs_torch
def test_a_sender_reads_every_tensor_afresh_each_update():
    # The sender remembers the last update's tensors to hand the next one over
    # faster; a parameter given new memory, a new dtype or shape must still be sent
    # as it is now.
    layer = torch.nn.Linear(8, 4)
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, framework="torch")
        connect(sender, [engine])
        for step in range(4):
            if step == 1:
                with torch.no_grad():
                    layer.weight.add_(1)  # in place: same memory
            if step == 2:
                layer.weight.data = torch.full((4, 8), 5.0)  # new memory, same object
            if step == 3:
                layer.bias.data = torch.arange(6, dtype=torch.float64)  # new dtype and shape
            rec = Recorder()
            transfer(sender, [engine], list(layer.named_parameters()), rec)
            for name, p in layer.named_parameters():
                assert rec.got[name].dtype == p.dtype and rec.got[name].shape == p.shape, (step, name)
                assert torch.equal(rec.got[name], p.detach()), (step, name)


def test_delta_updates_from_python_are_exact_and_send_less():
    """trainer_args "delta": True (tcp star): after the first update each one goes
    encoded against what the worker holds; every update lands exactly (bytes and
    fingerprints), and the worker's stats show how few bytes crossed the wire."""
    rng = np.random.default_rng(11)
    src = {"w": rng.integers(-30000, 30000, size=1 << 16, dtype=np.int16),
           "b": rng.integers(-30000, 30000, size=4096, dtype=np.int16)}
    dest = {k: np.zeros_like(v) for k, v in src.items()}
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, tensors=dest)
        connect(sender, [engine], delta=True)
        wire = []
        for step in range(3):
            if step:
                for a in src.values():  # about 1% of the elements move by one unit
                    at = rng.choice(a.size, size=max(1, a.size // 100), replace=False)
                    a[at] += 1
            transfer(sender, [engine], src)
            for k in src:
                assert dest[k].tobytes() == src[k].tobytes(), (step, k)
            assert engine.fingerprint() == refit.fingerprints(src)
            stats = engine.last_update_stats
            wire.append(stats["wire_bytes"] / stats["bytes"])
            d = sender.last_send_info["delta"]  # the trainer's side of it
            assert d["version"] == step + 1 and d["base_version"] == step, d
            assert (d["delta_workers"], d["full_fallbacks"]) == ((1, 0) if step else (0, 0)), d
            assert (d["encoded_buckets"] > 0) == (step > 0) and d["delta_bytes"] < d["full_bytes"], d
        assert wire[0] >= 1.0, wire  # the first update has no base: full
        assert all(w < 0.1 for w in wire[1:]), wire
    with refit.Sender("tcp", timeout_ms=10000) as plain:
        assert plain.last_send_info is None  # no deltas: nothing beyond the stats


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_keep_base_lets_a_worker_without_tensors_take_deltas(backend):
    """keep_base=True: the engine keeps a host copy of what it delivered (the
    model's load_weights sees views of it), and a delta trainer's updates decode
    against the copy, in place and staged; what the model is given is exact."""
    rng = np.random.default_rng(12)
    src = {"w": rng.integers(-30000, 30000, size=1 << 16, dtype=np.int16),
           "b": rng.integers(-30000, 30000, size=4096, dtype=np.int16)}
    got = Recorder()
    with refit.Sender(backend, timeout_ms=10000) as sender:
        engine = refit.Engine(backend, timeout_ms=10000, keep_base=True)
        connect(sender, [engine], delta=True)
        for step in range(4):
            if step:
                for a in src.values():
                    at = rng.choice(a.size, size=max(1, a.size // 100), replace=False)
                    a[at] += 1
            meta = refit.describe(src)
            if step < 3:
                transfer(sender, [engine], src, load_weights=got, metadata=meta)
            else:  # staged: the stage decodes against the copy, the commit refreshes it
                send = Background(sender.send_weights, src, meta)
                engine.receive(dict(meta, commit="staged"), got)
                send.join()
            for k in src:
                assert np.asarray(got.got[k]).tobytes() == src[k].tobytes(), (step, k)
            stats = engine.last_update_stats
            assert (stats["wire_bytes"] / stats["bytes"] < 0.1) == (step > 0), (step, stats)
            assert sender.last_send_info["delta"]["delta_workers"] == (1 if step else 0)
        engine.shutdown()
    with pytest.raises(refit.InvalidArgumentError, match="keep_base"):
        refit.Engine("tcp", keep_base=True, tensors={"w": np.zeros(4, dtype=np.int16)})


def test_a_fleet_atomic_session_votes_commits_and_rolls_back_through_its_host_copy():
    """The worker's verbs of a fleet-atomic update from Python, for a worker with
    its own load_weights (vLLM's shape): a HostCopy seeded with what the model
    serves makes even the first update undoable; prepare votes; the finish keeps
    the previous version; rollback loads it back through load_weights and records
    its version again. The HostCopy outlives the engine: a new engine undoes too."""
    served = {"w": np.arange(64, dtype=np.float32), "b": np.full(8, 3, dtype=np.int32)}
    new = {"w": np.arange(64, dtype=np.float32) * -1, "b": np.full(8, 9, dtype=np.int32)}
    model = {k: v.copy() for k, v in served.items()}

    def load(batch):
        for name, t in batch:
            model[name] = np.array(t, copy=True)

    base = refit.HostCopy()
    base.seed(served)
    assert base.bytes == sum(v.nbytes for v in served.values())
    for round_ in range(2):  # the second round: a new engine over the same copy
        with refit.Sender("tcp", timeout_ms=10000) as sender:
            engine = refit.Engine("tcp", timeout_ms=10000, commit="staged", framework="numpy", keep_base=base)
            connect(sender, [engine])
            engine.start_weight_update(fleet_atomic=True)
            send = Background(sender.send_weights, new)
            engine.update_weights(refit.describe(new), load)
            send.join()
            engine.prepare_weight_update()
            assert engine.state()["prepared"]
            with pytest.raises(refit.InvalidStateError, match="prepared"):
                engine.update_weights(refit.describe(new), load)
            engine.finish_weight_update(10 + round_)
            assert all(model[k].tobytes() == new[k].tobytes() for k in new)
            st = engine.state()
            assert st["holds_undo"] and st["weight_version"] == 10 + round_, st
            engine.rollback_weight_update()
            assert all(model[k].tobytes() == served[k].tobytes() for k in served), "the rollback did not load back"
            st = engine.state()
            assert not st["holds_undo"] and not st["weights_dirty"], st
            with pytest.raises(refit.InvalidStateError, match="no undo"):
                engine.rollback_weight_update()
            engine.shutdown()

    # A tensor the copy does not hold cannot be undone: refused before a byte moves.
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engine = refit.Engine("tcp", timeout_ms=10000, commit="staged", framework="numpy", keep_base=base)
        connect(sender, [engine])
        engine.start_weight_update(fleet_atomic=True)
        other = {"unseen": np.zeros(4, dtype=np.float32)}
        send = Background(sender.send_weights, other)
        with pytest.raises(refit.UnsupportedError, match="unseen"):
            engine.update_weights(refit.describe(other), load)
        with pytest.raises(refit.Error):
            send.join()
        engine.abort_weight_update("refused")
        assert "unseen" not in model
        engine.shutdown()


GC_ON_REFITS_LOOP = textwrap.dedent("""
    import gc, socket, sys, time
    import numpy as np
    import refit
    from conftest import connect, transfer

    # One of each refit object in a reference cycle: only the collector frees them.
    host = refit.WorkerHost("tcp", tensors={"w": np.zeros(4, dtype=np.float32)}, timeout_ms=5000)
    port = host.port
    group = refit.WorkerGroup([("127.0.0.1", port)], timeout_ms=5000)
    for obj in (host, group, refit.Engine("tcp", timeout_ms=5000), refit.Sender("tcp", timeout_ms=5000)):
        box = [obj]
        box.append(box)
    del host, group, obj, box
    gc.disable()  # the collection happens in the check, on refit's loop
    collected = []

    def check(info):
        collected.append(gc.collect())

    src = {"w": np.arange(4, dtype=np.float32)}
    with refit.Sender("tcp", timeout_ms=5000) as sender:
        engine = refit.Engine("tcp", timeout_ms=5000, framework="numpy", check_update=check)
        connect(sender, [engine])
        got = {}
        transfer(sender, [engine], src, lambda batch: got.update((n, t.copy()) for n, t in batch))
        assert collected and collected[0] > 0, collected
        assert got["w"].tolist() == [0, 1, 2, 3], got
        # The host's teardown, started on the loop, ends there: its port closes.
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "the collected WorkerHost still listens"
            time.sleep(0.05)
        engine.shutdown()
    print("ok", collected[0])
""")


def test_refit_objects_the_collector_frees_on_refits_loop_end_there():
    # A callback refit runs on its loop (check_update, hooks, load_weights) may
    # trigger a collection that frees other refit objects. Their teardown cannot
    # wait on the loop it runs on; it must start there and end later, never abort
    # the process (a vLLM worker's loader check aborted so).
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", GC_ON_REFITS_LOOP], cwd=here, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.stdout.startswith("ok"), out.stdout
