#!/usr/bin/env python3
"""Sharded transfers against today's broadcast with receive-side slicing, same model,
same machine, same round (examples/weight_sync):

  A  --trainers 2 --tp 2              two FSDP Shard(0) trainer ranks -> 2 vLLM tp workers
  B  --tp 2 --broadcast               one trainer broadcasts the whole model, each worker slices
  C  --trainers 1 --tp 4              one trainer rank -> 4 tp workers, each its quarter
  D  --tp 4 --broadcast               the whole model to 4 workers (refit's chain), sliced
  L  socket_pairs.py 2 S/2 / 4 S/4    the loopback limit for the bytes A / C move: as many
                                      independent process pairs as A's workers (C's), each
                                      moving what one worker receives

With --engine ucx the four jobs run over UCX (ucx_sharded; the broadcasts over the ucx
engine) with UCX_TLS as set (sm,self by default) and UCX_NET_DEVICES=lo, and each round
adds T, tcp_sharded's 2x2 (the peer: A's update time over T's).

Per round: wire bytes per worker (the largest worker's) and the steady-state update
time (the median of the updates after the first) of each, the ratios A/B and C/D,
and each sharded run's per-link efficiency (its aggregate GB/s over the limit's).
Every figure is the median of ROUNDS rounds with its spread; every ratio is taken
within a round. Prints a table and, with --json FILE, writes the figures there
(each round's under "per_round"), with the run's command, commit, date and rounds
(tests/bench/benchmeta.py).

usage: sharded_bench.py [--model-bytes 1G] [--layers 16] [--updates 4] [--rounds 3]
                        [--engine tcp|ucx] [--binary PATH] [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import benchmeta
import weight_sync_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.upper().rstrip("IB")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def run_job(binary, args, model_bytes, layers, updates):
    r = weight_sync_job.run("sharded_bench", binary, [
        "--model-bytes", str(model_bytes), "--layers", str(layers), "--vocab", "32000",
        "--updates", str(updates), "--quiet"] + args)
    steady = r["update_seconds"][1:] or r["update_seconds"]
    return {"bytes_per_worker": max(r["bytes_per_worker"]), "seconds": statistics.median(steady),
            "egress": r["trainer_egress_bytes"], "plan_s": r["plan_s"], "bytes": r["bytes"],
            "workers": r["workers"], "sum_per_worker": sum(r["bytes_per_worker"])}


def limit(pairs, bytes_each, updates):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests/bench/socket_pairs.py"), str(pairs),
                        str(bytes_each), str(updates)], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"sharded_bench: socket_pairs failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["aggregate_gbps"]


def fmt(xs, digits=3):
    return weight_sync_job.spread(xs, digits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-bytes", default="1G")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--binary", default=os.path.join(ROOT, "bazel-bin/examples/weight_sync/weight_sync"))
    ap.add_argument("--engine", choices=["tcp", "ucx"], default="tcp")
    ap.add_argument("--json")
    a = ap.parse_args()
    size = parse_bytes(a.model_bytes)
    engine = ["--engine", a.engine]
    if a.engine == "ucx":
        os.environ.setdefault("UCX_TLS", "sm,self")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    meta = benchmeta.record(a.rounds)
    rounds = []
    for k in range(a.rounds):
        r = {}
        r["A"] = run_job(a.binary, engine + ["--trainers", "2", "--tp", "2"], size, a.layers, a.updates)
        r["B"] = run_job(a.binary, engine + ["--tp", "2", "--broadcast"], size, a.layers, a.updates)
        r["C"] = run_job(a.binary, engine + ["--trainers", "1", "--tp", "4"], size, a.layers, a.updates)
        r["D"] = run_job(a.binary, engine + ["--tp", "4", "--broadcast"], size, a.layers, a.updates)
        if a.engine == "ucx":
            r["T"] = run_job(a.binary, ["--trainers", "2", "--tp", "2"], size, a.layers, a.updates)
            r["wall_vs_tcp_22"] = r["A"]["seconds"] / r["T"]["seconds"]
        r["LA"] = limit(2, r["A"]["bytes_per_worker"], a.updates)
        r["LC"] = limit(4, r["C"]["bytes_per_worker"], a.updates)
        r["bytes_ratio_22"] = r["A"]["bytes_per_worker"] / r["B"]["bytes_per_worker"]
        r["wall_ratio_22"] = r["A"]["seconds"] / r["B"]["seconds"]
        r["bytes_ratio_14"] = r["C"]["bytes_per_worker"] / r["D"]["bytes_per_worker"]
        r["wall_ratio_14"] = r["C"]["seconds"] / r["D"]["seconds"]
        # Per-link efficiency: the sharded run's aggregate ingress rate over the limit
        # of as many independent pairs moving the same bytes each.
        r["eff_22"] = r["A"]["sum_per_worker"] / r["A"]["seconds"] / 1e9 / r["LA"]
        r["eff_14"] = r["C"]["sum_per_worker"] / r["C"]["seconds"] / 1e9 / r["LC"]
        rounds.append(r)
        print(f"round {k + 1}: 2x2 bytes {r['bytes_ratio_22']:.3f} wall {r['wall_ratio_22']:.3f}; "
              f"1x4 bytes {r['bytes_ratio_14']:.3f} wall {r['wall_ratio_14']:.3f}; "
              f"efficiency {r['eff_22']:.2f} / {r['eff_14']:.2f}"
              + (f"; 2x2 wall / tcp_sharded {r['wall_vs_tcp_22']:.3f}" if "T" in r else ""), flush=True)

    def col(key, sub=None):
        return [r[key][sub] if sub else r[key] for r in rounds]

    def gb(xs):
        return [x / 1e9 for x in xs]

    print(f"\nengine {a.engine}" + (f" (UCX_TLS={os.environ['UCX_TLS']})" if a.engine == "ucx" else "")
          + f"; model {rounds[0]['A']['bytes'] / 1e9:.2f} GB bf16, {a.layers} layers; {a.rounds} rounds, "
          f"median [min-max]; steady-state update (median of updates 2..{a.updates})")
    print(f"{'':28s} {'GB per worker':>24s} {'update s':>24s}")
    for key, name in (("A", "sharded M=2 N=2"), ("B", "broadcast+slice N=2"), ("C", "sharded M=1 N=4"),
                      ("D", "broadcast+slice N=4"), ("T", "tcp_sharded M=2 N=2")):
        if key not in rounds[0]:
            continue
        print(f"{name:28s} {fmt(gb(col(key, 'bytes_per_worker'))):>24s} {fmt(col(key, 'seconds')):>24s}")
    print(f"M=2 N=2 / broadcast: bytes {fmt(col('bytes_ratio_22'))} (limit 0.55), "
          f"wall {fmt(col('wall_ratio_22'))} (limit 0.6)")
    print(f"M=1 N=4 / broadcast: bytes {fmt(col('bytes_ratio_14'))} (limit 0.3), wall {fmt(col('wall_ratio_14'))}")
    print(f"loopback limit (independent pairs, GB/s): 2 pairs {fmt(col('LA'), 2)}, 4 pairs {fmt(col('LC'), 2)}")
    print(f"per-link efficiency (sharded aggregate / limit): M=2 N=2 {fmt(col('eff_22'), 2)}, "
          f"M=1 N=4 {fmt(col('eff_14'), 2)}")
    if "T" in rounds[0]:
        print(f"M=2 N=2 update time / tcp_sharded's: {fmt(col('wall_vs_tcp_22'))}")
    print(f"plan_s (coordinator, first plan): {fmt(col('A', 'plan_s'), 4)}")
    if a.json:
        out = {**meta, "engine": a.engine, "model_bytes": size, "layers": a.layers, "updates": a.updates}
        if a.engine == "ucx":
            out["ucx_tls"] = os.environ["UCX_TLS"]
        with open(a.json, "w") as f:
            json.dump({**out, "per_round": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
