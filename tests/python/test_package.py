"""refit as a Python package: its version, its exceptions, keyword arguments into
the extension, ``async with`` and what a worker given another's rank is told."""

import asyncio
import importlib.metadata
import importlib.util
import os
import pickle
import socket
import sys

import numpy as np
import pytest

import refit
from conftest import Background, Recorder, connect, transfer

PYTHON_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "python")
PYPROJECT = os.path.join(PYTHON_DIR, "pyproject.toml")
TRAINER_ARGS = {"master_address": "127.0.0.1", "master_port": 0}


def model(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((16, 8), dtype=np.float32), "b": rng.standard_normal(8).astype(np.float16)}


def build_wheel_module():
    """python/build_wheel.py, imported (its TOML reader)."""
    spec = importlib.util.spec_from_file_location("build_wheel", os.path.join(PYTHON_DIR, "build_wheel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_toml(text):
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)
    return build_wheel_module().read_toml(text)  # CPython 3.10: build_wheel.py's own reader


def test_the_version_is_pyprojects():
    with open(PYPROJECT, encoding="utf-8") as f:
        version = read_toml(f.read())["project"]["version"]
    assert refit.__version__ == version
    assert importlib.metadata.version("refit") == version


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib, the reference, is CPython 3.11+")
def test_build_wheels_toml_reader_reads_what_tomllib_reads():
    # build_wheel.py's reader for CPython 3.10 (no tomllib): pyproject.toml and the
    # TOML its docstring promises read as tomllib reads them; other TOML is refused.
    import tomllib

    read = build_wheel_module().read_toml
    with open(PYPROJECT, encoding="utf-8") as f:
        text = f.read()
    assert read(text) == tomllib.loads(text)
    sample = """
# a comment
[a]  # after a header
x = "q\\"u#o\\u00e9te"  # escapes, a # in a string
"y.z" = 'lit\\eral'
n = [1, -2, +3, 1_000, 0x1f,
  # in an array
  [true, false], "]" , ]
[a.b."c.d"]
k.l = "v"
[[t]]
m = 1
[[t]]
m = 2
[t.u]
v = []
"""
    assert read(sample) == tomllib.loads(sample)
    for other in ["x = 1.5", "x = {a = 1}", "x = 1979-05-27", "[a\nx = 1", "x", 'x = """\na\n"""', "x = inf"]:
        with pytest.raises(ValueError):
            read(other)


def test_every_error_kind_is_a_documented_class_in_all():
    kinds = set(refit._refit._errc_names())
    classes = [getattr(refit, n) for n in refit.__all__ if n.endswith("Error")]
    assert {c.kind for c in classes if c is not refit.Error} == kinds
    for cls in classes:
        assert issubclass(cls, refit.Error), cls
        assert cls.__doc__ and cls.__doc__.strip(), f"{cls.__name__} has no docstring"
        assert cls.__module__ == "refit" and getattr(refit, cls.__name__) is cls
        assert refit.error_class(cls.kind) is cls
    assert set(refit.__all__) <= set(dir(refit))
    assert issubclass(refit.TimeoutError, TimeoutError) and issubclass(refit.PeerLostError, ConnectionError)
    e = pickle.loads(pickle.dumps(refit.InvalidArgumentError("bad shape", "invalid_argument")))
    assert type(e) is refit.InvalidArgumentError and e.message == "bad shape" and e.kind == "invalid_argument"


def test_the_extension_takes_keyword_arguments():
    # The wrappers pass everything by keyword; so can anyone calling the extension.
    sender = refit._refit._Sender(backend="tcp", device="cpu", timeout_ms=5000, auth_secret_file=None,
                                  socket_buffer_bytes=0)
    with pytest.raises(TypeError):
        refit._refit._Sender(backend="tcp", device="cpu", timeout_ms=5000, auth_secret_file=None,
                             socket_buffer_bytes=0, no_such_argument=1)
    assert sender.prepare(trainer_args=dict(TRAINER_ARGS, world_size=2))["rank_offset"] == 1
    sender.shutdown()


def test_async_with_closes_engines_and_senders_on_the_way_out():
    src = model()

    async def main():
        async with refit.Sender("tcp", timeout_ms=10000) as sender, \
                refit.Engine("tcp", timeout_ms=10000, framework="numpy") as engine:
            info = sender.prepare(dict(TRAINER_ARGS, world_size=2))
            await asyncio.gather(sender.connect_workers_async(), engine.init_async(info))
            rec = Recorder()
            meta = refit.describe(src)
            await asyncio.gather(sender.send_weights_async(src, meta), engine.receive_async(meta, rec))
            await engine.drain_async()
            assert all(rec.got[k].tobytes() == src[k].tobytes() for k in src)
        return sender, engine

    sender, engine = asyncio.run(main())
    # Shut down: neither side moves another byte.
    with pytest.raises(refit.Error):
        sender.send_weights(src)
    with pytest.raises(refit.Error):
        engine.receive(refit.describe(src), lambda batch: None)


def test_async_with_closes_on_an_exception_and_lets_it_through():
    async def main():
        async with refit.Sender("tcp", timeout_ms=10000) as sender:
            sender.prepare(dict(TRAINER_ARGS, world_size=2))
            raise KeyError("from the body")
        return None

    with pytest.raises(KeyError, match="from the body"):
        asyncio.run(main())


def _refuses_connections(port):
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        return False


def test_async_with_stops_worker_hosts_and_closes_worker_groups():
    dest = {k: np.zeros_like(v) for k, v in model().items()}

    async def main():
        async with refit.WorkerHost("tcp", tensors=dest, timeout_ms=10000) as host, \
                refit.Sender("tcp", timeout_ms=10000) as sender:
            async with refit.WorkerGroup([f"127.0.0.1:{host.port}"], timeout_ms=10000) as group:
                await group.connect_async()
                await group.init_async(sender, TRAINER_ARGS)
                result = await group.update_async(sender, model(), 1)
                assert result["verified"]
            with pytest.raises(refit.Error):  # closed: no more calls to the workers
                await group.call_all_async("weight_info")
            assert host.weight_info()["weight_version"] == 1  # the host outlives the group
        return host.port

    port = asyncio.run(main())
    assert all(dest[k].tobytes() == v.tobytes() for k, v in model().items())
    assert _refuses_connections(port), "the WorkerHost still listens after its async with"


def test_two_workers_given_one_init_info_are_told_how_to_get_their_own_ranks():
    sender = refit.Sender("tcp", timeout_ms=5000)
    engines = [refit.Engine("tcp", timeout_ms=5000, framework="numpy") for _ in range(2)]
    info = sender.prepare(dict(TRAINER_ARGS, world_size=3))
    accept = Background(sender.connect_workers)
    inits = [Background(e.init, info) for e in engines]  # the same rank_offset for both: a mistake
    errors = []
    for t in inits:
        try:
            t.join()
        except refit.Error as e:
            errors.append(e)
    sender.shutdown()  # rank 2 never comes: stop waiting for it
    with pytest.raises(refit.Error):
        accept.join()
    refused = [str(e) for e in errors if "already connected" in str(e)]
    assert len(refused) == 1, errors
    message = refused[0]
    assert "rank 1 is already connected" in message, message
    assert "rank_offset" in message and "1 + i" in message, message
    for e in engines:
        e.shutdown()


def test_workers_given_their_own_rank_offsets_all_connect():
    # The fix the message above names, as conftest.connect does it.
    src = model(3)
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engines = [refit.Engine("tcp", timeout_ms=10000, framework="numpy") for _ in range(2)]
        connect(sender, engines)
        rec = Recorder()
        transfer(sender, engines, src, rec)
        assert set(rec.got) == set(src)
        for e in engines:
            e.shutdown()
