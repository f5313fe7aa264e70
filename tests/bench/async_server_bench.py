#!/usr/bin/env python3
"""The async server's request latency while it takes refit updates on its own loop.

Each round starts examples/async_server's server (1 GiB model, double-buffered
tensor_map_target), runs its trainer (init with 4 x 256 MiB staging, then
--updates updates of the whole model, a client sending one request per
--interval-us throughout), then the main job (examples/weight_sync, 1 worker, the
same model and buffers) for the update-time reference, in the same round.

Per round: request p50/p99 idle (before init), during init and during updates;
the targets p99(init), p99(update) < 3 x p99(idle) + 1 ms; and the update's time
over the main job's (target <= 1.1). Prints a table of medians [min-max] over
the rounds and, last, one JSON line.

    bazel build //examples/async_server:all //examples/weight_sync
    python3 tests/bench/async_server_bench.py --rounds 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "bazel-bin", "examples")


def start_server(args):
    cmd = [os.path.join(BIN, "async_server", "async_server"), "--model-bytes", args.model_bytes,
           "--mode", args.mode, "--timeout-ms", "60000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("async_server exited before listening (rc %s)" % proc.wait())
        if line.startswith("ASYNC_SERVER "):
            ports = dict(kv.split("=") for kv in line.split()[1:])
            return proc, int(ports["control"]), int(ports["serve"])
    proc.kill()
    raise SystemExit("async_server did not listen within 120 s")


def last_json(text, what):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("%s printed no JSON:\n%s" % (what, text[-2000:]))


def one_round(args):
    server, control, serve = start_server(args)
    try:
        cmd = [os.path.join(BIN, "async_server", "async_trainer"), "--server", "127.0.0.1:%d" % control,
               "--serve-port", str(serve), "--model-bytes", args.model_bytes, "--updates", str(args.updates),
               "--buffer-bytes", "256M", "--num-buffers", "4", "--request-interval-us", str(args.interval_us),
               "--shutdown"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        served = last_json(run.stdout, "async_trainer")
        if run.returncode != 0 or not served.get("ok"):
            raise SystemExit("async_trainer failed (rc %d): %s\n%s" % (run.returncode, served.get("error"),
                                                                       run.stderr[-2000:]))
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    main = subprocess.run([os.path.join(BIN, "weight_sync", "weight_sync"), "--workers", "1", "--model-bytes",
                           args.model_bytes, "--updates", str(args.updates), "--buffer-bytes", "256M",
                           "--num-buffers", "4", "--quiet"], capture_output=True, text=True, timeout=600)
    job = last_json(main.stdout, "weight_sync")
    if main.returncode != 0 or not job.get("verified"):
        raise SystemExit("weight_sync failed: %s" % job.get("error"))
    lat = served["latency"]
    idle_p99 = lat["idle"]["p99_ms"]
    limit = 3 * idle_p99 + 1.0
    server_update = statistics.median(served["update_seconds"])
    job_update = statistics.median(job["update_seconds"])
    return {
        "idle_p50": lat["idle"]["p50_ms"], "idle_p99": idle_p99,
        "init_p50": lat["init"]["p50_ms"], "init_p99": lat["init"]["p99_ms"], "init_n": lat["init"]["requests"],
        "update_p50": lat["update"]["p50_ms"], "update_p99": lat["update"]["p99_ms"],
        "update_n": lat["update"]["requests"],
        "between_p99": lat["between"]["p99_ms"],
        "limit_ms": limit,
        "init_p99_over_limit": lat["init"]["p99_ms"] / limit,
        "update_p99_over_limit": lat["update"]["p99_ms"] / limit,
        "update_s": server_update, "main_job_update_s": job_update,
        "update_over_main_job": server_update / job_update,
        "init_s": served["init_seconds"],
        "server_loop_lag_ms": served["server_loop_lag"].get("max_ms"),
        "mismatched": served["answers_mismatched"], "busy": served["answers_busy"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-bytes", default="1G")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--interval-us", type=int, default=1000)
    ap.add_argument("--mode", default="double_buffered", choices=["double_buffered", "reader_lock"])
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args))
        print("round %d: %s" % (r + 1, json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                    for k, v in rounds[-1].items()})), file=sys.stderr)
    keys = list(rounds[0].keys())
    summary = {}
    for k in keys:
        vals = [x[k] for x in rounds if x[k] is not None]
        summary[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    print("\nasync server, %d rounds, medians [min-max] (1 request every %d us, %s, %s model):"
          % (args.rounds, args.interval_us, args.mode, args.model_bytes))
    rows = [("request p50 idle / init / update (ms)", ["idle_p50", "init_p50", "update_p50"]),
            ("request p99 idle / init / update (ms)", ["idle_p99", "init_p99", "update_p99"]),
            (
                "p99 over 3 x idle p99 + 1 ms: init / update (target < 1)",
                ["init_p99_over_limit", "update_p99_over_limit"],
            ),
            ("update time: server / main job (s)", ["update_s", "main_job_update_s"]),
            ("update time over the main job's (target <= 1.1)", ["update_over_main_job"]),
            ("server loop's largest stall (ms)", ["server_loop_lag_ms"]),
            ("answers mixing versions", ["mismatched"])]
    for label, ks in rows:
        cells = ["%.3g [%.3g-%.3g]" % (summary[k]["median"], summary[k]["min"], summary[k]["max"]) for k in ks]
        print("  %-58s %s" % (label, " / ".join(cells)))
    met = (summary["init_p99_over_limit"]["median"] < 1 and summary["update_p99_over_limit"]["median"] < 1 and
           summary["update_over_main_job"]["median"] <= 1.1 and all(x["mismatched"] == 0 for x in rounds))
    print(json.dumps({"rounds": rounds, "summary": summary, "targets_met": met}))


if __name__ == "__main__":
    main()
