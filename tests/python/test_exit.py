"""At interpreter exit, refit's objects that hold Python callables are released in
order: no nanobind "leaked instances" report, whatever the user left alive."""

import subprocess
import sys
import textwrap

import pytest

CASES = {
    "a worker host with a load_weights lambda": """
        import refit
        h = refit.WorkerHost("tcp", load_weights=lambda batch: None, on_update_failed=lambda reason: None)
        h.add_method("ping", lambda params: {"pong": True})
    """,
    "an engine with a check_update and a group and sender never closed": """
        import refit
        e = refit.Engine("tcp", check_update=lambda info: None)
        s = refit.Sender("tcp")
        g = refit.WorkerGroup(["127.0.0.1:1"])
    """,
    "a host that took an update, left running": """
        import refit, numpy as np
        got = []
        h = refit.WorkerHost("tcp", load_weights=lambda batch: got.extend(n for n, _ in batch), framework="numpy")
        s = refit.Sender("tcp")
        g = refit.WorkerGroup([f"127.0.0.1:{h.port}"])
        g.connect()
        g.init(s, {"master_address": "127.0.0.1", "master_port": 0})
        g.update(s, {"w": np.ones(4, dtype=np.float32)}, 1, verify=False)
        assert got == ["w"], got
    """,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_leak_report_at_exit(name):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CASES[name])], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leaked" not in out.stderr, out.stderr[-2000:]
