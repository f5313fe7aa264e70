#!/usr/bin/env python3
"""A PyTorch trainer feeding refit's C++ workers: a small transformer language model
takes real optimizer steps (AdamW, next-token loss on a synthetic language) and
after every step pushes its parameters, straight from named_parameters(), to N
worker processes of the C++ main job (weight_sync --role worker) over refit's tcp
engine. Every update is verified: each worker's fingerprints of what it holds must
equal the trainer's (refit.WorkerGroup.update, verify=True).

    python examples/python/train_and_sync.py --weight-sync bazel-bin/examples/weight_sync/weight_sync \
        --workers 2 --steps 5

--connect HOST:PORT,... drives workers that are already running instead. Prints one
JSON line at the end (steps, losses, update seconds, bytes, verified).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import refit
from tiny_lm import TinyLM, train_step


def start_workers(binary, n, timeout_ms):
    env = dict(os.environ, REFIT_TRAINER_PID=str(os.getpid()))  # the workers die with this trainer
    procs, endpoints = [], []
    for i in range(n):
        p = subprocess.Popen([binary, "--role", "worker", "--listen", "127.0.0.1", "--timeout-ms", str(timeout_ms)],
                             stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None  # stdout=PIPE
        line = p.stdout.readline().split()
        if len(line) != 2 or line[0] != "REFIT_WORKER_PORT":
            p.kill()
            raise SystemExit(f"worker {i} did not start (it printed {line!r})")
        procs.append(p)
        endpoints.append(f"127.0.0.1:{line[1]}")
    return procs, endpoints


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-sync", help="the C++ main job's binary, whose workers this trainer starts")
    ap.add_argument("--connect", help="HOST:PORT,... of running workers (instead of --weight-sync)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="what the workers get (the trainer keeps float32 master weights)")
    ap.add_argument("--timeout-ms", type=int, default=60000)
    ap.add_argument("--auth-secret-file")
    args = ap.parse_args()
    if bool(args.weight_sync) == bool(args.connect):
        ap.error("give --weight-sync (start workers) or --connect (use running ones)")

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dtype = getattr(torch, args.dtype)

    def export():
        # What the inference side serves: the parameters in its dtype. float32 master
        # weights are sent as they are (no copy); bf16 needs one cast per step.
        if dtype == torch.float32:
            return list(model.named_parameters())
        return [(n, p.detach().to(dtype)) for n, p in model.named_parameters()]

    procs = []
    if args.weight_sync:
        procs, endpoints = start_workers(args.weight_sync, args.workers, args.timeout_ms)
    else:
        endpoints = args.connect.split(",")
    sender = refit.Sender("tcp", timeout_ms=args.timeout_ms, auth_secret_file=args.auth_secret_file)
    group = refit.WorkerGroup(endpoints, timeout_ms=args.timeout_ms, auth_secret_file=args.auth_secret_file)
    group.connect()
    layout = refit.describe(export())
    group.call_all("load_model", layout)  # the C++ workers allocate the model's tensors
    group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
    nbytes = sum(t.numel() * t.element_size() for _, t in export())
    print(f"[train_and_sync] {len(layout['names'])} tensors, {nbytes / 1e6:.1f} MB {args.dtype} -> "
          f"{len(endpoints)} C++ workers", file=sys.stderr)

    losses, update_s = [], []
    verified = True
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer, args.vocab, args.seq, args.batch, generator)
        losses.append(loss)
        start = time.perf_counter()
        result = group.update(sender, export(), step)  # raises unless every worker verified
        update_s.append(time.perf_counter() - start)
        verified = verified and result["verified"]
        print(f"[train_and_sync] step {step}: loss {loss:.3f}, update {update_s[-1] * 1000:.1f} ms to "
              f"{len(endpoints)} workers, verified", file=sys.stderr)

    states = [w["state"] for w in group.call_all("weight_info")]
    if procs:
        group.call_all("shutdown")
    group.close()
    sender.shutdown()
    for p in procs:
        p.wait(timeout=30)
    print(json.dumps({"steps": args.steps, "workers": len(endpoints), "tensors": len(layout["names"]),
                      "bytes": nbytes, "losses": losses, "update_seconds": update_s, "worker_states": states,
                      "loss_fell": losses[-1] < losses[0] if len(losses) > 1 else True,
                      "verified": verified and all(s == "clean" for s in states)}))
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
