#!/usr/bin/env python3
"""refit from Python against refit from C++ and against gloo, in the same rounds.

Each round starts two C++ workers (weight_sync --role worker) and updates them:
  - big:   the main job's 1 GiB bf16 layout, by the C++ trainer (weight_sync
           --connect) and then by a Python trainer (refit.WorkerGroup.update with
           torch tensors), 3 updates each; the Python time is the whole call
           (tensors handed over, metadata, the update);
  - small: 10002 tensors of ~12 KB (weight_sync --layers 1111 --vocab 512), likewise;
  - gloo:  torch.distributed gloo broadcast of the big layout from a trainer to 2
           workers into resident tensors (tests/bench/gloo_broadcast.py, Debian's
           torch 1.13: float16 stands in for bfloat16).
Ratios are taken within each round (time of C++ / time of Python: 1.0 means the
same throughput), then their median over the rounds is reported with the spread.

usage: python_bench.py --weight-sync BIN [--rounds 3] [--updates 3] [--small-updates 8] [--json FILE]
       run with the venv's python (refit and torch installed); ./refit bench runs it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import benchmeta
import refit

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def start_workers(binary, n, timeout_ms):
    env = dict(os.environ, REFIT_TRAINER_PID=str(os.getpid()))
    procs, ports = [], []
    for _ in range(n):
        p = subprocess.Popen([binary, "--role", "worker", "--listen", "127.0.0.1", "--timeout-ms", str(timeout_ms)],
                             stdout=subprocess.PIPE, text=True, env=env)
        line = p.stdout.readline().split()
        if len(line) != 2 or line[0] != "REFIT_WORKER_PORT":
            raise RuntimeError(f"worker printed {line!r}")
        procs.append(p)
        ports.append(int(line[1]))
    return procs, ports


def stop_workers(procs, ports):
    try:
        with refit.WorkerGroup([("127.0.0.1", p) for p in ports], timeout_ms=10000) as g:
            g.connect()
            g.call_all("shutdown")
    except refit.Error:
        pass
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def layout(binary, *flags):
    out = subprocess.run([binary, "--print-layout", *flags], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def cpp_updates(binary, ports, flags, updates):
    cmd = [binary, "--connect", ",".join(str(p) for p in ports), "--workers", str(len(ports)), "--load-model",
           "--updates", str(updates), "--quiet", *flags]
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    if not r["verified"]:
        raise RuntimeError(f"the C++ trainer's update was not verified: {r}")
    # The whole update call, as the Python side is timed (the update_info JSON included).
    return r["update_call_seconds"], r["bytes"], r["tensors"]


def python_updates(ports, meta, updates, first_version):
    tensors = {}
    for name, dtype, shape in zip(meta["names"], meta["dtype_names"], meta["shapes"]):
        tensors[name] = torch.empty(shape, dtype=DTYPES[dtype]).normal_()  # resident, touched
    sender = refit.Sender("tcp", timeout_ms=120000)
    seconds = []
    with refit.WorkerGroup([("127.0.0.1", p) for p in ports], timeout_ms=120000) as group:
        group.connect()
        group.call_all("load_model", meta)
        group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
        for i in range(updates):
            with torch.no_grad():
                for t in tensors.values():
                    t.add_(1)  # a training step's worth of change, outside the timing
            start = time.perf_counter()
            group.update(sender, tensors.items(), first_version + i, verify=False)
            seconds.append(time.perf_counter() - start)
        # Every byte on every worker against the trainer's, after the timing.
        expected = refit.fingerprints(tensors.items())
        diffs = group.fingerprint_differences(expected, first_version + updates - 1)
        if any(diffs):
            raise RuntimeError(f"the Python trainer's update differs on a worker: {diffs}")
    sender.shutdown()
    return seconds


def gloo(layout_file, updates):
    out = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "gloo_broadcast.py"), layout_file, "2", str(updates),
                          "resident"], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def steady(seconds):
    """The median of the updates after the first (the first also faults in memory)."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def main():
    # torch's intra-op threads (and their OpenMP spin-waits after the step's add_)
    # would compete with the send on these 2 cores; the C++ trainer has none.
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-sync", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=3, help="updates of the 1 GiB layout per trainer and round")
    ap.add_argument("--small-updates", type=int, default=8,
                    help="updates of the 10k-tensor layout (each ~0.1 s: more of them steady the median)")
    ap.add_argument("--model-bytes", default="1G")
    ap.add_argument("--json")
    ap.add_argument("--no-gloo", action="store_true")
    args = ap.parse_args()
    binary = args.weight_sync
    big_flags = ["--model-bytes", args.model_bytes]
    small_flags = ["--model-bytes", "32M", "--layers", "1111", "--vocab", "512"]
    meta = benchmeta.record(args.rounds)
    big, small = layout(binary, *big_flags), layout(binary, *small_flags)
    layout_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"refit_python_bench_{os.getpid()}.json")
    with open(layout_file, "w") as f:
        json.dump(big, f)
    rows = []
    for r in range(args.rounds):
        row = {}
        procs, ports = start_workers(binary, 2, 120000)
        try:
            cpp_big, nbytes, _ = cpp_updates(binary, ports, big_flags, args.updates)
            py_big = python_updates(ports, big, args.updates, 1000)
            cpp_small, small_bytes, ntensors = cpp_updates(binary, ports, small_flags, args.small_updates)
            py_small = python_updates(ports, small, args.small_updates, 2000)
        finally:
            stop_workers(procs, ports)
        row["big_bytes"], row["small_bytes"], row["small_tensors"] = nbytes, small_bytes, ntensors
        row["cpp_big_s"], row["py_big_s"] = steady(cpp_big), steady(py_big)
        row["cpp_small_s"], row["py_small_s"] = steady(cpp_small), steady(py_small)
        row["big_ratio"] = row["cpp_big_s"] / row["py_big_s"]
        row["small_ratio"] = row["cpp_small_s"] / row["py_small_s"]
        row["py_big_gbps_per_worker"] = nbytes / row["py_big_s"] / 1e9
        if not args.no_gloo:
            g = gloo(layout_file, args.updates)
            row["gloo_gbps_per_worker"] = g["gbps_per_worker"] if "gbps_per_worker" in g else g["gbps"]
            row["vs_gloo"] = row["py_big_gbps_per_worker"] / row["gloo_gbps_per_worker"]
        rows.append(row)
        print(f"round {r + 1}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              file=sys.stderr)
    os.unlink(layout_file)
    keys = [k for k in rows[0] if isinstance(rows[0][k], float)]
    result = {k: summary([row[k] for row in rows]) for k in keys}
    result["big_bytes"], result["small_tensors"] = rows[0]["big_bytes"], rows[0]["small_tensors"]
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, **result, "per_round": rows}, f, indent=1)
    print(text)

    def fmt(k, digits=3):
        s = result[k]
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    print(f"big ({result['big_bytes'] / 1e9:.2f} GB, 2 workers): C++ {fmt('cpp_big_s')} s, Python {fmt('py_big_s')} s, "
          f"Python/C++ throughput {fmt('big_ratio')} (target >= 0.95)", file=sys.stderr)
    print(f"small ({result['small_tensors']} tensors): C++ {fmt('cpp_small_s', 4)} s, Python {fmt('py_small_s', 4)} s, "
          f"ratio {fmt('small_ratio')} (target >= 0.9)", file=sys.stderr)
    if "vs_gloo" in result:
        print(f"Python refit {fmt('py_big_gbps_per_worker')} GB/s per worker vs gloo broadcast "
              f"{fmt('gloo_gbps_per_worker')}: {fmt('vs_gloo')}x", file=sys.stderr)


if __name__ == "__main__":
    main()
