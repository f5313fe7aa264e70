#!/usr/bin/env python3
"""docs/scale.md's cases, predicted by the simulation (tools/simulate, ./refit simulate).

    python3 tests/bench/sim_scale.py [--bin DIR] [--json docs/bench/sim_scale.json] [--only NAME]

Each case is a model (tools/simulate/models/*.json), the trainer's layout, the inference
layout and a platform of GPUs with one 400 Gbit/s NIC each on a non-blocking fat
tree, moved by ucx_sharded with the calibrated costs (docs/bench/sim_costs.json):
full bf16, fp8-sized bytes, and deltas at the change fractions docs/delta.md
measured (0.0103: lr 1e-6, 0.0624: lr 1e-5, steady state), the delta codec on 4
CPU cores per GPU. Published figures are
printed beside them. Not run by CI (minutes: the 1T case plans ~2 million boxes);
its JSON renders docs/scale.md's table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
import benchmeta  # noqa: E402

MODELS = os.path.join(ROOT, "tools", "simulate", "models")
VARIANTS = [
    ("bf16", ["--weights", "bf16"]),
    ("fp8", ["--weights", "fp8"]),
    ("delta 0.0103", ["--weights", "bf16", "--delta", "0.0103", "--codec-cores", "4"]),
    ("delta 0.0624", ["--weights", "bf16", "--delta", "0.0624", "--codec-cores", "4"]),
]
KIMI = "Perplexity (one-sided RDMA writes, static plan): 1.3 s; SGLang + Mooncake P2P: 7.2 s; " \
       "checkpoint-engine: 16 s (256 H20)"
# (name, model, trainer layout (HSDP R,S: S-way FSDP within a node, R replicas), inference, published, variants)
CASES = [
    ("kimi_k2 256->128 (8x tp16)", "kimi_k2.json", ["--hsdp", "32,8"], ["--replicas", "8", "--tp", "16"], KIMI,
     VARIANTS),
    ("kimi_k2 256->128 (4x tp32)", "kimi_k2.json", ["--hsdp", "32,8"], ["--replicas", "4", "--tp", "32"], KIMI,
     VARIANTS[:2]),
    # FSDP over 16 ranks cuts each fp8 expert and its scales 16 ways for 8 replicas:
    # more boxes than refit's planner takes (max_plan_items).
    ("kimi_k2 256->128 (8x tp16), HSDP 16x16", "kimi_k2.json", ["--hsdp", "16,16"], ["--replicas", "8", "--tp", "16"],
     KIMI, VARIANTS[1:2]),
    ("qwen3_235b 32->32 (4x tp8)", "qwen3_235b_a22b.json", ["--fsdp", "32"], ["--replicas", "4", "--tp", "8"],
     "vLLM sharded_rdt, Qwen3-235B on 4 nodes: 3.54 s", VARIANTS),
    ("llama3_70b 8->8 (1x tp8)", "llama3_70b.json", ["--fsdp", "8"], ["--replicas", "1", "--tp", "8"], "", VARIANTS),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--json")
    ap.add_argument("--only", help="cases whose name contains this")
    args = ap.parse_args()
    rows = []
    for name, model, trainer, inference, published, variants in CASES:
        if args.only and args.only not in name:
            continue
        for variant, extra in variants:
            cmd = [os.path.join(args.bin, "tools/simulate/simulate"), "--hf-config", os.path.join(MODELS, model),
                   *trainer, *inference, "--rate", "400gbit", "--buffer-bytes", "64M", "--costs",
                   os.path.join(ROOT, "docs/bench/sim_costs.json"), "--json", *extra]
            started = time.monotonic()
            run = subprocess.run(cmd, capture_output=True, text=True)
            took = time.monotonic() - started
            row = {"case": name, "variant": variant, "published": published, "command": " ".join(cmd[1:]),
                   "sim_seconds": took}
            if run.returncode != 0:
                row["error"] = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"status {run.returncode}"
                print(f"{name:30} {variant:14} refused: {row['error']}")
            else:
                p = json.loads(run.stdout)
                row.update({k: p[k] for k in ("seconds", "limit_seconds", "busiest_nic", "busiest_bytes",
                                               "busiest_share", "payload_bytes", "phases")})
                print(f"{name:30} {variant:14} {p['seconds']:8.3f} s  limit {p['limit_seconds']:7.3f} s "
                      f"({p['busiest_nic']}, {p['busiest_bytes'] / 1e9:.1f} GB)  busy {100 * p['busiest_share']:.0f}%"
                      f"  [{took:.0f} s to simulate]")
            rows.append(row)
    if args.json:
        out = benchmeta.record(1, sys.argv)
        out.update({"nic": "400gbit", "device_copy_gbps": 1000, "buffer_bytes": "64M", "rows": rows})
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
