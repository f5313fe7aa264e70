"""GPU check: refit's Python package (the CUDA wheel, for this interpreter) as a
PyTorch trainer's sender. A refit.Sender("cuda_ipc", device="cuda:0") in this
process feeds a refit worker process (examples/torch_ipc:worker --backend cuda_ipc)
through refit.WorkerGroup, and every tensor is checked through the worker's digest.

  python3 tests/cuda/python_gpu_check.py --worker-bin PATH [--refit-ipc DIR]

Checks:
- the tensors arrive byte for byte;
- tensors written on a side stream behind a long kernel, sent at once while that
  stream is current (``with torch.cuda.stream(s)``), arrive with the new values:
  the sender orders its reads after torch's current stream;
- the same with the side stream named (``stream=s``) while the default stream is
  current;
- a control, not a requirement: the same write sent with ``stream=`` the default
  stream (an order that does not cover the write) reads stale bytes, which shows
  the two checks above can fail.
Prints PASS/FAIL lines and, last, one JSON line; exit status 0 only if every
check passed. Without torch, a GPU or a CUDA build of refit importable here it
prints {"skipped": true, "reason": ...} and exits 0 (the GPU check counts that as
a failure on a GPU machine and as expected in its dry run)."""

import argparse
import json
import os
import sys
import time


def skip(reason):
    print(json.dumps({"check": "python_gpu", "skipped": True, "reason": reason}))
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker-bin", required=True)
    p.add_argument("--refit-ipc", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                       "examples", "torch_ipc"))
    p.add_argument("--sleep-ms", type=float, default=300.0, help="the side stream's kernel before the write")
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.refit_ipc))
    import refit_ipc
    try:
        import torch
    except ImportError as e:
        return skip(f"no torch in {sys.executable}: {e}")
    if not torch.cuda.is_available():
        return skip(f"torch {torch.__version__} sees no CUDA device")
    try:
        import refit
    except ImportError as e:
        return skip(f"refit does not import in {sys.executable} (Python {sys.version.split()[0]}): {e}")
    if getattr(refit, "_BUILD", "cpu") != "cuda":
        return skip(f"refit at {refit.__file__} is the {refit._BUILD} build, not the CUDA one")

    dev = torch.device("cuda:0")
    # torch.cuda._sleep spins for a number of clock cycles: calibrate it here.
    probe = 20_000_000
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    cycles_per_ms = probe / max((time.perf_counter() - t0) * 1000, 1e-3)
    sleep_cycles = int(cycles_per_ms * args.sleep_ms)

    torch.manual_seed(0)
    model = {f"layers.{i}.w": torch.randn(1 << 16, device=dev, dtype=torch.bfloat16) for i in range(16)}
    model["embed"] = torch.randn(3 << 20, device=dev, dtype=torch.bfloat16)  # 6 MiB: split over 4 MiB buffers
    model["norm"] = torch.ones(64, device=dev, dtype=torch.float32)
    results = {}
    figures = {"sleep_ms": args.sleep_ms, "cycles_per_ms": round(cycles_per_ms)}

    def report(label, ok, detail=""):
        results[label] = bool(ok)
        print(("PASS " if ok else "FAIL ") + label + (f": {detail}" if detail else ""))

    with refit_ipc.WorkerProcess([args.worker_bin, "--device", "0", "--backend", "cuda_ipc"], timeout=60) as worker:
        sender = refit.Sender("cuda_ipc", device="cuda:0", timeout_ms=60000)
        with refit.WorkerGroup([f"127.0.0.1:{worker.port}"], timeout_ms=60000) as group:
            group.connect()
            group.init(sender, {"master_address": "127.0.0.1", "master_port": 0, "buffer_bytes": 4 << 20,
                                "num_buffers": 2})
            version = 0

            def digests_match(label):
                torch.cuda.synchronize()
                got = group.call_all("digest", {"names": list(model)})[0]
                bad = [n for n, t in model.items() if got[n] != refit_ipc.digest(t)]
                return not bad, (f"differ: {bad[:4]}" if bad else "")

            def write_behind_kernel(side, value):
                with torch.cuda.stream(side):
                    torch.cuda._sleep(sleep_cycles)
                    for t in model.values():
                        t.fill_(value)

            version += 1
            t = time.perf_counter()
            group.update(sender, model, version, verify=False)
            figures["first_update_s"] = round(time.perf_counter() - t, 4)
            ok, why = digests_match("first")
            report("the first update arrives byte for byte", ok, why)

            side = torch.cuda.Stream(device=dev)
            # 1. Written on the side stream, sent while it is current.
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                write_behind_kernel(side, 1.5)
                version += 1
                t = time.perf_counter()
                group.update(sender, model, version, verify=False)
                figures["ordered_current_stream_update_s"] = round(time.perf_counter() - t, 4)
            ok, why = digests_match("current")
            report("tensors written on torch's current stream are read after that work", ok, why)

            # 2. Written on the side stream, named with stream= (the default stream current).
            torch.cuda.synchronize()
            write_behind_kernel(side, 2.5)
            version += 1
            t = time.perf_counter()
            group.update(sender, model, version, verify=False, stream=side)
            figures["ordered_named_stream_update_s"] = round(time.perf_counter() - t, 4)
            ok, why = digests_match("named")
            report("tensors written on a stream named with stream= are read after that work", ok, why)

            # The same through Sender.send_weights' own path is what group.update uses;
            # a control: an order that does not cover the write (the default stream,
            # idle) lets the send read the old bytes while the side stream still sleeps.
            torch.cuda.synchronize()
            write_behind_kernel(side, 3.5)
            version += 1
            group.update(sender, model, version, verify=False, stream=torch.cuda.default_stream(dev))
            stale, _ = digests_match("control")
            figures["unordered_send_read_stale_bytes"] = not stale
            print(f"control: a send ordered after the wrong stream read "
                  f"{'stale' if not stale else 'the new'} bytes (stale expected: the checks above can fail)")
            group.call_all("shutdown")
        sender.shutdown()

    passed = all(results.values()) and len(results) == 3
    print(json.dumps({"check": "python_gpu", "passed": passed, "python": sys.version.split()[0],
                      "torch": torch.__version__, "refit": refit.__version__, "gpu": torch.cuda.get_device_name(0),
                      "results": results, **figures}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
