#!/usr/bin/env python3
"""What a fleet-atomic update costs against a staged one (docs/control-plane.md,
"Fleet-atomic updates"): the main job (examples/weight_sync) moving the same model to
the same workers, once with --commit staged and once with --fleet-atomic, in the same
round, in alternating order.

Each job sends --updates updates to fresh workers. Their first update cannot be
fleet-atomic (the workers hold no version to undo to: the job sends it staged), so
the figures are over the later updates: the median of their update calls per job.
Per round: staged s, fleet-atomic s, their ratio (fleet/staged, within the round),
and each mode's largest worker peak RSS (what the kept undo adds). Every figure is the
median of ROUNDS rounds with its [min-max].

usage: fleet_atomic_bench.py [--model-bytes 1100M] [--workers 2] [--updates 4]
                             [--rounds 3] [--binary PATH] [--json FILE]
"""
import argparse
import json
import os
import statistics

import benchmeta
import weight_sync_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(binary, a, mode):
    flags = ["--fleet-atomic"] if mode == "fleet_atomic" else ["--commit", "staged"]
    r = weight_sync_job.run("fleet_atomic_bench", binary, [
        "--quiet", "--model-bytes", a.model_bytes, "--workers", str(a.workers), "--updates", str(a.updates),
        "--timeout-ms", "120000", *flags])
    later = r["update_call_seconds"][1:]
    return statistics.median(later), r["worker_peak_rss_bytes"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-bytes", default="1100M")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--binary", default=os.path.join(ROOT, "bazel-bin/examples/weight_sync/weight_sync"))
    p.add_argument("--json")
    a = p.parse_args()
    if a.updates < 2:
        p.error("--updates: at least 2 (the first is not fleet-atomic)")
    report = {**benchmeta.record(a.rounds), "model_bytes": a.model_bytes, "workers": a.workers,
              "updates": a.updates, "per_round": []}
    for k in range(a.rounds):
        order = ["staged", "fleet_atomic"] if k % 2 == 0 else ["fleet_atomic", "staged"]
        got = {m: job(a.binary, a, m) for m in order}
        row = {"staged_s": got["staged"][0], "fleet_atomic_s": got["fleet_atomic"][0],
               "ratio": got["fleet_atomic"][0] / got["staged"][0],
               "staged_peak_rss": got["staged"][1], "fleet_atomic_peak_rss": got["fleet_atomic"][1]}
        report["per_round"].append(row)
        print(f"round {k + 1}: staged {row['staged_s']:.3f} s, fleet-atomic {row['fleet_atomic_s']:.3f} s, "
              f"ratio {row['ratio']:.3f}; peak RSS {row['staged_peak_rss'] / 2**30:.2f} / "
              f"{row['fleet_atomic_peak_rss'] / 2**30:.2f} GiB", flush=True)
    rows = report["per_round"]
    for key in ("staged_s", "fleet_atomic_s", "ratio", "staged_peak_rss", "fleet_atomic_peak_rss"):
        xs = [r[key] for r in rows]
        report[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    print("fleet-atomic / staged:", weight_sync_job.spread([r["ratio"] for r in rows]),
          "| added peak RSS per worker (MiB):",
          weight_sync_job.spread([(r["fleet_atomic_peak_rss"] - r["staged_peak_rss"]) / 2**20 for r in rows], 0))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
