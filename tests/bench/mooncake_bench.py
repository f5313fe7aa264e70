#!/usr/bin/env python3
"""A peer for the TCP engine: Mooncake's transfer engine (PyPI
mooncake-transfer-engine-non-cuda) over its TCP transport, moving the same tensor
set from one initiator (the trainer) into memory registered by N target processes
(the workers), all targets written concurrently. Prints one JSON line: bytes,
seconds per update (mean, best), GB/s per target.

usage: mooncake_bench.py LAYOUT_JSON TARGETS UPDATES
LAYOUT_JSON: {"names": [...], "dtype_names": [...], "shapes": [...]} (weight_sync --print-layout)

Each target registers one arena holding every tensor back to back and resident
before the first update (like a served model); the initiator writes each tensor
into its slot with one batch_transfer_sync_write per target per update. The
initiator checks a sample of every target's bytes after the last update.
"""
import ctypes
import json
import subprocess
import sys
import threading
import time

from layout import tensor_sizes


def engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake: initialize failed ({rc})")
    return te


def arena(nbytes, fill):
    buf = (ctypes.c_char * nbytes)()
    ctypes.memset(buf, fill, nbytes)  # resident: every page touched
    return buf, ctypes.addressof(buf)


def target(nbytes):
    te = engine()
    buf, ptr = arena(nbytes, 0)
    if te.register_memory(ptr, nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "ptr": ptr}), flush=True)
    # Serve until the initiator asks for a sample or closes stdin.
    for line in sys.stdin:
        off, n = map(int, line.split())
        print(bytes(buf[off:off + n]).hex(), flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--target":
        target(int(sys.argv[2]))
        return
    layout = json.load(open(sys.argv[1]))
    targets = int(sys.argv[2])
    updates = int(sys.argv[3])
    sizes = tensor_sizes(layout)
    nbytes = sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    procs = [subprocess.Popen([sys.executable, __file__, "--target", str(nbytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(targets)]
    try:
        peers = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("mooncake: a target exited before it was ready")
            peers.append(json.loads(line))
        te = engine()
        src, src_ptr = arena(nbytes, 0x5A)
        if te.register_memory(src_ptr, nbytes) != 0:
            raise RuntimeError("mooncake: register_memory failed")
        srcs = [src_ptr + o for o in offsets]
        times = []
        # One untimed warm-up update: connections and segment descriptors are set up
        # on first use (refit's connections are made at init, outside its timing).
        for u in range(-1, updates):
            ctypes.memset(src, 0x41 + u, nbytes)  # new weights each update
            errors = []

            def send(peer, errors=errors):
                dsts = [peer["ptr"] + o for o in offsets]
                rc = te.batch_transfer_sync_write(peer["session"], srcs, dsts, sizes)
                if rc != 0:
                    errors.append(f"{peer['session']}: batch_transfer_sync_write returned {rc}")

            threads = [threading.Thread(target=send, args=(peer,)) for peer in peers]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if u >= 0:
                times.append(time.perf_counter() - t0)
            if errors:
                raise RuntimeError("mooncake: " + "; ".join(errors))
        expect = bytes([0x41 + updates - 1]) * 64
        for p in procs:
            for off in (0, nbytes // 2, nbytes - 64):
                p.stdin.write(f"{off} 64\n")
                p.stdin.flush()
                got = bytes.fromhex(p.stdout.readline().strip())
                if got != expect:
                    raise RuntimeError(f"mooncake: target holds wrong bytes at {off}")
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
            p.wait(timeout=30)
    import mooncake

    mean = sum(times) / len(times)
    print(json.dumps({"peer": "Mooncake transfer engine (tcp)", "version": getattr(mooncake, "__version__", "?"),
                      "targets": targets, "tensors": len(sizes), "bytes": nbytes, "updates": updates,
                      "seconds_mean": mean, "seconds_best": min(times), "gbps": nbytes / mean / 1e9,
                      "verified": True}))


if __name__ == "__main__":
    main()
