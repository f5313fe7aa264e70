#!/usr/bin/env python3
"""The peer a user would otherwise use: torch.distributed (gloo) broadcast of the
same tensor set from a trainer (rank 0) to N workers, each receiving into its own
preallocated tensors. Prints one JSON line: bytes, seconds per update, GB/s per worker.

usage: gloo_broadcast.py LAYOUT_JSON WORKERS UPDATES [resident|fresh]
LAYOUT_JSON: {"names": [...], "dtype_names": [...], "shapes": [...]} (weight_sync --print-layout)

resident: workers receive straight into their resident model tensors (gloo's best case).
fresh:    workers receive each parameter into a new tensor and copy it into the model,
          the way vLLM's NCCL weight transfer engine feeds load_weights.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from layout import tensor_sizes


def run(rank, world, layout, updates, port, out, pattern):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # gloo in Debian's torch 1.13 cannot broadcast bfloat16; float16 has the same size.
    dtypes = {"bfloat16": torch.float16, "float16": torch.float16, "float32": torch.float32}
    # Resident before the first update, like a served model (no first-touch faults).
    tensors = [torch.zeros(shape, dtype=dtypes[d]) for d, shape in zip(layout["dtype_names"], layout["shapes"])]
    if rank == 0:
        for t in tensors:
            t.view(torch.int16).random_(-1000, 1000) if t.element_size() == 2 else t.random_()
    times = []
    for _ in range(updates):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            if rank == 0 or pattern == "resident":
                dist.broadcast(t, src=0)
            else:
                fresh = torch.empty_like(t)
                dist.broadcast(fresh, src=0)
                t.copy_(fresh)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main():
    layout = json.load(open(sys.argv[1]))
    workers = int(sys.argv[2])
    updates = int(sys.argv[3])
    pattern = sys.argv[4] if len(sys.argv) > 4 else "resident"
    assert pattern in ("resident", "fresh"), pattern
    world = workers + 1
    nbytes = sum(tensor_sizes(layout))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, world, layout, updates, port, out, pattern)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get(timeout=3600)
    for p in procs:
        p.join()
    best = min(times)
    mean = sum(times) / len(times)
    print(json.dumps({"peer": "torch.distributed gloo broadcast", "pattern": pattern, "torch": torch.__version__,
                      "workers": workers, "tensors": len(layout["names"]), "bytes": nbytes,
                      "updates": updates, "seconds_mean": mean, "seconds_best": best,
                      "gbps": nbytes / mean / 1e9}))


if __name__ == "__main__":
    main()
