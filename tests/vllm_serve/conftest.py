"""The ``vllm serve`` the tests of this folder share (``served``): started once
per session (a minute or more here), served with refit's backend and with
fault_extension's worker extension (refit's fleet verbs, plus a switch that makes
the next load fail), stopped at the end, and checked to have stayed up."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve import Server, make_model  # noqa: E402

# Served with this worker extension: refit's RefitWorkerExtension and a fault switch.
EXTENSION = ["--worker-extension-cls", "fault_extension.FaultExtension"]


def server_env(secret: str) -> dict[str, str]:
    """What every server of these tests runs with: the shared auth secret, this
    folder on the path (the worker extension), UCX's tcp on loopback."""
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    return {"REFIT_AUTH_SECRET_FILE": secret, "UCX_NET_DEVICES": "lo", "PYTHONPATH": path}


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_serve")
    model = make_model(os.environ.get("REFIT_VLLM_SERVE_MODEL") or str(root / "model"))
    secret = root / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    wrong = root / "wrong-secret"
    wrong.write_bytes(os.urandom(32))
    wrong.chmod(0o600)
    log = os.environ.get("REFIT_VLLM_SERVE_LOG") or str(root / "vllm_serve.log")
    server = Server(model, log, env=server_env(str(secret)), extra_args=EXTENSION)
    server.start()
    try:
        yield {"server": server, "model": model, "secret": str(secret), "wrong_secret": str(wrong), "log": log}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"vllm serve died during the tests; see {log}"
