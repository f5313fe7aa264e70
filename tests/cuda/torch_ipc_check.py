"""GPU test: a real PyTorch trainer (this process, torch with CUDA) feeds a refit
worker process (examples/torch_ipc:worker, C++) through refit_ipc.py, and every
tensor is checked byte for byte through the worker's digest.

  python3 tests/cuda/torch_ipc_check.py --worker-bin PATH [--refit-ipc DIR]

Checks: a model whose tensors share allocations, sit at storage offsets (slices of a
larger buffer) and mix dtypes arrives exactly, twice (new values the second time);
a non-contiguous tensor is refused by the helper, and a forged entry (a transposed
stride) by the worker, which keeps serving; the worker's weight_info says clean,
version 2, and a second update of the same tensors opens no new mapping. Prints
PASS/FAIL lines and, last, one JSON line. Exit status 0 only if everything passed.
Without torch or a GPU it prints {"skipped": true, "reason": ...} and exits 0: the
GPU check (tests/cuda/gpu_check.sh) counts that as a failure on a GPU machine and as
the expected outcome of its dry run. The worker dies with this process."""

import argparse
import json
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker-bin", required=True)
    p.add_argument("--refit-ipc", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                       "examples", "torch_ipc"))
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.refit_ipc))
    import refit_ipc
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"check": "torch_ipc", "skipped": True, "reason": f"no torch in {sys.executable}: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"check": "torch_ipc", "skipped": True,
                          "reason": f"torch {torch.__version__} sees no CUDA device"}))
        return 0

    results = {}
    with refit_ipc.WorkerProcess([args.worker_bin, "--device", "0"], timeout=60) as worker:
        port = worker.port
        torch.manual_seed(0)
        dev = torch.device("cuda:0")
        flat = torch.randn(1 << 20, device=dev, dtype=torch.bfloat16)  # slices share this allocation
        model = {
            "embed": torch.randn(3000, 64, device=dev, dtype=torch.bfloat16),
            "slice.a": flat[1000:1000 + 4096],          # storage offset 1000 elements
            "slice.b": flat[9001:9001 + 333],            # odd offset: 2-byte aligned only
            "norm": torch.ones(64, device=dev, dtype=torch.float32),
            "fp16": torch.randn(17, 5, device=dev, dtype=torch.float16),
            "ids": torch.arange(1000, device=dev, dtype=torch.int64),
            "big": torch.randn(40 << 20, device=dev, dtype=torch.bfloat16),  # 80 MiB: split over buffers
            "scalar": torch.tensor(3.5, device=dev),
        }
        for i in range(500):
            model[f"layers.{i}.bias"] = torch.randn(1 + i % 97, device=dev, dtype=torch.bfloat16)

        def check_digests(client, label):
            got = client.call("digest", {"names": list(model)})
            bad = [n for n, t in model.items() if got[n] != refit_ipc.digest(t)]
            results[label] = not bad
            print(("PASS " if not bad else "FAIL ") + label + (f": differ: {bad[:5]}" if bad else ""))

        with refit_ipc.WorkerClient("127.0.0.1", port, timeout=120) as client:
            client.call("init_weight_transfer_engine", {"init_info": {"buffer_bytes": 16 << 20}})
            state = refit_ipc.send_weights(client, model.items(), weight_version=1)
            check_digests(client, "first update arrives byte for byte")
            with torch.no_grad():
                for t in model.values():
                    t.add_(1) if t.dtype != torch.int64 else t.mul_(3)
            before = client.call("ipc_stats")
            state = refit_ipc.send_weights(client, model.items(), weight_version=2)
            check_digests(client, "second update (new values) arrives byte for byte")
            after = client.call("ipc_stats")
            opens = (before["opens"], after["opens"])
            ok = opens[0] == opens[1] and opens[0] > 0
            results["the second update opens no new mapping"] = ok
            print(("PASS" if ok else "FAIL") + f" the second update opens no new mapping (opens {opens})")
            ok = state["weight_version"] == 2 and state["state"] == "clean"
            results["weight_info clean, version 2"] = ok
            print(("PASS" if ok else "FAIL") + f" weight_info clean, version 2: {state.get('state')}, "
                  f"{state.get('weight_version')}")

            try:
                refit_ipc.update_info([("t", torch.randn(8, 4, device=dev).t())])
                ok = False
            except ValueError as e:
                ok = "contiguous" in str(e)
            results["helper refuses a non-contiguous tensor"] = ok
            print(("PASS" if ok else "FAIL") + " helper refuses a non-contiguous tensor")

            info = refit_ipc.update_info([("embed", model["embed"])])
            key = next(iter(info["ipc_handles"][0]))
            info["ipc_handles"][0][key]["stride"] = [1, 3000]
            try:
                refit_ipc.send_update(client, info)
                ok = False
            except refit_ipc.RefitError as e:
                ok = e.kind == "invalid_argument" and "not contiguous" in e.message
            state = refit_ipc.send_weights(client, model.items(), weight_version=3)
            ok = ok and state["state"] == "clean"
            results["worker refuses a forged entry and goes on"] = ok
            print(("PASS" if ok else "FAIL") + " worker refuses a forged entry and goes on")

            # An empty tensor has no storage handle (the helper sends zeros).
            extra = dict(model)
            extra["empty"] = torch.empty(0, 8, device=dev, dtype=torch.bfloat16)
            try:
                state = refit_ipc.send_weights(client, extra.items(), weight_version=4)
                ok = state["state"] == "clean"
            except refit_ipc.RefitError as e:
                ok = False
                print(f"  empty tensor: {e}")
            results["an empty tensor needs no handle"] = ok
            print(("PASS" if ok else "FAIL") + " an empty tensor needs no handle")
            client.call("shutdown")
    passed = all(results.values()) and len(results) == 7
    print(json.dumps({"check": "torch_ipc", "passed": passed, "tensors": len(model),
                      "bytes": sum(t.numel() * t.element_size() for t in model.values()),
                      "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
