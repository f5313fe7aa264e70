"""Runs examples/weight_sync for a benchmark and formats its figures (shared by
sharded_bench.py, loop_lag_bench.py and sharded_delta_bench.py)."""
import json
import subprocess
import sys

import benchmeta


def run(tool, binary, args, timeout=900):
    """The job's last JSON line; exits naming `tool` and the command when the job
    fails or does not verify every byte."""
    cmd = [binary] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.exit(f"{tool}: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(lines[-1])
    if not r.get("verified"):
        sys.exit(f"{tool}: {' '.join(cmd)} did not verify: {r}")
    return r


spread = benchmeta.spread
