"""examples/torch_server, the fourth integration, as a user runs it: two server
processes, a trainer with refit's WorkerGroup, what is served compared token for
token with the trainer's own model, and a fleet-atomic update one server refuses."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import refit
import refit.integration

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = os.path.join(ROOT, "examples", "torch_server", "server.py")
sys.path.insert(0, os.path.dirname(SERVER))
import server as torch_server  # noqa: E402

PROMPT = [3, 1, 4]


def start(*flags):
    proc = subprocess.Popen([sys.executable, SERVER, "--port", "0", "--timeout-ms", "20000", *flags],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the server exited ({proc.wait()}) before saying where it listens"
    return proc, json.loads(line)


def http(port, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def served(port):
    return http(port, "/generate", {"tokens": PROMPT, "steps": 12})


def expected(model):
    return torch_server.generate(model, PROMPT, 12)


@pytest.fixture
def fleet():
    procs = []

    def make(*flags):
        proc, ports = start(*flags)
        procs.append(proc)
        return ports

    yield make
    for p in procs:
        p.terminate()
        p.wait(timeout=30)


def test_updates_serve_the_trainers_weights_token_for_token_and_fleet_atomic_ones_land_whole(fleet):
    a = fleet()
    # b's stage holds less than the model: it refuses a staged update before a byte moves.
    model_bytes = sum(p.numel() * p.element_size() for p in torch_server.TinyModel().parameters())
    b = fleet("--max-stage-bytes", str(model_bytes // 2))
    start_tokens = served(a["port"])
    assert start_tokens == {"tokens": expected(torch_server.TinyModel(seed=0)), "version": None}

    one, two, three = (torch_server.TinyModel(seed=s) for s in (1, 2, 3))
    assert expected(one) != expected(torch_server.TinyModel(seed=0)), "the seeds must serve different tokens"
    sender = refit.Sender("tcp", timeout_ms=20000)
    with refit.WorkerGroup([f"127.0.0.1:{a['refit_port']}"], timeout_ms=20000) as only_a:
        only_a.connect()
        only_a.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        # Fleet-atomic from the first update: the host copy was seeded at start.
        only_a.update(sender, one.named_parameters(), 1, verify=False, fleet_atomic=True)
        assert served(a["port"]) == {"tokens": expected(one), "version": 1}
        only_a.update(sender, two.named_parameters(), 2, verify=False)
        assert served(a["port"]) == {"tokens": expected(two), "version": 2}
    sender.shutdown()

    # Both servers, one of which refuses: neither serves version 3.
    sender = refit.Sender("tcp", timeout_ms=20000)
    with refit.WorkerGroup([f"127.0.0.1:{a['refit_port']}", f"127.0.0.1:{b['refit_port']}"],
                           timeout_ms=20000) as both:
        both.connect()
        both.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        with pytest.raises(refit.Error) as e:
            both.update(sender, three.named_parameters(), 3, verify=False, fleet_atomic=True)
        assert f"127.0.0.1:{b['refit_port']}" in str(e.value) and "no worker committed" in str(e.value), e.value
        assert "stage" in str(e.value), e.value  # b's refusal, named
    sender.shutdown()
    assert served(a["port"]) == {"tokens": expected(two), "version": 2}
    assert served(b["port"]) == {"tokens": expected(torch_server.TinyModel(seed=0)), "version": None}
    assert http(a["port"], "/health")["version"] == 2


def test_the_server_refuses_bad_requests_and_bad_options(fleet):
    a = fleet()
    with pytest.raises(urllib.error.HTTPError) as e:
        http(a["port"], "/generate", {"steps": 2})
    assert e.value.code == 400
    with pytest.raises(refit.InvalidArgumentError, match="torch_server: engine"):
        refit.integration.Options(engine="nope", owner="torch_server")
