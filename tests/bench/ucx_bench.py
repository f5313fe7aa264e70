"""refit's ucx engine against its limit and its peers, in the same rounds.

Per round, on one host:
  shared memory (UCX_TLS=sm,self)
    limit   ucx_perftest ucp_put_bw, one pair (and two pairs at once)
    refit   ucx, 1 worker: direct receive (by default tagged over shared memory:
            the worker's UCX pulls each bucket into the model's memory), the same
            written by the trainer's puts (--ucx-puts: the model's memory registered
            for each update), and puts into staging (--no-direct: then the worker
            copies each bucket into the model); ucx, 2 workers (star, direct); tcp,
            1 worker (the engine a refit user has without UCX)
  loopback tcp (UCX_TLS=tcp,self, UCX_NET_DEVICES=lo)
    limit   ucx_perftest tag_bw, as UCX sets it up by default, and with its
            endpoints' peer failure handling on (-e: as refit's endpoints over
            tcp, which need it to tell a lost peer)
    refit   ucx, 1 worker; tcp, 1 worker
    peer    NIXL (its Python agent, DRAM to DRAM over its UCX backend)
  shared memory with tcp (UCX_TLS=sm,tcp,self): NIXL's UCX refuses sm alone (its
  endpoints need peer failure handling, which UCX's shared-memory transports lack)
    refit   ucx, 1 worker
    peer    NIXL

Every refit figure is the main job's (examples/weight_sync) median update time
after the first (which pays for first touches) over `--updates`, every byte
verified; GB/s = model bytes / that time (per worker; aggregate for 2). Beside it,
a worker's CPU seconds (user + system, every thread) per GB received, from the
job's `worker_cpu_seconds` (median over the updates after the first). Ratios are
taken within a round; the summary gives medians over rounds with [min-max]. The
JSON records the run's command, commit, date and rounds (tests/bench/benchmeta.py).

    python3 tests/bench/ucx_bench.py --job bazel-bin/examples/weight_sync/weight_sync \\
        [--nixl-python VENV/bin/python] [--rounds 3] [--bytes 1G] [--sm-only] [--json OUT]

(tests/bench/ucx_bench.sh builds the job, makes NIXL's venv and calls this.)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import benchmeta

MIB = 1 << 20


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def env_with(**kv):
    e = dict(os.environ)
    e.update(kv)
    return e


def perftest(test, size, iters, tls, pairs=1, base_port=13500, extra=()):
    """Overall GB/s of `pairs` concurrent ucx_perftest pairs (summed); `extra`:
    more options for both sides."""
    env = env_with(UCX_TLS=tls, UCX_NET_DEVICES="lo")
    servers = []
    for i in range(pairs):
        servers.append(subprocess.Popen(["ucx_perftest", "-t", test, "-s", str(size), "-n", str(iters),
                                         "-p", str(base_port + i), *extra], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)
    clients = [subprocess.Popen(["ucx_perftest", "-t", test, "-s", str(size), "-n", str(iters),
                                 "-p", str(base_port + i), *extra, "127.0.0.1"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(pairs)]
    total = 0.0
    for c in clients:
        out, _ = c.communicate(timeout=600)
        m = [line for line in out.splitlines() if line.startswith("Final:")]
        if not m:
            raise SystemExit(f"ucx_perftest {test} ({tls}) printed no Final line:\n{out}")
        # Final: iters, overhead 50%/avg/overall (us), bandwidth avg/overall (MB/s: 2^20 B), msg rate
        mbs = float(m[0].split()[6])
        total += mbs * MIB / 1e9
    for s in servers:
        s.wait(timeout=60)
    return total


def job(binary, engine, workers, nbytes, updates, tls, direct=True, puts=False):
    """Per-worker GB/s (median over updates after the first) of the main job."""
    args = [binary, "--engine", engine, "--workers", str(workers), "--model-bytes", str(nbytes),
            "--updates", str(updates), "--quiet"]
    if not direct:
        args.append("--no-direct")
    if puts:
        args.append("--ucx-puts")
    out = subprocess.run(args, env=env_with(UCX_TLS=tls, UCX_NET_DEVICES="lo"), capture_output=True, text=True,
                         timeout=900)
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as e:
        raise SystemExit(f"the main job printed no JSON ({' '.join(args)}):\n{out.stderr[-3000:]}") from e
    if not r.get("verified"):
        raise SystemExit(f"the main job did not verify ({' '.join(args)}): {r}")
    times = r["update_seconds"][1:] or r["update_seconds"]
    med = statistics.median(times)
    modes = sorted({t.get("mode", "?") for t in r.get("transports", [])})
    # A worker's CPU seconds per GB received (user + system, every thread), the
    # median over the updates after the first.
    cpu = r["worker_cpu_seconds"][1:] or r["worker_cpu_seconds"]
    return {"gbps": r["bytes"] / med / 1e9, "median_s": med, "bytes": r["bytes"], "modes": modes,
            "transports": r.get("transports", [])[:1], "loop_lag_update_ms": r["worker_loop_lag_ms"]["update"],
            "cpu_s_per_gb": statistics.median(cpu) / (r["bytes"] / 1e9)}


def nixl(python, nbytes, updates, tls):
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([python, os.path.join(here, "nixl_bench.py"), "--bytes", str(nbytes), "--updates",
                          str(updates)], env=env_with(UCX_TLS=tls, UCX_NET_DEVICES="lo"), capture_output=True,
                         text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"nixl_bench printed no JSON:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])["gbps_median"]


def one_round(a, nbytes):
    r = {}
    sm, tcp, smtcp = "sm,self", "tcp,self", "sm,tcp,self"
    chunk = 64 * MIB
    iters = max(1, nbytes // chunk)
    r["perftest_put_sm"] = perftest("ucp_put_bw", chunk, iters, sm)
    r["perftest_put_sm_2pairs"] = perftest("ucp_put_bw", chunk, iters, sm, pairs=2)
    r["ucx_sm_staging"] = job(a.job, "ucx", 1, nbytes, a.updates, sm, direct=False)
    r["ucx_sm_direct"] = job(a.job, "ucx", 1, nbytes, a.updates, sm)
    r["ucx_sm_direct_puts"] = job(a.job, "ucx", 1, nbytes, a.updates, sm, puts=True)
    r["ucx_sm_2workers"] = job(a.job, "ucx", 2, nbytes, a.updates, sm)
    r["tcp"] = job(a.job, "tcp", 1, nbytes, a.updates, sm)
    if not a.sm_only:
        r["perftest_tag_tcp"] = perftest("tag_bw", chunk, iters, tcp)
        r["perftest_tag_tcp_peer"] = perftest("tag_bw", chunk, iters, tcp, extra=("-e",))
        r["ucx_tcp"] = job(a.job, "ucx", 1, nbytes, a.updates, tcp)
        r["ucx_smtcp"] = job(a.job, "ucx", 1, nbytes, a.updates, smtcp)
    if a.nixl_python and not a.sm_only:
        r["nixl_tcp"] = nixl(a.nixl_python, nbytes, a.updates, tcp)
        r["nixl_smtcp"] = nixl(a.nixl_python, nbytes, a.updates, smtcp)
    g = {k: (v["gbps"] if isinstance(v, dict) else v) for k, v in r.items()}
    ratios = {
        "ucx_sm_staging / perftest_put": g["ucx_sm_staging"] / g["perftest_put_sm"],
        "ucx_sm_direct / perftest_put": g["ucx_sm_direct"] / g["perftest_put_sm"],
        "ucx_sm_staging / tcp": g["ucx_sm_staging"] / g["tcp"],
        "ucx_sm_direct / tcp": g["ucx_sm_direct"] / g["tcp"],
        "ucx_sm_direct puts / tagged": g["ucx_sm_direct_puts"] / g["ucx_sm_direct"],
        "ucx_sm 2 workers aggregate / 2 perftest pairs": 2 * g["ucx_sm_2workers"] / g["perftest_put_sm_2pairs"],
    }
    if not a.sm_only:
        ratios["ucx_tcp / tcp"] = g["ucx_tcp"] / g["tcp"]
        ratios["ucx_tcp / perftest_tag"] = g["ucx_tcp"] / g["perftest_tag_tcp"]
        ratios["ucx_tcp / perftest_tag with peer failure handling"] = g["ucx_tcp"] / g["perftest_tag_tcp_peer"]
    if a.nixl_python and not a.sm_only:
        ratios["ucx_tcp / nixl_tcp"] = g["ucx_tcp"] / g["nixl_tcp"]
        ratios["ucx_smtcp / nixl_smtcp"] = g["ucx_smtcp"] / g["nixl_smtcp"]
    cpu = {k: v["cpu_s_per_gb"] for k, v in r.items() if isinstance(v, dict)}
    ratios["worker CPU/GB: ucx_sm_direct / tcp"] = cpu["ucx_sm_direct"] / cpu["tcp"]
    ratios["worker CPU/GB: ucx_sm_direct puts / tagged"] = cpu["ucx_sm_direct_puts"] / cpu["ucx_sm_direct"]
    if not a.sm_only:
        ratios["worker CPU/GB: ucx_tcp / tcp"] = cpu["ucx_tcp"] / cpu["tcp"]
    lag = {k: v["loop_lag_update_ms"] for k, v in r.items() if isinstance(v, dict)}
    return {"raw": r, "gbps": g, "cpu_s_per_gb": cpu, "loop_lag_ms": lag, "ratios": ratios}


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, help="bazel-bin/examples/weight_sync/weight_sync")
    ap.add_argument("--nixl-python", default="", help="a python with nixl-cu13 (tests/bench/ucx_bench.sh makes one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes", default="1G")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--json", default="")
    ap.add_argument("--sm-only", action="store_true", help="only the shared-memory part (no tcp, no NIXL)")
    a = ap.parse_args()
    nbytes = parse_size(a.bytes)
    meta = benchmeta.record(a.rounds)
    rounds = []
    for i in range(a.rounds):
        print(f"[ucx_bench] round {i + 1}/{a.rounds}", file=sys.stderr, flush=True)
        rounds.append(one_round(a, nbytes))
        print(json.dumps({k: round(v, 3) for k, v in rounds[-1]["gbps"].items()}), file=sys.stderr, flush=True)
    summary = {section: {k: spread([r[section][k] for r in rounds]) for k in rounds[0][section]}
               for section in ("gbps", "cpu_s_per_gb", "loop_lag_ms", "ratios")}
    out = {**meta, "bytes": nbytes, "updates": a.updates, "summary": summary, "per_round": rounds}
    print(f"{'measure':<50} median [min-max]")
    for section in ("gbps", "cpu_s_per_gb", "loop_lag_ms", "ratios"):
        for k, s in summary[section].items():
            unit = {"gbps": " GB/s", "cpu_s_per_gb": " worker CPU s/GB", "loop_lag_ms": " ms worker loop lag",
                    "ratios": "x"}[section]
            print(f"{k:<50} {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]{unit}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    # Model bytes are rounded by the job's layout; report what moved.
    print(json.dumps({"bytes_per_update": rounds[0]["raw"]["tcp"]["bytes"]}))


if __name__ == "__main__":
    main()
