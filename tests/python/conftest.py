"""Shared helpers of the Python tests (run by ./refit test against the installed wheel)."""

import os
import threading

# UCX's tcp transport otherwise uses every interface this machine has (the ucx
# engine's tests stay on loopback); read when UCX makes its context.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import pytest

try:
    import refit  # noqa: F401
    HAVE_REFIT = True
except ImportError as e:  # pragma: no cover - only outside ./refit test
    if os.environ.get("REFIT_REQUIRE_PYTHON"):
        raise
    HAVE_REFIT = False
    WHY = f"the refit wheel is not installed ({e}); ./refit test builds and installs it"

if not HAVE_REFIT:
    collect_ignore_glob = ["test_*.py"]


class Background(threading.Thread):
    """Runs fn(*args) on a thread; join() returns its result or raises its exception."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self._call = (fn, args, kwargs)
        self._result = None
        self._error = None
        self.start()

    def run(self):
        fn, args, kwargs = self._call
        try:
            self._result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e

    def join(self, timeout=120):
        super().join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self._call[0]} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


def connect(sender, engines, **trainer_args):
    """Prepares `sender` for len(engines) workers and initialises each engine (rank 1 + i)."""
    args = {"master_address": "127.0.0.1", "master_port": 0, "world_size": len(engines) + 1}
    args.update(trainer_args)
    info = sender.prepare(args)
    accept = Background(sender.connect_workers)
    inits = []
    for i, engine in enumerate(engines):
        worker_info = dict(info, rank_offset=1 + i)
        inits.append(Background(engine.init, worker_info))
    for t in inits:
        t.join()
    accept.join()
    return info


def transfer(sender, engines, tensors, load_weights=None, metadata=None):
    """One update: the send on a thread, every engine's receive (and drain) on threads."""
    meta = metadata or refit.describe(tensors)
    send = Background(sender.send_weights, tensors, meta)

    def receive(engine):
        engine.receive(meta, load_weights)
        engine.drain()

    receivers = [Background(receive, e) for e in engines]
    errors = []
    for t in receivers + [send]:
        try:
            t.join()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if errors:
        raise errors[0]


class Recorder:
    """A load_weights that keeps a copy of every tensor it is given."""

    def __init__(self):
        self.got = {}
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        for name, tensor in batch:
            self.got[name] = tensor.clone() if hasattr(tensor, "clone") else tensor.copy()


@pytest.fixture
def recorder():
    return Recorder()
