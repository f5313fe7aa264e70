#!/usr/bin/env python3
"""The PyTorch trainer of train_and_sync.py feeding a Python worker that receives
through vLLM's weight-transfer interface with refit as its backend.

The worker (started by this script with --role worker) is what a vLLM server does
with a weight update, without the server: vLLM's plugin loader registers the
`refit` backend (refit's wheel declares the vllm.general_plugins entry point);
vLLM's WeightTransferEngineFactory builds the engine from
WeightTransferConfig(backend="refit") for the worker's model; vLLM's RLHF routes
(POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
/finish_weight_update) call it in vLLM's worker order, and the engine loads every
chunk through the model's own load_weights([(name, tensor)]).

The trainer uses vLLM's trainer side as is: WeightTransferTrainerFactory.trainer_init(
RefitTrainerInitInfo(...), client=HTTPVLLMWeightSyncClient(url),
source=ModuleSource(model)).send_weights() after every optimizer step. It then checks
that the worker holds exactly its weights (refit fingerprints of every parameter)
and computes the same logits.

    python examples/python/vllm_worker.py --steps 5

Prints one JSON line at the end (steps, losses, send seconds, verified).
"""

import argparse
import http.server
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CUDA wheel on a machine without a GPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

import refit  # noqa: E402
from tiny_lm import TinyLM, batch, train_step  # noqa: E402

ARCH = dict(vocab=512, d_model=64, layers=2, heads=4, seq=16)


class ServedModel(TinyLM):
    """The inference side's model: vLLM models take weights through load_weights."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)  # refit's tensors are views: copy them in
                loaded.add(name)
        return loaded


def worker(port_file):
    from vllm.config import ParallelConfig, VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # refit.vllm:register, through the wheel's entry point
    model = ServedModel(**ARCH)
    config = VllmConfig(parallel_config=ParallelConfig(), weight_transfer_config=WeightTransferConfig(backend="refit"))
    engine = WeightTransferEngineFactory.create_engine(
        config.weight_transfer_config, config, torch.device("cpu"), model
    )
    state = {"active": False, "version": None}
    lock = threading.Lock()

    class Routes(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, status, content):
            data = json.dumps(content).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/fingerprints":
                with lock:
                    fp = refit.fingerprints([(n, p.detach()) for n, p in model.named_parameters()])
                self._reply(200, {"version": state["version"], "fingerprints": {k: str(v) for k, v in fp.items()}})
            elif self.path.startswith("/logits"):
                tokens = torch.tensor(json.loads(self.headers["X-Tokens"]))
                with lock, torch.no_grad():
                    self._reply(200, {"logits": model(tokens).flatten().tolist()})
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802 - vLLM's order (vllm/v1/worker/gpu_worker.py)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            path = self.path.strip("/")
            try:
                with lock:
                    if path == "init_weight_transfer_engine":
                        engine.init_transfer_engine(engine.parse_init_info(body["init_info"]))
                    elif path == "start_weight_update":
                        if state["active"]:
                            raise RuntimeError("a weight update is already active")
                        engine.start_weight_update()
                        state["active"] = True
                    elif path == "update_weights":
                        if not state["active"]:
                            raise RuntimeError("start_weight_update must come first")
                        try:
                            engine.update_weights(body["update_info"])
                        except BaseException:
                            state["active"] = False
                            raise
                    elif path == "finish_weight_update":
                        try:
                            engine.finish_weight_update()
                        finally:
                            state["active"] = False
                        state["version"] = (body or {}).get("weight_version")
                    elif path == "shutdown_weight_transfer_engine":
                        engine.shutdown()
                    else:
                        self._reply(404, {"detail": "Not Found"})
                        return
            except Exception as e:  # noqa: BLE001 - answered as vLLM's server does
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})
                return
            self._reply(200, {"message": "ok"})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    parent = os.getppid()

    def watch_parent():  # die with the trainer
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    server.serve_forever()


def trainer(args):
    import tempfile

    import requests
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from refit.vllm import RefitTrainerInitInfo, register

    register()  # the trainer's process: vLLM loads plugins only in its own processes
    port_file = os.path.join(tempfile.mkdtemp(), "port")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "worker", "--port-file", port_file])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{open(port_file).read()}"

        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        model = TinyLM(**ARCH)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        client = HTTPVLLMWeightSyncClient(url, timeout=120)
        engine = WeightTransferTrainerFactory.trainer_init(
            RefitTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0),
            client=client, source=ModuleSource(model))
        print(f"[vllm_worker] trainer connected to the vLLM-style worker at {url} through refit", file=sys.stderr)
        losses, send_s, verified = [], [], True
        probe, _ = batch(ARCH["vocab"], ARCH["seq"], 2, torch.Generator().manual_seed(99))
        for step in range(1, args.steps + 1):
            losses.append(train_step(model, optimizer, ARCH["vocab"], ARCH["seq"], 16, generator))
            start = time.perf_counter()
            engine.send_weights(f"step-{step}")
            send_s.append(time.perf_counter() - start)
            got = requests.get(f"{url}/fingerprints", timeout=60).json()
            mine = refit.fingerprints([(n, p.detach()) for n, p in model.named_parameters()])
            same = got["version"] == f"step-{step}" and got["fingerprints"] == {k: str(v) for k, v in mine.items()}
            with torch.no_grad():
                expected = model(probe).flatten().tolist()
            served = requests.get(f"{url}/logits", headers={"X-Tokens": json.dumps(probe.tolist())}, timeout=60).json()
            same = same and served["logits"] == expected
            verified = verified and same
            print(f"[vllm_worker] step {step}: loss {losses[-1]:.3f}, send_weights {send_s[-1] * 1000:.1f} ms, "
                  f"worker {'holds the same weights and logits' if same else 'DIFFERS'}", file=sys.stderr)
        engine.shutdown()
        client.shutdown_weight_transfer_engine()
        print(json.dumps({"steps": args.steps, "losses": losses, "send_seconds": send_s,
                          "tensors": len(list(model.parameters())), "verified": verified}))
        return 0 if verified else 1
    finally:
        proc.kill()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--role", choices=["trainer", "worker"], default="trainer")
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        worker(args.port_file)
        return 0
    return trainer(args)


if __name__ == "__main__":
    sys.exit(main())
