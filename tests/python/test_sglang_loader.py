"""refit.sglang's server side without SGLang: the loader check on meta tensors,
all or nothing at apply (a load that raises restores what it touched), rollback,
tickets that never raise into SGLang's scheduler. The real server:
tests/sglang (CI's sglang section)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import refit.sglang  # noqa: E402
from refit.sglang import _server  # noqa: E402


def _copy(param, loaded, shard=None):
    """SGLang's default_weight_loader: the shapes must match."""
    assert param.shape == loaded.shape, f"{tuple(param.shape)} vs {tuple(loaded.shape)}"
    param.data.copy_(loaded)


class Stacked(torch.nn.Module):
    """A model whose loader stacks q/k into one parameter, ties its head to its
    embedding, skips what it does not know (as SGLang's Llama does) and raises
    on "boom" (after writing what came before)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.qk = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.qk.weight_loader = self._qk_loader
        self.head = self.embed  # tied: state_dict has "head", named_parameters does not

    def _qk_loader(self, param, loaded, shard):
        rows = param.data.narrow(0, 0 if shard == "q" else 4, 4)
        assert rows.shape == loaded.shape, f"{tuple(rows.shape)} vs {tuple(loaded.shape)}"
        rows.copy_(loaded)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            if name == "boom":
                raise RuntimeError("boom")
            if name in ("q", "k"):
                p = params["qk"]
                p.weight_loader(p, t, name)
            elif name in params:
                getattr(params[name], "weight_loader", _copy)(params[name], t)


def check(model, tensors):
    info = refit.describe(tensors)
    return _server.loader_problems(model, info["names"], info["dtype_names"], info["shapes"])


def test_the_check_runs_the_models_loader_on_meta_tensors_and_writes_nothing():
    m = Stacked()
    good = [("embed", torch.ones(6, 4)), ("q", torch.ones(4, 4)), ("k", torch.ones(4, 4)), ("head", torch.ones(6, 4))]
    problems, touches = check(m, good)
    assert problems == []
    assert touches == {"embed": ["embed"], "q": ["qk"], "k": ["qk"]}  # "head": the tied alias, loaded by nobody
    assert m.embed.abs().sum() == 0 and m.qk.abs().sum() == 0, "the check wrote the model"
    assert "weight_loader" not in vars(m.embed) and vars(m.qk)["weight_loader"] == m._qk_loader, "loaders restored"


def test_the_check_names_an_unknown_tensor_a_wrong_shape_and_a_loader_that_raises():
    m = Stacked()
    problems, _ = check(m, [("bogus.weight", torch.ones(2)), ("q", torch.ones(3, 4)), ("embed", torch.ones(6, 5))])
    text = "\n".join(problems)
    assert "bogus.weight: the model's loader takes it into no parameter" in text
    assert "q: shape [3, 4] does not fit parameter 'qk'" in text
    assert "embed: shape [6, 5] does not fit parameter 'embed'" in text
    problems, _ = check(m, [("embed", torch.ones(6, 4)), ("boom", torch.ones(1))])
    assert any(p.startswith("boom: the model's load_weights raised RuntimeError") for p in problems), problems


def tickets(model, *ops):
    """Runs tickets as SGLang would call the loader; returns their outcomes."""
    outs = []
    for op in ops:
        tid = f"t{len(outs)}"
        refit.sglang.load_weights(model, [("refit:" + json.dumps({"id": tid, **op}), torch.empty(0))])
        outs.append(_server._RANK._outcome({"ticket": tid})["outcome"])
    return outs


def stage(version, tensors):
    """What a whole update leaves on the rank (the host's hooks, as refit calls them)."""
    r = _server._RANK
    r._started()
    r._received(tensors)
    r._finished(version)


def test_apply_is_all_or_nothing_and_rollback_restores_the_last_apply():
    m = Stacked()
    new = [("embed", torch.full((6, 4), 2.0)), ("q", torch.full((4, 4), 3.0))]
    (chk,) = tickets(m, {"op": "check", "update_info": refit.describe(new)})
    assert chk["ok"], chk
    stage(7, new)
    (app,) = tickets(m, {"op": "apply", "version": 7})
    assert app["ok"] and app["parameters"] == 2, app
    assert m.embed[0, 0] == 2 and m.qk[0, 0] == 3 and m.qk[4, 0] == 0

    # A load that raises after writing "embed": "embed" is restored, nothing holds 8.
    bad = [("embed", torch.full((6, 4), 8.0)), ("boom", torch.ones(1))]
    _server._RANK.touches = {"embed": ["embed"]}  # what a passing check would have recorded
    stage(8, bad)
    (app,) = tickets(m, {"op": "apply", "version": 8})
    assert not app["ok"] and "restored" in app["error"], app
    assert m.embed[0, 0] == 2, "a failed apply left a tensor written"

    # Another rank failed its apply of 9: this one rolls back to what it served.
    stage(9, [("q", torch.full((4, 4), 5.0))])
    _server._RANK.touches = {"q": ["qk"]}
    (app,) = tickets(m, {"op": "apply", "version": 9})
    assert app["ok"] and m.qk[0, 0] == 5
    (rb,) = tickets(m, {"op": "rollback"})
    assert rb["ok"] and rb["restored"] == 1 and m.qk[0, 0] == 3


def test_an_update_that_did_not_arrive_whole_is_never_applied_and_nothing_raises():
    m = Stacked()
    r = _server._RANK
    r._started()
    r._received([("embed", torch.full((6, 4), 4.0))])
    r._failed()  # the trainer died mid-transfer
    (app,) = tickets(m, {"op": "apply", "version": 10})
    assert not app["ok"] and "no whole update at version 10" in app["error"]
    assert m.embed.abs().sum() == 0
    # Unknown ops and malformed tickets are outcomes, never exceptions into SGLang.
    (odd,) = tickets(m, {"op": "nope"})
    assert not odd["ok"] and "unknown op" in odd["error"]
    refit.sglang.load_weights(m, [("refit:{not json", torch.empty(0))])
    refit.sglang.load_weights(m, [("embed", torch.ones(6, 4))])  # not a ticket: logged, not loaded
    assert m.embed.abs().sum() == 0


def test_the_client_refuses_bad_arguments_before_any_call():
    with pytest.raises(refit.InvalidArgumentError, match="url"):
        refit.sglang.Client("server:30000")
    with pytest.raises(refit.InvalidArgumentError, match="timeout_ms"):
        refit.sglang.Client("http://127.0.0.1:1", timeout_ms=0)
    with pytest.raises(refit.InvalidArgumentError, match="engine"):
        refit.sglang.Client("http://127.0.0.1:1", engine="nope")
    # Nothing listens there: a typed error within the deadline, naming the server.
    with pytest.raises(refit.PeerLostError, match="127.0.0.1:1"):
        refit.sglang.Client("http://127.0.0.1:1", timeout_ms=2000).connect()


def test_a_client_lost_with_generation_paused_is_resumed_by_the_rank_at_its_deadline():
    import http.server
    import threading
    import time

    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            calls.append((self.path, self.headers.get("Authorization"), time.monotonic()))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    rank = _server._RANK
    try:
        # Armed, then disarmed in time (the client resumed generation itself): no call.
        rank._guard({"arm": True, "ms": 200, "url": url})
        rank._guard({"arm": False})
        time.sleep(0.4)
        assert calls == []
        # Armed and never disarmed (the client was lost): resumed at the deadline.
        t0 = time.monotonic()
        rank._guard({"arm": True, "ms": 200, "url": url, "api_key": "k"})
        for _ in range(100):
            if calls:
                break
            time.sleep(0.02)
        assert [(p, a) for p, a, _ in calls] == [("/continue_generation", "Bearer k")]
        assert 0.15 < calls[0][2] - t0 < 1.5
    finally:
        server.shutdown()
