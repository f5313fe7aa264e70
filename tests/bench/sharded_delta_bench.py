#!/usr/bin/env python3
"""Delta updates over tcp_sharded (examples/weight_sync's sharded job, loopback):
--trainers 2 --tp 2, each update after the first changing --change-fraction of the
elements, run full and with --delta, alternating within each round. Per round: the
median update time after the first of each (the first has no base), their ratio
and the wire bytes of a delta update over the bytes the workers hold. Every update
of every run is verified against the reference slicing of the whole model; a run
with a full fallback fails the benchmark. Medians of ROUNDS rounds [min-max].

usage: sharded_delta_bench.py [--model-bytes 512M] [--updates 5] [--rounds 3]
                              [--change-fraction 0.01] [--binary PATH] [--json FILE]
"""
import argparse
import json
import os
import statistics
import sys

import benchmeta
import weight_sync_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-bytes", default="512M")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--change-fraction", default="0.01")
    ap.add_argument("--binary", default=os.path.join(ROOT, "bazel-bin/examples/weight_sync/weight_sync"))
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.updates < 2:
        sys.exit("sharded_delta_bench: --updates 2 or more (the first has no base)")
    meta = benchmeta.record(a.rounds)
    full, delta, ratio, wire, runs = [], [], [], [], []
    for k in range(a.rounds):
        times = {}
        for mode in ("full", "delta"):
            args = ["--quiet", "--trainers", "2", "--tp", "2", "--model-bytes", a.model_bytes, "--updates",
                    str(a.updates), "--change-fraction", a.change_fraction] + (["--delta"] if mode == "delta" else [])
            r = weight_sync_job.run("sharded_delta_bench", a.binary, args)
            r["mode"], r["round"] = mode, k + 1
            runs.append(r)
            times[mode] = statistics.median(r["update_seconds"][1:])
            if mode == "delta":
                if r["delta"]["full_fallbacks"] != 0:
                    sys.exit(f"sharded_delta_bench: a full fallback: {r['delta']}")
                wire.append(statistics.median(w / g for w, g in zip(r["wire_bytes"][1:], r["worker_bytes"][1:])))
            print(f"[sharded_delta_bench] round {k + 1} {mode}: {times[mode]:.3f} s per update", file=sys.stderr)
        full.append(times["full"])
        delta.append(times["delta"])
        ratio.append(times["delta"] / times["full"])
    s = weight_sync_job.spread
    print(f"tcp_sharded 2x2, {a.model_bytes} bf16, change fraction {a.change_fraction}, loopback, "
          f"{a.rounds} rounds (updates after the first)")
    print(f"full update {s(full)} s; delta update {s(delta)} s; delta / full {s(ratio)}; "
          f"wire / bytes {s(wire, 4)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**meta, "model_bytes": a.model_bytes, "change_fraction": float(a.change_fraction),
                       "full_s": full, "delta_s": delta, "ratio": ratio, "wire": wire, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
