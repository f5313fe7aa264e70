#!/usr/bin/env python3
"""The loopback limit for moving a model: N independent process pairs, each sending
BYTES from its own resident (pre-faulted) buffer into the receiver's resident buffer
of the same size, UPDATES times, all pairs at once, with one large send and receive
call at a time (the kernel's copy is the whole cost). Unlike iperf3, whose 128 KiB
buffers stay in the CPU's cache, every byte here is read from and written to memory
the size of the model, as a weight transfer must. Prints one JSON line: the
aggregate GB/s (all pairs' bytes over the wall time from the common start to the
last pair's end) and each pair's.

usage: socket_pairs.py PAIRS BYTES UPDATES
"""
import json
import mmap
import os
import socket
import sys
import time


def resident(n):
    m = mmap.mmap(-1, n)
    page = b"\x5a" * (1 << 20)
    for i in range(0, n, 1 << 20):
        m[i:i + min(1 << 20, n - i)] = page[:min(1 << 20, n - i)]
    return m


def receiver(lst, n, updates):
    c, _ = lst.accept()
    mv = memoryview(resident(n))
    for _ in range(updates):
        got = 0
        while got < n:
            k = c.recv_into(mv[got:], n - got)
            if k == 0:
                os._exit(1)
            got += k
        c.sendall(b"k")
    os._exit(0)


def sender(port, n, updates, go_r, out_w):
    s = socket.create_connection(("127.0.0.1", port))
    mv = memoryview(resident(n))
    os.read(go_r, 1)  # every pair starts together
    t0 = time.perf_counter()
    for _ in range(updates):
        s.sendall(mv)
        if s.recv(1) != b"k":
            os._exit(1)
    os.write(out_w, json.dumps({"start": t0, "end": time.perf_counter()}).encode() + b"\n")
    os._exit(0)


def main():
    pairs, n, updates = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(pairs):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        port = lst.getsockname()[1]
        pid = os.fork()
        if pid == 0:
            receiver(lst, n, updates)
        pids.append(pid)
        pid = os.fork()
        if pid == 0:
            sender(port, n, updates, go_r, out_w)
        pids.append(pid)
        lst.close()
    os.close(out_w)
    time.sleep(0.5 + n * pairs / 2e9)  # buffers faulted in before the start
    os.write(go_w, b"g" * pairs)
    lines = b""
    while True:
        chunk = os.read(out_r, 65536)
        if not chunk:
            break
        lines += chunk
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    runs = [json.loads(line) for line in lines.splitlines()]
    if failed or len(runs) != pairs:
        sys.exit(f"socket_pairs: {failed} of {2 * pairs} processes failed")
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    print(json.dumps({"limit": "independent socket pairs, model-sized resident buffers", "pairs": pairs,
                      "bytes": n, "updates": updates, "aggregate_gbps": pairs * n * updates / wall / 1e9,
                      "per_pair_gbps": [n * updates / (r["end"] - r["start"]) / 1e9 for r in runs]}))


if __name__ == "__main__":
    main()
