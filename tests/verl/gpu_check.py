"""GPU check: refit.verl over refit's GPU engines (tests/cuda/gpu_steps.txt's
verl_gpu step; tests/verl/test_verl.py runs it too, and skips with its reason
where there is no GPU).

  python3 tests/verl/gpu_check.py

verl's flow as in tests/verl (ranks.py: one process per rank, driven as verl's
CheckpointEngineManager does), with the actor's generator yielding CUDA tensors as
verl's does:
- cuda_ipc (one GPU is enough: every rank on it, each a process of its own):
  1 actor to 2 rollouts for three steps on the same engine objects, every tensor
  byte for byte, in the actor's order, yielded on the rollout's GPU, one topology
  built; what the GPU engines cannot do (checksums, staged, topology, delta)
  refused at construction naming the option; a killed sender fails every
  rollout's receive within the deadline and a restarted one takes the next step;
- nccl (one GPU per rank: two or more GPUs): 1 actor to 1 rollout, two steps byte
  for byte; with one GPU the JSON says it did not run and why.
Prints PASS/FAIL lines and, last, one JSON line; exit status 0 only if every check
that ran passed. Without torch, a GPU or a CUDA build of refit with these engines
it prints {"skipped": true, "reason": ...} and exits 0.

Where verl is not installed (the GPU machine), tests/verl/standin stands in for
the four names of verl's refit.verl and ranks.py import (its README says what that
does and does not prove)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OPTS = {"address": "127.0.0.1", "buffer_bytes": 256 << 10, "timeout_ms": 5000}


def unavailable() -> str | None:
    """Why this check cannot run here, or None."""
    try:
        import torch
    except ImportError as e:
        return f"no torch in {sys.executable}: {e}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        import refit
    except ImportError as e:
        return f"refit does not import in {sys.executable}: {e}"
    if "cuda_ipc" not in refit.backends():
        return f"refit at {refit.__file__} has no GPU engines (backends {refit.backends()}): not the CUDA build"
    return None


def _paths() -> str:
    """Puts ranks.py, and verl or its stand-in, on the path of this process and of
    the rank processes; says which verl."""
    sys.path.insert(0, HERE)
    try:
        import verl.checkpoint_engine.base  # noqa: F401

        which = "verl"
    except ImportError:
        sys.path.insert(0, os.path.join(HERE, "standin"))
        which = "tests/verl/standin (verl is not installed here)"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["REFIT_VERL_START"] = "spawn"  # no process forked after CUDA was touched
    return which


def run() -> dict[str, Any]:
    """Every check that can run here; {"skipped": True, "reason"} where none can."""
    why = unavailable()
    if why:
        return {"check": "verl_gpu", "skipped": True, "reason": why}
    verl = _paths()
    import torch

    import refit
    from ranks import Rank, digests, model, step, tensors_of

    results: dict[str, bool] = {}
    notes: dict[str, Any] = {"verl": verl, "gpus": torch.cuda.device_count()}
    figures: dict[str, float] = {}

    def report(label: str, ok: bool, detail: str = "") -> None:
        results[label] = bool(ok)
        print(("PASS " if ok else "FAIL ") + label + (f": {detail}" if detail else ""), flush=True)

    def whole(out: dict, number: int, device: str) -> tuple[bool, str]:
        want = digests(tensors_of(number))
        bad = [a for a in out["actors"] if a[0] != "ok"]
        for i, r in enumerate(out["rollouts"]):
            if r[0] != "ok":
                bad.append((i, r[:2], str(r[2])[:300] if len(r) > 2 else ""))
            elif (r[1]["digests"] != want or r[1]["order"] != [n for n, _ in model(number)]
                  or r[1]["version"] != number or r[1]["devices"] != [device]):
                bad.append((i, "differs", r[1]["version"], r[1]["devices"]))
        return not bad, (str(bad)[:600] if bad else "")

    from refit.verl import RefitCheckpointEngine

    for bad in ({"checksums": True}, {"commit": "staged"}, {"topology": "chain"}, {"delta": True}):
        name = next(iter(bad))
        try:
            RefitCheckpointEngine(1 << 20, engine="cuda_ipc", **bad)
            report(f"cuda_ipc refuses {name} at construction", False, "it was accepted")
        except refit.InvalidArgumentError as e:
            report(f"cuda_ipc refuses {name} at construction", name in str(e), str(e))

    made: list[Any] = []

    def rank(role: str, **kwargs: Any) -> Any:
        r = Rank(role, **{**OPTS, **kwargs})
        made.append(r)
        return r

    try:
        ipc = {"engine": "cuda_ipc", "device": "cuda:0"}
        actors = [rank("master", tensor_device="cuda:0", **ipc)]
        rollouts = [rank("rollout", **ipc), rank("rollout", **ipc)]
        for number in (1, 2, 3):
            t0 = time.monotonic()
            out = step(actors, rollouts, number)
            figures[f"cuda_ipc_step{number}_s"] = round(time.monotonic() - t0, 4)
            ok, why = whole(out, number, "cuda:0")
            report(f"cuda_ipc step {number}: every tensor byte for byte on every rollout's GPU", ok, why)
        connects = actors[0].attr("connects")
        report("cuda_ipc: one topology served the three steps", connects == 1, f"connects {connects}")

        t0 = time.monotonic()
        out = step(actors, rollouts, 4, delay_s=0.05, during=lambda: (time.sleep(0.3), actors[0].kill()))
        took = time.monotonic() - t0
        failed = [r[0] == "error" and r[1] in ("PeerLostError", "CancelledError", "TimeoutError")
                  for r in out["rollouts"]]
        report("cuda_ipc: a killed sender fails every rollout's receive within the deadline",
               all(failed) and took < 15, f"{took:.1f} s, {[r[:2] for r in out['rollouts']]}")
        actors[0] = rank("master", tensor_device="cuda:0", **ipc)  # verl restarts the actor process
        ok, why = whole(step(actors, rollouts, 5), 5, "cuda:0")
        report("cuda_ipc: a restarted sender takes the next step whole", ok, why)
    finally:
        for r in made:
            r.close()
        made.clear()

    if torch.cuda.device_count() < 2:
        notes["nccl"] = "not run: NCCL needs a GPU per rank (2 for 1 actor and 1 rollout); this machine has 1"
    elif "nccl" not in refit.backends():
        notes["nccl"] = f"not run: this build has no nccl engine ({refit.backends()})"
    else:
        try:
            actors = [rank("master", tensor_device="cuda:0", engine="nccl", device="cuda:0")]
            rollouts = [rank("rollout", engine="nccl", device="cuda:1")]
            for number in (1, 2):
                t0 = time.monotonic()
                out = step(actors, rollouts, number)
                figures[f"nccl_step{number}_s"] = round(time.monotonic() - t0, 4)
                ok, why = whole(out, number, "cuda:1")
                report(f"nccl step {number}: every tensor byte for byte on the rollout's GPU", ok, why)
        finally:
            for r in made:
                r.close()
    return {"check": "verl_gpu", "passed": all(results.values()) and bool(results), "results": results,
            "notes": notes, "figures": figures}


def main() -> int:
    try:
        out = run()
    except Exception as e:  # the JSON line still comes, naming what broke
        import traceback

        traceback.print_exc()
        out = {"check": "verl_gpu", "passed": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
    return 0 if out.get("skipped") or out.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
