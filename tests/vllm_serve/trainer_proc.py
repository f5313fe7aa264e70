"""A trainer process that only moves bytes: refit's Sender over the tiny model's
checkpoint tensors (perturbed by a seed), for tests that kill it mid-update.

    python trainer_proc.py MODEL_DIR --seed S [--secret FILE] [--timeout-ms MS]

Prints one JSON line per step on stdout: {"init_info": ...} once prepared, then
{"connected": true} once the worker connected; it then waits for a line on stdin
and sends the update, printing {"sent": true} (or {"error": ...})."""

from __future__ import annotations

import argparse
import json
import sys

import refit

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from weights import checkpoint_tensors  # noqa: E402


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--secret")
    ap.add_argument("--timeout-ms", type=int, default=30000)
    ap.add_argument("--workers", type=int, default=1, help="the server's ranks")
    args = ap.parse_args()
    tensors = checkpoint_tensors(args.model, seed=args.seed)
    with refit.Sender("tcp", timeout_ms=args.timeout_ms, auth_secret_file=args.secret) as sender:
        init = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 1 + args.workers})
        say({"init_info": init})
        sender.connect_workers()
        say({"connected": True})
        sys.stdin.readline()
        try:
            sender.send_weights(list(tensors.items()))
            say({"sent": True})
        except refit.Error as e:
            say({"error": str(e)})


if __name__ == "__main__":
    main()
