"""The ``vllm serve`` the tests of this folder share (``served``): started once
per session (a minute or more here), served with refit's backend and with
fault_extension's worker extension (refit's fleet verbs, plus a switch that makes
the next load fail), stopped at the end, and checked to have stayed up; and
test_fleet.py's second replica, started beside test_serve.py's tests."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve import Server, make_model  # noqa: E402

# Served with this worker extension: refit's RefitWorkerExtension and a fault switch.
EXTENSION = ["--worker-extension-cls", "fault_extension.FaultExtension"]
# The shared servers' tensor-parallel ranks (REFIT_VLLM_SERVE_TP; CI runs test_serve.py
# and test_fleet.py at 1 and at 2), one per core here.
RANKS = int(os.environ.get("REFIT_VLLM_SERVE_TP") or "1")
TP_ARGS = ["--tensor-parallel-size", str(RANKS)] if RANKS > 1 else []


def server_env(secret: str) -> dict[str, str]:
    """What every server of these tests runs with: the shared auth secret, this
    folder on the path (the worker extension), UCX's tcp on loopback."""
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    env = {"REFIT_AUTH_SECRET_FILE": secret, "UCX_NET_DEVICES": "lo", "PYTHONPATH": path}
    if RANKS > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(RANKS))
    return env


def fleet_replica(model: str, log: str, secret: str) -> Server:
    """test_fleet.py's second replica: the shared server's model, secret and extension."""
    return Server(model, log + ".fleet", env=server_env(secret), extra_args=EXTENSION + TP_ARGS)


@pytest.fixture(scope="session")
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_serve")
    model = make_model(os.environ.get("REFIT_VLLM_SERVE_MODEL") or str(root / "model"))
    secret = root / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    wrong = root / "wrong-secret"
    wrong.write_bytes(os.urandom(32))
    wrong.chmod(0o600)
    log = os.environ.get("REFIT_VLLM_SERVE_LOG") or str(root / "vllm_serve.log")
    server = Server(model, log, env=server_env(str(secret)), extra_args=EXTENSION + TP_ARGS)
    server.start()
    # test_fleet.py's second replica starts now, beside test_serve.py's tests: a
    # start is a minute of imports on one core, and those tests leave a core idle.
    ahead = None
    if any(item.module.__name__.endswith("test_fleet") for item in request.session.items):
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-serve-fleet")
        ahead = pool.submit(fleet_replica(model, log, str(secret)).start)
        pool.shutdown(wait=False)
    try:
        yield {"server": server, "model": model, "secret": str(secret), "wrong_secret": str(wrong), "log": log,
               "fleet_replica": ahead, "ranks": RANKS}
    finally:
        alive = server.alive()
        server.stop()
        if ahead is not None:  # not taken (test_fleet.py did not run): stop it
            try:
                ahead.result().stop()
            except Exception:  # noqa: BLE001 - it failed to start: test_fleet.py reported it
                pass
        assert alive, f"vllm serve died during the tests; see {log}"
