#!/usr/bin/env python3
"""Plots for docs/benchmarks.md, made from the benchmarks' own JSON output.

    venv=$(bash python/venv.sh --requirements tests/bench/requirements-plot.txt \
               --check tests/bench/plot_venv_check.py | tail -n 1)
    $venv/bin/python tests/bench/plot.py [--netns FILE] [--loopback FILE] [--out docs/img]
    $venv/bin/python tests/bench/plot.py [--check]

With no FILE it draws every committed plot from its committed JSON (PLOTS below:
docs/img/netns_scale.png from docs/bench/netns_scale.json, docs/img/loopback.png from
docs/bench/loopback.json) into --out; --check draws them into a temporary folder
and exits 1, naming each, where one differs from the committed PNG.

--netns FILE     the JSON of `tests/bench/netns_scale.sh --json FILE`: seconds per
                 update against the number of workers, one line per topology
                 (star, chain, tree:K, ...), each point the median of the rounds
                 with the min-max range as its error bar, and the star's ideal
                 (N x one worker) dashed -> netns_scale.png
--loopback FILE  the JSON of `tests/bench/run.sh --json FILE`: refit's aggregate
                 throughput against its limits (iperf3 pairs, socket pairs over
                 model-sized memory) for 1, 2 and 4 workers, and refit against its
                 peers (gloo, Mooncake) as ratios with their targets -> loopback.png

Every figure's caption line names the date, commit and rounds the JSON records
(tests/bench/benchmeta.py writes them), so a plot is never newer than its numbers.

The output is deterministic: fixed size and DPI, matplotlib's bundled fonts, no
"Software" text in the PNG, pinned versions (tests/bench/requirements-plot.txt).
--check still compares decoded pixels, not bytes: PNG bytes also carry the
compression Pillow and zlib chose, which may change while the image does not. A
pixel counts as changed when a channel moves by more than PIXEL_TOLERANCE (of 255),
which absorbs antialiasing that rounds differently; a changed digit in a caption, a
moved point or a bar of another height moves pixels by far more than that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DPI = 110
PIXEL_TOLERANCE = 16


def _stamp(report: dict) -> str:
    return f"measured {report.get('date', '?')} at {report.get('commit', '?')}"


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_netns(report: dict, out: str) -> str:
    runs = report["runs"]
    topos = list(dict.fromkeys(r["topology"] for r in runs))
    ns = sorted({r["n"] for r in runs})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for t in topos:
        xs, med, lo, hi = [], [], [], []
        for n in ns:
            v = [r["seconds"] / r["updates"] for r in runs if r["n"] == n and r["topology"] == t]
            if not v:
                continue
            m = statistics.median(v)
            xs.append(n)
            med.append(m)
            lo.append(m - min(v))
            hi.append(max(v) - m)
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=t)
    if "star" in topos:
        one = statistics.median(r["seconds"] / r["updates"] for r in runs if r["n"] == 1 and r["topology"] == "star")
        ax.plot(ns, [one * n for n in ns], "k--", linewidth=0.8, label="N x one worker")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("workers")
    ax.set_ylabel("seconds per update")
    rounds = max(r.get("round", 1) for r in runs)
    ax.set_title(f"tcp engine, {report['model']} model, {report['rate']} per host each way\n"
                 f"median of {rounds} rounds, bars min-max; {_stamp(report)}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "netns_scale.png")


def plot_loopback(report: dict, out: str) -> str:
    s = report["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2))
    ns = [n for n in (1, 2, 4) if f"refit_{n}_workers_aggregate_gbps" in s]
    series = [("refit (aggregate)", "refit_{n}_workers_aggregate_gbps"),
              ("socket pairs, model-sized memory", "socket_{n}_pairs_resident_gbps"),
              ("iperf3 pairs", "iperf3_{n}_pairs_gbps")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        vals = [s[key.format(n=n)] for n in ns]
        xs = [j + (i - 1) * width for j in range(len(ns))]
        a.bar(xs, [v["median"] for v in vals], width,
              yerr=[[v["median"] - v["min"] for v in vals], [v["max"] - v["median"] for v in vals]],
              capsize=3, label=label)
    a.set_xticks(range(len(ns)))
    a.set_xticklabels([f"{n} worker{'s' if n > 1 else ''}" for n in ns])
    a.set_ylabel("GB/s")
    a.set_title("refit tcp vs the machine's limits (loopback)", fontsize=9)
    a.legend(fontsize=8)
    a.grid(True, axis="y", alpha=0.3)
    peers = [("vs gloo, resident\n(2 workers)", "refit_vs_gloo_resident_2", 1.3),
             ("vs gloo as vLLM\nuses it (2 workers)", "refit_vs_gloo_fresh_copy_2", None),
             ("vs Mooncake\n(2 targets)", "refit_vs_mooncake_2", 1.5),
             ("vs gloo, one\n400 MiB tensor", "refit_vs_gloo_one_tensor", 1.0)]
    peers = [p for p in peers if p[1] in s]
    vals = [s[k] for _, k, _ in peers]
    b.bar(range(len(peers)), [v["median"] for v in vals],
          yerr=[[v["median"] - v["min"] for v in vals], [v["max"] - v["median"] for v in vals]], capsize=3)
    for i, (_, _, target) in enumerate(peers):
        if target is not None:
            b.plot([i - 0.4, i + 0.4], [target, target], "r--", linewidth=1)
    b.axhline(1.0, color="k", linewidth=0.6)
    b.set_xticks(range(len(peers)))
    b.set_xticklabels([p[0] for p in peers], fontsize=8)
    b.set_ylabel("refit / peer (throughput), red: target")
    b.set_title("refit vs the peers a user would pick", fontsize=9)
    b.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{report['model']} bf16 model, medians of {report['rounds']} rounds, bars min-max; "
                 f"{_stamp(report)}", fontsize=9)
    return _save(fig, out, "loopback.png")


# The committed plots: (PNG under docs/img, how it is drawn, its JSON).
PLOTS = (("netns_scale.png", plot_netns, "docs/bench/netns_scale.json"),
         ("loopback.png", plot_loopback, "docs/bench/loopback.json"))


def changed_pixels(a: str, b: str) -> int | None:
    """How many pixels of a and b differ by more than PIXEL_TOLERANCE in a channel;
    None when their sizes differ."""
    x, y = (np.asarray(matplotlib.image.imread(p)[..., :3] * 255, dtype=np.int16) for p in (a, b))
    if x.shape != y.shape:
        return None
    return int((np.abs(x - y).max(axis=-1) > PIXEL_TOLERANCE).sum())


def check() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as out:
        for name, plot, report in PLOTS:
            committed = os.path.join(ROOT, "docs/img", name)
            if not os.path.exists(os.path.join(ROOT, report)) or not os.path.exists(committed):
                n, why = None, "the PNG or its JSON is missing"
            else:
                n = changed_pixels(committed, plot(json.load(open(os.path.join(ROOT, report))), out))
                why = "of another size" if n is None else f"{n} pixels differ"
            if n == 0:
                continue
            bad += 1
            print(f"plot: docs/img/{name} is not what {report} draws ({why}); "
                  "tests/bench/plot.py with no arguments redraws it")
    print("plot: " + (f"{bad} of {len(PLOTS)} plots differ from their JSON" if bad else
                      f"{len(PLOTS)} plots, each as its JSON draws it"))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--netns", help="JSON of tests/bench/netns_scale.sh --json")
    ap.add_argument("--loopback", help="JSON of tests/bench/run.sh --json")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/img"), help="folder for the PNGs (default docs/img)")
    ap.add_argument("--check", action="store_true",
                    help="draw the committed plots afresh and exit 1 where one differs from its PNG")
    args = ap.parse_args()
    if args.check:
        return check()
    os.makedirs(args.out, exist_ok=True)
    if args.netns:
        print(plot_netns(json.load(open(args.netns)), args.out))
    if args.loopback:
        print(plot_loopback(json.load(open(args.loopback)), args.out))
    if not args.netns and not args.loopback:
        for _, plot, report in PLOTS:
            print(plot(json.load(open(os.path.join(ROOT, report))), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
