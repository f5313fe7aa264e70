"""A small HTTP inference server of a torch module that takes refit updates.

The fourth integration, built from refit's integration parts only
(docs/integrations.md walks through it): a :class:`refit.integration.Options`
validated once, refit's :class:`refit.WorkerHost` on its own loop and threads, and
the module's parameters behind one lock that forward passes and the apply share.

* ``POST /generate`` ``{"tokens": [...], "steps": N}``: greedy continuation and the
  weight version that produced every token of it;
* ``GET /health``: ``{"version", "refit_port"}``.

Every update is staged: its bytes land in refit's stage while the server keeps
answering; only the apply takes the lock, between two forward passes. An update
that fails anywhere leaves the old weights and version. ``keep_base`` is a host
copy of the weights served (seeded at start), which a fleet-atomic update's undo
loads back: a trainer's ``WorkerGroup.update(..., fleet_atomic=True)`` lands on
every server or on none, from the first update on.

    python examples/torch_server/server.py --port 8000 --refit-port 4001
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

import refit
from refit.integration import Options


class TinyModel(torch.nn.Module):
    """Next-token logits from the last token: an embedding, a hidden layer, a head."""

    def __init__(self, vocab: int = 64, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def generate(model: torch.nn.Module, tokens: list[int], steps: int) -> list[int]:
    """Greedy continuation, one token per forward pass."""
    out = list(tokens)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor(out[-1:]))[-1].argmax()))
    return out[len(tokens):]


class Server:
    """The module, its version and refit's host; ``lock`` orders forward passes
    and applies."""

    def __init__(self, model: torch.nn.Module, options: Options, host: str, refit_port: int,
                 max_stage_bytes: int = 0) -> None:
        self.model, self.lock = model, threading.Lock()
        self.version: int | None = None
        self.params = dict(model.named_parameters())
        base = refit.HostCopy()  # what a fleet-atomic undo loads back: the weights served now
        base.seed({name: p.detach() for name, p in self.params.items()})
        self.refit = refit.WorkerHost(
            **options.replace(commit="staged").worker_args(), host=host, port=refit_port, load_weights=self._apply,
            keep_base=base, max_stage_bytes=max_stage_bytes, on_update_finished=self._finished)

    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """refit's load_weights, at the commit (or the undo) of a staged update:
        checked whole before the first copy, then copied under the lock."""
        for name, t in batch:
            p = self.params.get(name)
            if p is None or p.shape != t.shape or p.dtype != t.dtype:
                raise refit.InvalidArgumentError(f"torch_server: {name!r} {list(t.shape)} {t.dtype} is not a "
                                                 "parameter of the served model")
        with self.lock, torch.no_grad():
            for name, t in batch:
                self.params[name].copy_(t)

    def _finished(self, version: int, stats: dict) -> None:
        self.version = version

    def generate(self, tokens: list[int], steps: int) -> dict:
        with self.lock:  # one version for the whole answer
            return {"tokens": generate(self.model, tokens, steps), "version": self.version}


def handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/health":
                return self._reply(404, {"error": f"no route {self.path}"})
            self._reply(200, {"version": server.version, "refit_port": server.refit.port})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                tokens, steps = [int(t) for t in req["tokens"]], int(req.get("steps", 1))
            except (ValueError, KeyError, TypeError) as e:
                return self._reply(400, {"error": f"expected {{\"tokens\": [int], \"steps\": int}}: {e}"})
            self._reply(200, server.generate(tokens, steps))

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--refit-port", type=int, default=0)
    ap.add_argument("--engine", default="tcp")
    ap.add_argument("--timeout-ms", type=int, default=60000)
    ap.add_argument("--auth-secret-file")
    ap.add_argument("--seed", type=int, default=0, help="the served model's initial weights")
    ap.add_argument("--max-stage-bytes", type=int, default=0, help="bound on the stage (0: none)")
    a = ap.parse_args()
    options = Options(engine=a.engine, timeout_ms=a.timeout_ms, auth_secret_file=a.auth_secret_file,
                      owner="torch_server")
    server = Server(TinyModel(seed=a.seed), options, a.host, a.refit_port, a.max_stage_bytes)
    http = ThreadingHTTPServer((a.host, a.port), handler(server))
    print(json.dumps({"port": http.server_address[1], "refit_port": server.refit.port}), flush=True)
    try:
        http.serve_forever()
    finally:
        server.refit.stop()


if __name__ == "__main__":
    main()
