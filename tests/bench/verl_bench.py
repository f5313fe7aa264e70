#!/usr/bin/env python3
"""refit through verl's checkpoint-engine flow against refit's own Python API moving
the same bytes (docs/verl.md): one actor process and ROLLOUTS rollout processes
(tests/verl/ranks.py, verl's registry as its manager drives it), a model of
MODEL_BYTES bf16 in TENSORS tensors made once in the actor.

Per round, in alternating order: one verl step (prepare, build_topology,
init_process_group, send_weights / receive_weights, finalize; the connections of
the first step are kept, as in a run) and one ``WorkerGroup.update`` of the same
tensors from the same actor process to a plain ``refit.WorkerHost`` in each rollout
process. Figures: each's transfer seconds (the actor's send_weights / update call),
their ratio (refit alone / through verl: at least 0.9 is the target), and the
step's overhead (prepare + topology + init + finalize, timed by the driver) as a
share of its transfer (at most 5%). Medians of ROUNDS rounds with [min-max].

Run in tests/verl's venv:
  ~/.cache/refit/venv-requirements-verl-311/bin/python tests/bench/verl_bench.py \\
      [--model-bytes 1100M] [--tensors 44] [--rollouts 2] [--rounds 3] [--bucket-mb 2048]
      [--json FILE]
"""
import argparse
import json
import os
import statistics
import sys
import time

import benchmeta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "verl"))

from ranks import Rank  # noqa: E402


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


spread = benchmeta.spread


def verl_step(actor: Rank, rollouts: list[Rank], number: int) -> tuple[float, float]:
    """One verl step: (transfer seconds, overhead seconds)."""
    from refit.verl import RefitCheckpointEngine

    ranks = [actor] + rollouts
    t0 = time.monotonic()
    metadata = [r.call("prepare") for r in ranks]
    akw, rkw = RefitCheckpointEngine.build_topology(1, len(rollouts), metadata)
    actor.post("call", method="init_process_group", kwargs={k: v[0] for k, v in akw.items()})
    for i, r in enumerate(rollouts):
        r.post("call", method="init_process_group", kwargs={k: v[i] for k, v in rkw.items()})
    for r in ranks:
        assert r.wait(300)[0] == "ok"
    setup = time.monotonic() - t0
    actor.post("send_kept", step=number)
    for r in rollouts:
        r.post("receive_only", step=number)
    sent = actor.wait(300)
    assert sent[0] == "ok", sent
    for r in rollouts:
        got = r.wait(300)
        assert got[0] == "ok", got
    t1 = time.monotonic()
    for r in ranks:
        r.call("finalize")
    return sent[1], setup + (time.monotonic() - t1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-bytes", default="1100M")
    p.add_argument("--tensors", type=int, default=44)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=2048)
    p.add_argument("--json")
    a = p.parse_args()
    # verl's default bucket (update_weights_bucket_megabytes: 2048)
    opts = {"address": "127.0.0.1", "timeout_ms": 120000, "bucket_size": a.bucket_mb << 20}
    actor = Rank("master", **opts)
    rollouts = [Rank("rollout", **opts) for _ in range(a.rollouts)]
    try:
        actor.post("bench_model", tensors=a.tensors, bytes=size(a.model_bytes))
        model_bytes = actor.wait(300)[1]
        ports = []
        for r in rollouts:
            r.post("plain_host")
            ports.append(r.wait(60)[1])
        verl_step(actor, rollouts, 1)  # the first step builds the topology (as a run's first step does)
        actor.post("plain_update", ports=ports, step=1)
        assert actor.wait(300)[0] == "ok"
        report = {**benchmeta.record(a.rounds), "model_bytes": model_bytes, "tensors": a.tensors,
                  "rollouts": a.rollouts, "per_round": []}
        for k in range(a.rounds):
            got = {}
            for mode in (("verl", "plain") if k % 2 == 0 else ("plain", "verl")):
                if mode == "verl":
                    got["verl_s"], got["overhead_s"] = verl_step(actor, rollouts, 2 + k)
                else:
                    actor.post("plain_update", ports=ports, step=2 + k)
                    answer = actor.wait(300)
                    assert answer[0] == "ok", answer
                    got["plain_s"] = answer[1]
            row = {**got, "ratio": got["plain_s"] / got["verl_s"], "overhead_share": got["overhead_s"] / got["verl_s"]}
            report["per_round"].append(row)
            print(f"round {k + 1}: through verl {row['verl_s']:.3f} s, refit alone {row['plain_s']:.3f} s, "
                  f"ratio {row['ratio']:.3f}; step overhead {row['overhead_s'] * 1000:.1f} ms "
                  f"({row['overhead_share'] * 100:.2f}%)", flush=True)
        rows = report["per_round"]
        for key in ("verl_s", "plain_s", "ratio", "overhead_s", "overhead_share"):
            xs = [r[key] for r in rows]
            report[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        print("refit alone / through verl:", spread([r["ratio"] for r in rows]),
              "| step overhead share:", spread([r["overhead_share"] for r in rows], 4))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
    finally:
        for r in [actor] + rollouts:
            r.close()


if __name__ == "__main__":
    main()
