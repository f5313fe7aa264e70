"""A trainer process for tests/sglang: connects a refit.sglang.Client to the
server, sends ``--version`` of the model (its MLP weights negated) and stops
before the apply, generation paused: it prints "TRANSFERRED" once every rank
holds the update and then waits to be killed (the test kills it there; the
ranks resume generation at its deadline, ``--timeout-ms``).

    python trainer_proc.py URL MODEL_DIR --version N
"""

from __future__ import annotations

import argparse
import sys
import time

from server import checkpoint

import refit.sglang


class Held(refit.sglang.Client):
    def _ticket(self, op, **kwargs):
        if op == "apply":
            print("TRANSFERRED", flush=True)
            time.sleep(3600)
        return super()._ticket(op, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--timeout-ms", type=int, default=5000)
    args = ap.parse_args()
    tensors = {n: (-t if ".mlp." in n else t) for n, t in checkpoint(args.model).items()}
    with Held(args.url, timeout_ms=args.timeout_ms) as client:
        client.update(tensors, args.version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
