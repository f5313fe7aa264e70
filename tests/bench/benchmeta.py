#!/usr/bin/env python3
"""What every benchmark's JSON records about its run: command, commit, date, rounds.

    import benchmeta                              # a Python benchmark in tests/bench
    report = {**benchmeta.record(rounds), ...}

    python3 tests/bench/benchmeta.py --rounds N -- COMMAND...   # a shell benchmark:
                                                  # prints the four as one JSON object

  command  $REFIT_BENCH_COMMAND when a wrapper set it (./refit bench,
           tests/bench/ucx_bench.sh: what the user typed), else the script's own
           command line, its path relative to the repository root
  commit   HEAD's short hash, "+dirty" after it when tracked files differ from
           HEAD (then no commit holds the code that ran)
  date     today, YYYY-MM-DD
  rounds   how many rounds each median and [min-max] is over

tests/bench/figures.py prints them in each table's caption, tests/bench/plot.py in
each plot's title. Take the record when the run starts: the tree may change while
it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def commit() -> str:
    head = _git("rev-parse", "--short", "HEAD").stdout.strip() or "?"
    dirty = _git("diff", "--quiet", "HEAD").returncode != 0
    return head + ("+dirty" if dirty else "")


def command(argv: list[str]) -> str:
    given = os.environ.get("REFIT_BENCH_COMMAND")
    if given:
        return given
    script = os.path.abspath(argv[0])
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return shlex.join([script, *argv[1:]])


def record(rounds: int, argv: list[str] | None = None) -> dict:
    return {"command": command(sys.argv if argv is None else argv), "commit": commit(),
            "date": datetime.date.today().isoformat(), "rounds": rounds}


def spread(xs: list[float], digits: int = 3) -> str:
    """'median [min-max]', the form every benchmark prints its rounds in."""
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("argv", nargs="+", help="the benchmark's command line (after --)")
    a = ap.parse_args()
    print(json.dumps(record(a.rounds, a.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
