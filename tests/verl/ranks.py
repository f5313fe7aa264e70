"""verl's checkpoint-engine flow over real processes, as its CheckpointEngineManager
drives it: one process per actor and rollout rank, each holding the engine object
``CheckpointEngineRegistry.new("refit", ...)`` made once (``is_master`` on actor
ranks only), and a driver that calls prepare, build_topology, init_process_group,
send_weights / receive_weights and finalize on them every step, concurrently where
verl does (its ``ray.get`` over every rank).

Each rank answers commands over a pipe; a rollout's receive returns a SHA-256 of
every tensor it was yielded (copied as yielded: the views are refit's buffers), so
the driver checks every step byte for byte against the actor's tensors.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

BUCKET = 1 << 20  # verl's bucket_size: a 3 MiB tensor is larger than a chunk


def model(step: int) -> list[tuple[str, Any]]:
    """The actor's full tensors at ``step``: bf16 and fp32, one over a bucket."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    shapes = [("embed", (3 << 20) // 2 // 512, 512, torch.bfloat16)]
    shapes += [(f"layers.{i}.w", 256, 384, torch.bfloat16) for i in range(6)]
    shapes += [(f"layers.{i}.b", 384, 1, torch.float32) for i in range(6)]
    return [(n, torch.randn(r, c, generator=g).to(d).squeeze(-1)) for n, r, c, d in shapes]


def trajectory(step: int) -> list[tuple[str, Any]]:
    """model(0) with a few elements of every tensor changed per step (what deltas carry)."""
    out = []
    for name, t in model(0):
        t = t.clone()
        flat = t.view(-1)
        for k in range(1, step + 1):
            flat[(k * 7919) % flat.numel() :: max(1, flat.numel() // 8)] += k
        out.append((name, t))
    return out


def tensors_of(step: int, kind: str = "model") -> list[tuple[str, Any]]:
    return trajectory(step) if kind == "trajectory" else model(step)


def digests(tensors: list[tuple[str, Any]]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
            .hexdigest() for n, t in tensors}


def _serve(conn: Any, role: str, kwargs: dict, bucket_size: int, tensor_device: str | None) -> None:
    import asyncio
    import time

    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("refit.verl")  # what verl does with checkpoint_engine.custom_backend_module
    extra = {} if role == "rollout" else {"is_master": role == "master"}
    loop = asyncio.new_event_loop()
    try:
        engine = CheckpointEngineRegistry.new("refit", bucket_size=bucket_size, **extra, **kwargs)
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))

    async def generate(step: int, delay_s: float, kind: str):
        for name, t in tensors_of(step, kind):
            if delay_s:
                await asyncio.sleep(delay_s)
            yield name, (t if tensor_device is None else t.to(tensor_device))  # verl's generator: the actor's device

    kept: list[tuple[str, Any]] = []  # the benchmark's model (bench_model), made once
    plain: dict[str, Any] = {}  # the benchmark's baseline: refit's own host / group and sender

    async def generate_kept():
        for name, t in kept:
            yield name, t

    async def receive_only(step: int) -> dict:
        n = 0
        async for _, t in engine.receive_weights(global_steps=step):
            n += t.numel() * t.element_size()
        return {"bytes": n}

    async def receive(step: int) -> dict:
        got, devices = [], set()
        async for name, t in engine.receive_weights(global_steps=step):
            got.append((name, t.clone()))
            devices.add(str(t.device))
        return {"digests": digests(got), "order": [n for n, _ in got], "version": engine.weight_version,
                "devices": sorted(devices)}

    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "call":
                result = getattr(engine, args["method"])(**args.get("kwargs", {}))
            elif cmd == "attr":
                result = getattr(engine, args["name"])
            elif cmd == "send":
                t0 = time.monotonic()
                result = loop.run_until_complete(
                    engine.send_weights(generate(args["step"], args.get("delay_s", 0), args.get("kind", "model")),
                                        global_steps=args["step"]))
                result = {"stats": result, "seconds": time.monotonic() - t0}
            elif cmd == "receive":
                result = loop.run_until_complete(receive(args["step"]))
            # ---- the benchmark (tests/bench/verl_bench.py)
            elif cmd == "bench_model":
                import torch

                n, size = args["tensors"], args["bytes"] // args["tensors"] // 2
                kept[:] = [(f"layers.{i}.w", torch.full((size,), float(i % 7), dtype=torch.bfloat16)) for i in range(n)]
                result = sum(t.numel() * 2 for _, t in kept)
            elif cmd == "send_kept":
                t0 = time.monotonic()
                loop.run_until_complete(engine.send_weights(generate_kept(), global_steps=args["step"]))
                result = time.monotonic() - t0
            elif cmd == "receive_only":
                result = loop.run_until_complete(receive_only(args["step"]))
            elif cmd == "plain_host":  # rollout: refit's own WorkerHost, load_weights a no-op
                import refit

                plain["host"] = refit.WorkerHost(host="127.0.0.1", port=0, load_weights=lambda batch: None,
                                                 timeout_ms=args.get("timeout_ms", 60000))
                result = plain["host"].port
            elif cmd == "plain_update":  # master: refit's own WorkerGroup + Sender, the same tensors
                import refit

                if "group" not in plain:
                    plain["group"] = refit.WorkerGroup([f"127.0.0.1:{p}" for p in args["ports"]])
                    plain["sender"] = refit.Sender()
                    plain["group"].connect()
                    plain["group"].init(plain["sender"], {"master_address": "127.0.0.1", "master_port": 0,
                                                          **args.get("trainer_args", {})})
                t0 = time.monotonic()
                plain["group"].update(plain["sender"], kept, args["step"], verify=False)
                result = time.monotonic() - t0
            elif cmd == "exit":
                for k in ("group", "host"):
                    if k in plain:
                        plain[k].close() if k == "group" else plain[k].stop()
                if "sender" in plain:
                    plain["sender"].shutdown()
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc()}"))


_CONTEXT: Any = None


def _context() -> Any:
    """Rank processes fork from one forkserver that imported torch, verl and refit
    once: a spawned rank spent about 6 s of CPU importing them, most of this suite's
    time on 2 cores. Each rank is still a process of its own, made before any engine
    exists, as verl's Ray actors are."""
    global _CONTEXT
    if _CONTEXT is None and os.environ.get("REFIT_VERL_START") == "spawn":  # tests/verl/gpu_check.py: CUDA
        _CONTEXT = mp.get_context("spawn")
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "verl.checkpoint_engine.base", "verl.utils.import_utils", "refit",
                                         "ranks"])
    return _CONTEXT


class Rank:
    """One rank's process and its engine object."""

    def __init__(self, role: str, bucket_size: int = BUCKET, tensor_device: str | None = None, **kwargs: Any) -> None:
        """``tensor_device``: where the actor's generator yields its tensors (verl's
        are on the actor's GPU); the host by default. ``kwargs``: the engine's."""
        self.role = role
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, role, kwargs, bucket_size, tensor_device), daemon=True)
        self.proc.start()
        self._made: tuple | None = None  # its answer to the engine's construction (ranks start at once)

    @property
    def made(self) -> tuple:
        if self._made is None:
            self._made = self.wait(180)
        return self._made

    def post(self, cmd: str, **args: Any) -> None:
        assert self.made[0] == "ok", self.made
        self.conn.send((cmd, args))

    def wait(self, timeout_s: float = 60) -> tuple:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} rank {self.proc.pid}: no answer within {timeout_s} s")
        return self.conn.recv()

    def call(self, method: str, timeout_s: float = 60, **kwargs: Any) -> Any:
        self.post("call", method=method, kwargs=kwargs)
        answer = self.wait(timeout_s)
        if answer[0] != "ok":
            raise RuntimeError(f"{self.role}.{method}: {answer[1]}: {answer[2]}")
        return answer[1]

    def attr(self, name: str) -> Any:
        self.post("attr", name=name)
        return self.wait()[1]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.post("exit")
                self.wait(20)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


def step(actors: list[Rank], rollouts: list[Rank], number: int, *, delay_s: float = 0,
         during: Any = None, timeout_s: float = 120, kind: str = "model") -> dict:
    """One step of CheckpointEngineManager.update_weights: prepare everywhere,
    build_topology, init_process_group everywhere (at once), send on every actor
    while every rollout receives, finalize everywhere. ``during()`` runs once the
    transfer was posted (a fault). Returns each rank's answer to the transfer."""
    from refit.verl import RefitCheckpointEngine

    ranks = actors + rollouts
    metadata = [r.call("prepare") for r in ranks]
    actor_kwargs, rollout_kwargs = RefitCheckpointEngine.build_topology(len(actors), len(rollouts), metadata)
    for i, r in enumerate(actors):
        r.post("call", method="init_process_group", kwargs={k: v[i] for k, v in actor_kwargs.items()})
    for i, r in enumerate(rollouts):
        r.post("call", method="init_process_group", kwargs={k: v[i] for k, v in rollout_kwargs.items()})
    for r in ranks:
        answer = r.wait(timeout_s)
        if answer[0] != "ok":
            raise RuntimeError(f"{r.role}.init_process_group: {answer[1]}: {answer[2]}")
    for r in actors:
        r.post("send", step=number, delay_s=delay_s, kind=kind)
    for r in rollouts:
        r.post("receive", step=number)
    posted = time.monotonic()
    if during:
        during()
    out: dict[str, Any] = {"actors": [], "rollouts": []}
    silent = set()
    for kind, group in (("rollouts", rollouts), ("actors", actors)):
        for r in group:
            try:
                out[kind].append(r.wait(timeout_s))
            except (EOFError, ConnectionResetError):
                out[kind].append(("dead",))
            except TimeoutError:  # a stopped process: it answers nothing
                out[kind].append(("no answer",))
                silent.add(id(r))
        if kind == "rollouts":
            out["rollouts_s"] = time.monotonic() - posted  # when the last rollout answered
    for r in ranks:
        if r.proc.is_alive() and id(r) not in silent:
            r.call("finalize")
    return out
