#!/usr/bin/env python3
"""How long a worker's event loop stalls while it receives updates of a model with many
tensors (examples/weight_sync's lag probe on every worker's loop, read through its
loop_lag verb before and after each update):

  S  --trainers 2 --tp 2      tcp_sharded: the first update reads the layout and plans it
  B  --workers 2              tcp broadcast of the same model (the update_info is the
                              same metadata without the layout)

Per round: the workers' largest stall during the first update and during the later ones
(and their p99), for S and B, and S/B within the round. With --baseline-binary (an older
build of the job) S runs with it too, for a before/after in the same round. Every figure
is the median of ROUNDS rounds with its spread.

usage: loop_lag_bench.py [--layers 3000] [--model-bytes 512M] [--updates 3] [--rounds 3]
                         [--binary PATH] [--baseline-binary PATH] [--json FILE]
"""
import argparse
import json
import os
import sys

import benchmeta
import weight_sync_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_job(binary, args, a):
    r = weight_sync_job.run("loop_lag_bench", binary, [
        "--model-bytes", a.model_bytes, "--layers", str(a.layers), "--vocab", "1000",
        "--updates", str(a.updates), "--quiet"] + args)
    lag = r.get("worker_loop_lag_ms")
    if not lag:
        sys.exit(f"loop_lag_bench: {binary} reports no worker_loop_lag_ms")
    # The broadcast job reports its first update within "update" (no separate figure).
    first = lag.get("first_update", lag.get("update"))
    return {"tensors": r["tensors"], "first": first, "later": lag["update"], "p99": lag["update_p99"]}


def fmt(xs, digits=1):
    return weight_sync_job.spread(xs, digits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3000)
    ap.add_argument("--model-bytes", default="512M")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--binary", default=os.path.join(ROOT, "bazel-bin/examples/weight_sync/weight_sync"))
    ap.add_argument("--baseline-binary")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.updates < 2:
        sys.exit("loop_lag_bench: --updates must be at least 2 (the first update is reported apart)")
    meta = benchmeta.record(a.rounds)
    rounds = []
    for k in range(a.rounds):
        r = {"S": run_job(a.binary, ["--trainers", "2", "--tp", "2"], a),
             "B": run_job(a.binary, ["--workers", "2"], a)}
        if a.baseline_binary:
            r["S0"] = run_job(a.baseline_binary, ["--trainers", "2", "--tp", "2"], a)
        r["later_ratio"] = r["S"]["later"] / max(r["B"]["later"], 1e-3)
        rounds.append(r)
        line = (f"round {k + 1}: sharded first {r['S']['first']:.1f} ms, later {r['S']['later']:.1f} ms; "
                f"broadcast {r['B']['later']:.1f} ms")
        if "S0" in r:
            line += f"; baseline sharded first {r['S0']['first']:.1f} ms, later {r['S0']['later']:.1f} ms"
        print(line, flush=True)

    def col(key, sub):
        return [r[key][sub] for r in rounds]

    print(f"\n{rounds[0]['S']['tensors']} tensors, {a.model_bytes} bf16, {a.updates} updates; "
          f"{a.rounds} rounds, median [min-max], worker event-loop stalls in ms")
    print(f"{'':34s} {'first update':>22s} {'later updates':>22s} {'later p99':>22s}")
    names = [("S", "tcp_sharded 2x2"), ("B", "tcp broadcast to 2")]
    if a.baseline_binary:
        names.append(("S0", "tcp_sharded 2x2, baseline build"))
    for key, name in names:
        print(f"{name:34s} {fmt(col(key, 'first')):>22s} {fmt(col(key, 'later')):>22s} {fmt(col(key, 'p99')):>22s}")
    print(f"sharded / broadcast, later updates: {fmt([r['later_ratio'] for r in rounds], 2)}")
    if a.baseline_binary:
        print(f"baseline / this build, first update: "
              f"{fmt([r['S0']['first'] / max(r['S']['first'], 1e-3) for r in rounds], 1)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**meta, "args": vars(a), "per_round": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
