#!/usr/bin/env python3
"""How much of a bf16 policy changes per optimizer step: the data the delta encodings
of refit's delta updates are chosen from.

    python tests/bench/delta_density.py [--model small|100m|both] [--lrs 1e-6,1e-5,1e-4]
                                        [--warmup 20] [--steps 10] [--json FILE]
                                        [--record DIR]

--record DIR (one model, one learning rate) also writes the trajectory the main job
replays (`weight_sync --replay DIR`): DIR/layout.json (its update_info: names,
dtype_names, shapes) and DIR/step-0000.bin, step-0001.bin, ...: every parameter's
bf16 bytes in layout order, the state before the first steady-state step and after
each of them.

A trainer keeps fp32 master weights, trains with AdamW (betas 0.9/0.999, weight decay
0.01) and sends bf16. For each learning rate this trains the Python examples'
transformer (examples/python/tiny_lm.py) on its synthetic language from the same
initial weights: the first steps from initialisation (steps 1-3), then, after
--warmup steps, --steps more ("steady state"). After every step it compares the bf16
cast of every parameter with the previous step's bit for bit, and reports per tensor
kind (embedding, attention, mlp, norm, lm_head) the fraction of elements whose bf16
bits changed, and what each encoding would cost as a fraction of the full bf16 bytes:

  sparse        int32 position + bf16 value per changed element      6 d / 2
  sparse-gaps   LEB128 gap to the previous changed element + value    measured
  bitmap        one bit per element + the changed values              1/16 + d
  xor+zstd-1    bf16 XOR the previous bf16, zstd level 1 (zstd CLI)    measured
  xor+lz4       the same, lz4 (lz4 CLI)                                measured
  planes        the changed-element bitmap and each byte plane of the  measured
                changed elements' XOR, each zstd level 1 (refit's
                `planes` encoding, lib/backend/delta.h)

(d: the changed fraction). Models: "small" is the examples' TinyLM (vocab 512, d 64,
2 layers); "100m" is TinyLM(vocab 8192, d 768, 12 layers, 12 heads, seq 64), 98.5M
parameters. CPU, torch's threads as set by torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))
from tiny_lm import TinyLM, train_step  # noqa: E402

MODELS = {
    "small": dict(vocab=512, d_model=64, layers=2, heads=4, seq=16, batch=32),
    "100m": dict(vocab=8192, d_model=768, layers=12, heads=12, seq=64, batch=4),
}
KINDS = ("embedding", "attention", "mlp", "norm", "lm_head")


def kind_of(name: str) -> str:
    if name.startswith(("embed", "pos")):
        return "embedding"
    if "self_attn" in name:
        return "attention"
    if "linear1" in name or "linear2" in name:
        return "mlp"
    if "norm" in name:
        return "norm"
    if name.startswith("head"):
        return "lm_head"
    return "other"


def compressed(data: bytes, tool: list[str]) -> int:
    return len(subprocess.run(tool, input=data, capture_output=True, check=True).stdout)


def gap_bytes(positions: torch.Tensor) -> int:
    """LEB128 bytes of the gaps between sorted changed positions."""
    if positions.numel() == 0:
        return 0
    gaps = torch.diff(positions, prepend=torch.tensor([-1], dtype=positions.dtype)) - 1
    # bytes per gap: 1 below 2^7, 2 below 2^14, ...
    nbytes = torch.ones_like(gaps)
    for k in (7, 14, 21, 28):
        nbytes += (gaps >= (1 << k)).to(gaps.dtype)
    return int(nbytes.sum())


def measure_step(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], costs: bool) -> dict:
    out = {k: {"elements": 0, "changed": 0, "gaps": 0, "zstd": 0, "lz4": 0, "planes": 0} for k in KINDS}
    # planes: per kind, the bitmaps and the XOR byte planes of every tensor, each
    # stream compressed once.
    streams = {k: ([], [], []) for k in KINDS}
    for name, now in cur.items():
        k = kind_of(name)
        if k not in out:
            continue
        a = prev[name].view(torch.int16).reshape(-1)
        b = now.view(torch.int16).reshape(-1)
        diff = a != b
        o = out[k]
        o["elements"] += a.numel()
        changed = int(diff.sum())
        o["changed"] += changed
        if costs:
            o["gaps"] += gap_bytes(torch.nonzero(diff).reshape(-1).to(torch.int64))
            x = (a ^ b).numpy().tobytes()
            o["zstd"] += compressed(x, ["zstd", "-1", "-q", "-c"])
            o["lz4"] += compressed(x, ["lz4", "-1", "-q", "-c"])
            bits, low, high = streams[k]
            bits.append(np.packbits(diff.numpy(), bitorder="little").tobytes())
            xs = (a ^ b)[diff].numpy().view(np.uint8).reshape(-1, 2)
            low.append(xs[:, 0].tobytes())
            high.append(xs[:, 1].tobytes())
    if costs:
        for k, parts in streams.items():
            out[k]["planes"] = sum(compressed(b"".join(p), ["zstd", "-1", "-q", "-c"]) for p in parts if p)
    return out


def record(directory: str, index: int, params: dict[str, torch.Tensor]) -> None:
    """Writes one state of the trajectory (and the layout with the first)."""
    os.makedirs(directory, exist_ok=True)
    if index == 0:
        layout = {"names": list(params), "dtype_names": ["bfloat16"] * len(params),
                  "shapes": [list(t.shape) for t in params.values()]}
        with open(os.path.join(directory, "layout.json"), "w") as f:
            json.dump(layout, f)
    with open(os.path.join(directory, f"step-{index:04d}.bin"), "wb") as f:
        for t in params.values():
            f.write(t.contiguous().view(torch.int16).numpy().tobytes())


def run(model_name: str, lr: float, warmup: int, steps: int, costs: bool, record_dir: str = "") -> dict:
    cfg = MODELS[model_name]
    torch.manual_seed(0)
    model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)

    def bf16():
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}

    prev = bf16()
    phases = {"first": [], "steady": []}
    t0 = time.perf_counter()
    for step in range(1, 3 + warmup + steps + 1):
        train_step(model, opt, cfg["vocab"], cfg["seq"], cfg["batch"], g)
        cur = bf16()
        phase = "first" if step <= 3 else ("steady" if step > 3 + warmup else None)
        if record_dir and phase == "steady":
            if step == 3 + warmup + 1:
                record(record_dir, 0, prev)
            record(record_dir, step - 3 - warmup, cur)
        if phase:
            phases[phase].append(measure_step(prev, cur, costs))
        prev = cur
    params = sum(p.numel() for p in model.parameters())
    result = {"model": model_name, "params": params, "lr": lr, "warmup": warmup, "steps": steps,
              "seconds": time.perf_counter() - t0, "phases": {}}
    for phase, rows in phases.items():
        per_kind = {}
        for k in KINDS + ("all",):
            ks = KINDS if k == "all" else (k,)
            el = sum(r[kk]["elements"] for r in rows[:1] for kk in ks)
            if el == 0:
                continue
            dens = [sum(r[kk]["changed"] for kk in ks) / el for r in rows]
            entry = {"elements": el, "density_median": statistics.median(dens), "density_min": min(dens),
                     "density_max": max(dens)}
            if costs:
                full = 2 * el
                for enc in ("gaps", "zstd", "lz4", "planes"):
                    vals = []
                    for r in rows:
                        changed = sum(r[kk]["changed"] for kk in ks)
                        extra = 2 * changed if enc == "gaps" else 0
                        vals.append((sum(r[kk][enc] for kk in ks) + extra) / full)
                    entry[f"{enc}_cost_median"] = statistics.median(vals)
                d = entry["density_median"]
                entry["sparse_cost"] = 3 * d
                entry["bitmap_cost"] = 1 / 16 + d
            per_kind[k] = entry
        result["phases"][phase] = per_kind
    return result


def table(results: list[dict]) -> str:
    lines = ["| model | lr | phase | kind | changed (median [min-max]) | sparse | sparse-gaps | bitmap "
             "| xor+zstd-1 | xor+lz4 | planes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for phase, kinds in r["phases"].items():
            for k, e in kinds.items():
                lines.append(
                    f"| {r['model']} | {r['lr']:g} | {phase} | {k} | {e['density_median']:.4f} "
                    f"[{e['density_min']:.4f}-{e['density_max']:.4f}] | {e.get('sparse_cost', 0):.3f} | "
                    f"{e.get('gaps_cost_median', 0):.3f} | {e.get('bitmap_cost', 0):.3f} | "
                    f"{e.get('zstd_cost_median', 0):.3f} | {e.get('lz4_cost_median', 0):.3f} | "
                    f"{e.get('planes_cost_median', 0):.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="both", choices=["small", "100m", "both"])
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-costs", action="store_true", help="densities only (no compression runs)")
    ap.add_argument("--json")
    ap.add_argument("--record", default="", help="DIR: write the steady-state trajectory for weight_sync --replay")
    args = ap.parse_args()
    models = ["small", "100m"] if args.model == "both" else [args.model]
    if args.record and (len(models) != 1 or "," in args.lrs):
        ap.error("--record: one --model and one learning rate in --lrs")
    results = []
    for m in models:
        for lr in (float(x) for x in args.lrs.split(",")):
            r = run(m, lr, args.warmup, args.steps, not args.no_costs, args.record)
            print(f"delta_density: {m} lr {lr:g}: {r['seconds']:.0f} s", file=sys.stderr)
            results.append(r)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
