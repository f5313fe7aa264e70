"""NIXL (the layer vLLM's RDMA path uses) moving a model DRAM to DRAM between two
processes over its UCX backend: the peer a refit ucx user would otherwise pick.

The target registers a region the size of the model; the initiator registers the
model and, per update, WRITEs it whole (one descriptor per chunk) into the
target's region, then waits until NIXL says the transfer is done and the target
has the notification. NIXL's best case: no staging, no per-bucket handshake.

    python nixl_bench.py --bytes 1G --chunk 64M --updates 5
    (UCX_TLS / UCX_NET_DEVICES pick the transport, as for refit's ucx engine)

Prints one JSON line: {"bytes", "update_seconds": [...], "gbps_median", ...}.
Needs nixl (pip: nixl-cu13, which runs without a GPU); tests/bench/ucx_bench.sh
makes a venv for it.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def agent(name: str):
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target(conn, nbytes: int, chunk: int, updates: int) -> None:
    a = agent("target")
    region = np.zeros(nbytes, dtype=np.uint8)  # faulted in before the first write
    a.register_memory([(region.ctypes.data, nbytes, 0, "")], "DRAM")
    descs = [(region.ctypes.data + off, min(chunk, nbytes - off), 0) for off in range(0, nbytes, chunk)]
    conn.send((a.get_agent_metadata(), a.get_serialized_descs(a.get_xfer_descs(descs, "DRAM"))))
    peer = None
    for u in range(updates):
        want = f"update-{u}".encode()
        while True:
            notifs = a.get_new_notifs()
            got = [m for msgs in notifs.values() for m in msgs]
            if want in got:
                break
        conn.send(("received", u, int(region[(u * 7919) % nbytes])))
    conn.recv()  # the initiator is done
    del peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="1G")
    ap.add_argument("--chunk", default="64M")
    ap.add_argument("--updates", type=int, default=5)
    args = ap.parse_args()
    nbytes, chunk = parse_size(args.bytes), parse_size(args.chunk)

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, nbytes, chunk, args.updates), daemon=True)
    proc.start()
    a = agent("initiator")
    model = np.random.default_rng(1).integers(0, 255, size=nbytes, dtype=np.uint8)
    a.register_memory([(model.ctypes.data, nbytes, 0, "")], "DRAM")
    meta, remote_serialized = here.recv()
    remote_name = a.add_remote_agent(meta)
    remote = a.deserialize_descs(remote_serialized)
    local = a.get_xfer_descs(
        [(model.ctypes.data + off, min(chunk, nbytes - off), 0) for off in range(0, nbytes, chunk)], "DRAM")
    seconds = []
    for u in range(args.updates):
        model[(u * 7919) % nbytes] = u % 251  # each update differs where the target checks
        start = time.perf_counter()
        handle = a.initialize_xfer("WRITE", local, remote, remote_name, f"update-{u}".encode())
        state = a.transfer(handle)
        while state == "PROC":
            state = a.check_xfer_state(handle)
        if state != "DONE":
            raise SystemExit(f"nixl: update {u} ended in state {state}")
        tag, got_u, value = here.recv()
        seconds.append(time.perf_counter() - start)
        a.release_xfer_handle(handle)
        if (tag, got_u, value) != ("received", u, u % 251):
            raise SystemExit(f"nixl: update {u}: the target saw {(tag, got_u, value)}")
    here.send("done")
    proc.join(30)
    steady = seconds[1:] if len(seconds) > 1 else seconds
    med = statistics.median(steady)
    print(json.dumps({"peer": "nixl", "nixl_version": "1.5.1", "backend": "UCX", "bytes": nbytes, "chunk": chunk,
                      "update_seconds": seconds, "median_s": med, "gbps_median": nbytes / med / 1e9}))
    sys.stdout.flush()
    # nixl-cu13 1.5.1 crashes (SIGSEGV) tearing its agent down at interpreter exit.
    os._exit(0)


if __name__ == "__main__":
    main()
