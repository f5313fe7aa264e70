#!/usr/bin/env python3
"""An update of a real SGLang server on this machine's CPUs (docs/sglang.md):
through refit (``refit.sglang.Client.update``: check, refit's transfer into every
rank's host buffer, apply) against refit's transfer alone (the same update's
transfer phase) and against SGLang's own ``/update_weights_from_tensor`` moving the
same tensors (serialized by SGLang's MultiprocessingSerializer, CPU tensors shared
with the server's process, loaded by the model's load_weights: the path verl's and
slime's colocated SGLang engines use).

Per round, in alternating order, one update each way, the server then checked to
answer with the tensors it was sent (greedy tokens against the reference of that
version, and its weight_version). Medians of ROUNDS rounds with [min-max], ratios
within a round.

Run in tests/sglang's venv, with refit installed there (tests/sglang/run.sh
--bench does both):
  VENV/bin/python tests/bench/sglang_bench.py [--hidden 1024] [--layers 4] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time

import benchmeta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "sglang"))

from server import SGLangServer, checkpoint, make_model  # noqa: E402


def sglang_own(server: SGLangServer, tensors: dict, version: int) -> float:
    """SGLang's own update from tensors: serialize, then begin / update / end. The
    tensors go as shared-memory files (torch's file_system strategy): its default,
    file descriptors handed over by multiprocessing's resource sharer, needs the
    server's authkey, which only processes SGLang started have (another process's
    payload ends the server's scheduler: "digest received was wrong")."""
    import torch.multiprocessing
    from sglang.srt.utils.common import MultiprocessingSerializer

    torch.multiprocessing.set_sharing_strategy("file_system")

    t0 = time.monotonic()
    payload = base64.b64encode(MultiprocessingSerializer.serialize(list(tensors.items()))).decode()
    for route, body in (("/begin_weight_update", {}),
                        ("/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                         "weight_version": str(version), "flush_cache": True}),
                        ("/end_weight_update", {})):
        r = server.post(route, body, timeout=600)
        if r.status_code != 200:
            raise SystemExit(f"sglang_bench: {route}: HTTP {r.status_code}: {r.text[:500]}")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    meta = benchmeta.record(args.rounds)
    import refit.sglang

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers)
        original = checkpoint(model)
        negated = {n: (-t if ".mlp." in n else t) for n, t in original.items()}
        nbytes = sum(t.numel() * t.element_size() for t in original.values())
        server = SGLangServer(model, os.path.join(tmp, "sglang.log"), start_timeout_s=300).start()
        try:
            reference = {"original": server.generate().tokens}
            client = refit.sglang.Client(server.url, timeout_ms=120000)
            client.update(negated, 1)  # connects; the first update also warms both paths
            reference["negated"] = server.generate().tokens
            sglang_own(server, original, 2)
            rows, version = [], 2
            for r in range(args.rounds):
                row: dict = {}
                for way in (("refit", "sglang") if r % 2 == 0 else ("sglang", "refit")):
                    version += 1
                    which = "negated" if version % 2 else "original"
                    tensors = negated if which == "negated" else original
                    if way == "refit":
                        out = client.update(tensors, version)
                        row.update(refit_s=out["seconds"], transfer_s=out["transfer_s"], check_s=out["check_s"],
                                   apply_s=out["apply_s"])
                    else:
                        row["sglang_s"] = sglang_own(server, tensors, version)
                    answer = server.generate()
                    if answer.tokens != reference[which] or answer.weight_version != str(version):
                        raise SystemExit(f"sglang_bench: after {way}'s update {version} the server answers "
                                         f"{answer} (expected the {which} tokens {reference[which]})")
                row["refit_vs_sglang"] = row["refit_s"] / row["sglang_s"]
                row["transfer_share"] = row["transfer_s"] / row["refit_s"]
                rows.append(row)
                print(f"round {r + 1}: {nbytes / 1e6:.0f} MB: refit {row['refit_s']:.3f} s (check "
                      f"{row['check_s']:.3f}, transfer {row['transfer_s']:.3f}, apply {row['apply_s']:.3f}), "
                      f"SGLang's own {row['sglang_s']:.3f} s", flush=True)
            client.close()
        finally:
            alive = server.alive()
            server.stop()
        if not alive:
            raise SystemExit("sglang_bench: the server died")
    report = {**meta, "model_bytes": nbytes, "tensors": len(original), "hidden": args.hidden, "layers": args.layers,
              "per_round": rows}
    for key in ("refit_s", "transfer_s", "sglang_s", "refit_vs_sglang", "transfer_share"):
        print(f"{key}: {benchmeta.spread([r[key] for r in rows])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
