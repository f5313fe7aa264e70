"""GPU benchmark: handing a PyTorch trainer's weights to an inference worker on the
same GPU, in one run, as ratios:

  handover_vs_d2d   refit (torch_ipc worker, examples/torch_ipc:worker) receiving a
                    2 GiB+ bf16 model, against one device-to-device copy of the same
                    bytes (torch copy_ of a flat buffer): the physical limit.
  many_vs_pytorch   refit against the PyTorch way (what vLLM's IPC engine does): a
                    receiver process rebuilds each tensor from its reduce_tensor
                    handle and copy_()s it into its parameter, per tensor, in
                    Python; on a model of thousands of tensors.

Both sides' walls run from the trainer producing handles to the receiver
confirming that every byte is in its parameters. Each figure is the median of
--reps timed runs after one warm-up (first-touch allocations, handle opening).

  python3 tests/bench/torch_ipc_bench.py --worker-bin PATH [--gib 2.25] [--tensors 4000]

The last line is one JSON object."""

import argparse
import json
import os
import statistics
import sys
import time


def d2d_copy_s(nbytes, reps):
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_model(total_bytes, tensors, seed):
    """`tensors` bf16 tensors of mixed sizes (LLM-like: many small, some large)
    adding up to about total_bytes."""
    import torch
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(tensors, generator=g) ** 4 + 0.001
    sizes = (weights / weights.sum() * (total_bytes // 2)).long().clamp(min=1).tolist()
    return {f"layers.{i}.w": torch.randn(n, device="cuda", dtype=torch.bfloat16) for i, n in enumerate(sizes)}


def pytorch_receiver(conn):
    """The PyTorch way, in its own process: parameters allocated once; per update,
    rebuild each tensor from its handle and copy_ it into its parameter."""
    import torch
    params = None
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if params is None:
            params = {n: torch.empty(shape, dtype=dtype, device="cuda") for n, shape, dtype in msg["specs"]}
        for name, (rebuild, args) in msg["handles"]:
            params[name].copy_(rebuild(*args))
        torch.cuda.synchronize()
        conn.send("done")


def pytorch_way_s(model, reps):
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=pytorch_receiver, args=(child,), daemon=True)
    proc.start()
    specs = [(n, tuple(t.shape), t.dtype) for n, t in model.items()]
    times = []
    try:
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handles = [(n, reduce_tensor(t)) for n, t in model.items()]
            parent.send({"specs": specs, "handles": handles})
            if parent.recv() != "done":
                raise RuntimeError("PyTorch receiver failed")
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        parent.send(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return statistics.median(times)


def refit_s(refit_ipc, client, model, reps, check):
    import torch
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        refit_ipc.send_weights(client, model.items(), weight_version=i + 1)
        if i:
            times.append(time.perf_counter() - t0)
    if check:  # outside the timing: the last update arrived byte for byte
        names = list(model)[:: max(1, len(model) // 50)]
        got = client.call("digest", {"names": names})
        bad = [n for n in names if got[n] != refit_ipc.digest(model[n])]
        if bad:
            raise RuntimeError(f"refit delivered wrong bytes for {bad[:5]}")
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker-bin", required=True)
    p.add_argument("--refit-ipc", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                       "examples", "torch_ipc"))
    p.add_argument("--gib", type=float, default=2.25, help="size of the large model")
    p.add_argument("--large-tensors", type=int, default=300)
    p.add_argument("--tensors", type=int, default=4000, help="tensors of the many-tensor model")
    p.add_argument("--many-gib", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.refit_ipc))
    import refit_ipc
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"bench": "torch_ipc", "skipped": True, "reason": f"no torch in {sys.executable}: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "torch_ipc", "skipped": True,
                          "reason": f"torch {torch.__version__} sees no CUDA device"}))
        return 0

    large = make_model(int(args.gib * (1 << 30)), args.large_tensors, 1)
    large_bytes = sum(t.numel() * 2 for t in large.values())
    many = make_model(int(args.many_gib * (1 << 30)), args.tensors, 2)
    many_bytes = sum(t.numel() * 2 for t in many.values())

    d2d = d2d_copy_s(large_bytes, args.reps)
    with refit_ipc.WorkerProcess([args.worker_bin, "--device", "0"], timeout=60) as worker:
        with refit_ipc.WorkerClient("127.0.0.1", worker.port, timeout=300) as client:
            client.call("init_weight_transfer_engine", {"init_info": {"buffer_bytes": 256 << 20}})
            refit_large = refit_s(refit_ipc, client, large, args.reps, True)
            refit_many = refit_s(refit_ipc, client, many, args.reps, True)
            client.call("shutdown")
    del large
    torch.cuda.empty_cache()
    torch_many = pytorch_way_s(many, args.reps)

    gbps = lambda b, s: round(b / s / 1e9, 2)  # noqa: E731
    result = {
        "bench": "torch_ipc", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "reps": args.reps,
        "large": {"bytes": large_bytes, "tensors": args.large_tensors, "d2d_copy_gbps": gbps(large_bytes, d2d),
                  "refit_gbps": gbps(large_bytes, refit_large), "handover_vs_d2d": round(d2d / refit_large, 3)},
        "many": {"bytes": many_bytes, "tensors": args.tensors, "refit_s": round(refit_many, 4),
                 "pytorch_per_tensor_s": round(torch_many, 4),
                 "refit_speedup_vs_pytorch": round(torch_many / refit_many, 2)},
        "targets": {"handover_vs_d2d": ">= 0.8", "refit_speedup_vs_pytorch": ">= 3"},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
