"""Feed a refit worker from a PyTorch trainer on the same GPU, without refit on
the trainer side.

The worker runs refit's "torch_ipc" engine (for example //examples/torch_ipc:worker,
or any C++ server with refit's control plane). This module is the trainer's half:
it turns each CUDA tensor into what torch.multiprocessing.reductions.reduce_tensor
shares (the CUDA IPC handle of the allocation holding its storage, where the storage
starts there and how large it is, the tensor's element offset, sizes and strides),
sends them in the update_info of refit's control call update_weights, and returns
once the worker has copied every byte out of the trainer's memory:

    import refit_ipc
    with refit_ipc.WorkerClient("127.0.0.1", 5600) as worker:
        worker.call("init_weight_transfer_engine", {"init_info": {}})
        refit_ipc.send_weights(worker, model.named_parameters(), weight_version=1)

What it relies on, and why:
- The trainer keeps its tensors alive and unchanged until send_weights returns (the
  worker reads them in place); send_weights synchronises the device first, so work
  still queued on any stream has finished before the worker reads.
- Tensors must be contiguous CUDA tensors (the worker refuses others, naming them).
- PyTorch's expandable_segments allocator exports a different kind of handle, which
  the worker refuses with a clear error: run without
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
- reduce_tensor counts each share in a reference counter that the consumer is
  meant to release; the worker is C++, so send_weights releases those counters
  itself once the worker has copied the bytes.

Standard library only, apart from torch (imported by the functions that need it),
so the control-plane client is usable and testable without torch.
"""

import hashlib
import hmac
import json
import os
import select
import socket
import struct
import subprocess
import time

__all__ = ["RefitError", "WorkerClient", "WorkerProcess", "gpu_uuid", "handle_entry", "entry_from_reduction", "ipc_handles",
           "update_info", "send_update", "send_weights", "digest"]

# ---- the control plane: 4-byte big-endian length + JSON, after an authentication
# handshake (lib/integrity/auth.h, protocol version 1) that runs on every connection.

_AUTH_MAGIC = 0x41544652  # "RFTA"
_AUTH_VERSION = 1
_AUTH_HAS_SECRET = 1
_AUTH_BUSY = 2  # the worker is at its connection limit and closes the connection
_VERDICTS = {1: "the worker refused this side's shared secret (the secrets differ)",
             2: "the worker requires a shared secret and none is configured here",
             3: "the worker has no shared secret but one is configured here"}


class RefitError(Exception):
    """An error answer of a refit worker (kind: refit's error kind, e.g. "invalid_argument")."""

    def __init__(self, kind, message):
        super().__init__(f"{message} ({kind})")
        self.kind = kind
        self.message = message


def _recv_exact(sock, n):
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("refit worker closed the connection")
        data += chunk
    return bytes(data)


def _proof(secret, label, first, second):
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


class WorkerClient:
    """One control connection to a refit worker. Every wait has a deadline."""

    def __init__(self, host, port, secret=None, timeout=120.0):
        if isinstance(secret, str):
            secret = secret.encode()
        self._secret = secret or b""
        self._next_id = 1
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake()
        except BaseException:
            self._sock.close()
            raise

    def _handshake(self):
        challenge = _recv_exact(self._sock, 48)
        magic, version, flags, _ = struct.unpack("<4I", challenge[:16])
        if magic != _AUTH_MAGIC or version != _AUTH_VERSION:
            raise ConnectionError("not a refit worker of this protocol version (authentication challenge expected)")
        if flags & _AUTH_BUSY:
            raise RefitError("resource_exhausted", "the worker refused the connection: it is at its connection "
                                                   "limit (too many connections)")
        nonce_s = challenge[16:]
        nonce_c = os.urandom(32)
        has = bool(self._secret)
        mac_c = _proof(self._secret, b"refit-auth-v1 client", nonce_s, nonce_c) if has else bytes(32)
        self._sock.sendall(struct.pack("<4I", _AUTH_MAGIC, _AUTH_VERSION, _AUTH_HAS_SECRET if has else 0, 0) +
                           nonce_c + mac_c)
        verdict = _recv_exact(self._sock, 48)
        _, _, code, _ = struct.unpack("<4I", verdict[:16])
        if code != 0:
            raise PermissionError("refit authentication failed: " + _VERDICTS.get(code, f"verdict {code}"))
        if bool(flags & _AUTH_HAS_SECRET) != has:
            raise PermissionError("refit authentication failed: only one side has a shared secret")
        if has and not hmac.compare_digest(verdict[16:], _proof(self._secret, b"refit-auth-v1 server", nonce_c,
                                                                  nonce_s)):
            raise PermissionError("refit authentication failed: the worker's proof of the shared secret is wrong")

    def call(self, method, params=None):
        """Calls a control method; returns its result, or raises RefitError."""
        request_id = self._next_id
        self._next_id += 1
        body = json.dumps({"id": request_id, "method": method, "params": params or {}}).encode()
        self._sock.sendall(struct.pack(">I", len(body)) + body)
        (length,) = struct.unpack(">I", _recv_exact(self._sock, 4))
        answer = json.loads(_recv_exact(self._sock, length))
        if answer.get("id") != request_id:
            raise ConnectionError(f"refit worker answered request {answer.get('id')}, expected {request_id}")
        if "error" in answer:
            raise RefitError(answer["error"].get("kind", "unknown"), answer["error"].get("message", ""))
        return answer["result"]

    def close(self):
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- handles

# Positions in the argument tuple reduce_tensor returns for a CUDA tensor (the
# parameters of torch.multiprocessing.reductions.rebuild_cuda_tensor; the same in
# PyTorch 1.13 and 2.x).
_SIZE, _STRIDE, _OFFSET, _STORAGE_CLS, _DTYPE, _DEVICE, _HANDLE, _STORAGE_BYTES, _STORAGE_OFFSET_BYTES = \
    1, 2, 3, 4, 5, 6, 7, 8, 9
_REF_COUNTER_HANDLE, _REF_COUNTER_OFFSET = 11, 12
_CUDA_ARGS = 15


class WorkerProcess:
    """A refit worker binary (e.g. //examples/torch_ipc:worker) started by this
    process: it dies with this process (REFIT_TRAINER_PID: the worker sets its
    parent-death signal, SIGKILL for the torch_ipc worker), its port line must come
    within `timeout` seconds, and stop() terminates it, then kills it if it has not
    exited within `grace` seconds, so nothing outlives the trainer.

        with refit_ipc.WorkerProcess([path, "--device", "0"]) as w:
            with refit_ipc.WorkerClient("127.0.0.1", w.port) as client: ...
    """

    def __init__(self, argv, timeout=60.0, grace=10.0):
        self.grace = grace
        env = dict(os.environ, REFIT_TRAINER_PID=str(os.getpid()))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
        line = b""
        deadline = time.monotonic() + timeout
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                    raise RuntimeError(f"worker {argv[0]} did not report its port within {timeout:.0f} s")
                chunk = os.read(self.proc.stdout.fileno(), 256)
                if not chunk:
                    raise RuntimeError(f"worker {argv[0]} exited (status {self.proc.wait(5)}) before reporting "
                                       f"its port; output: {line.decode(errors='replace')!r}")
                line += chunk
            text = line.decode(errors="replace").strip()
            if not text.startswith("REFIT_WORKER_PORT "):
                raise RuntimeError(f"worker {argv[0]} printed {text!r}, not its port")
            self.port = int(text.split()[1])
        except BaseException:
            self.stop()
            raise

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def gpu_uuid(device_index):
    """The UUID of CUDA device `device_index` in nvidia-smi's spelling (GPU-...),
    the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    import torch
    text = str(torch.cuda.get_device_properties(device_index).uuid)
    return text if text.startswith("GPU-") else "GPU-" + text


def handle_entry(handle, storage_offset_bytes, storage_bytes, offset, size, stride):
    """One tensor's entry as the torch_ipc engine reads it (without its GPU key)."""
    handle = bytes(handle)
    return {"handle": handle.hex(), "storage_offset_bytes": int(storage_offset_bytes),
            "storage_bytes": int(storage_bytes), "offset": int(offset), "size": [int(s) for s in size],
            "stride": [int(s) for s in stride]}


def entry_from_reduction(rebuild, args):
    """(entry, device index, release) from reduce_tensor's (rebuild, args) of a CUDA
    tensor; release() gives back the share's reference count."""
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or len(args) != _CUDA_ARGS:
        raise ValueError("not a CUDA tensor's reduction (refit's torch_ipc reads CUDA IPC handles; "
                         "move the tensor to the GPU first)")
    handle = args[_HANDLE]
    if handle is None or args[_STORAGE_BYTES] == 0:
        handle = bytes(64)  # an empty storage: nothing will be read
    entry = handle_entry(handle, args[_STORAGE_OFFSET_BYTES], args[_STORAGE_BYTES], args[_OFFSET],
                         args[_SIZE], args[_STRIDE])

    def release():
        if args[_REF_COUNTER_HANDLE] is not None and args[_HANDLE] is not None:
            args[_STORAGE_CLS]._release_ipc_counter(args[_REF_COUNTER_HANDLE], args[_REF_COUNTER_OFFSET],
                                                    device=args[_DEVICE])
    return entry, int(args[_DEVICE]), release


# Storages already shared, by address: (weak reference, GPU key, handle hex,
# storage_offset_bytes, storage_bytes). A storage's handle and place in its
# allocation never change while it lives, so later updates build its tensors'
# entries without reduce_tensor (the per-tensor cost that dominates many small
# tensors); a storage that died, moved or was resized is shared afresh.
_shared_storages = {}


def _storage_of(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._untyped()


def _entry_from_cache(t, storage):
    cached = _shared_storages.get(storage.data_ptr())
    if cached is None:
        return None
    ref, key, handle, storage_offset_bytes, storage_bytes = cached
    if ref.expired() or storage_bytes != storage.nbytes():
        del _shared_storages[storage.data_ptr()]
        return None
    entry = {"handle": handle, "storage_offset_bytes": storage_offset_bytes, "storage_bytes": storage_bytes,
             "offset": int(t.storage_offset()), "size": [int(x) for x in t.shape],
             "stride": [int(x) for x in t.stride()]}
    return {key: entry}


def ipc_handles(tensors, releases=None, cache=True):
    """The "ipc_handles" member for `tensors` (CUDA, contiguous), in order. When
    `releases` is a list, each new share's release function is appended to it.
    With `cache`, storages shared by an earlier call are not shared again."""
    from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor
    uuids = {}
    out = []
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(f"tensor on {t.device}: torch_ipc needs CUDA tensors")
        if not t.is_contiguous():
            raise ValueError(f"tensor of size {tuple(t.shape)} is not contiguous: send t.contiguous()")
        storage = _storage_of(t) if cache else None
        hit = _entry_from_cache(t, storage) if cache else None
        if hit is not None:
            out.append(hit)
            continue
        entry, device, release = entry_from_reduction(*reduce_tensor(t.detach()))
        if device not in uuids:
            uuids[device] = gpu_uuid(device)
        out.append({uuids[device]: entry})
        if releases is not None:
            releases.append(release)
        if cache and entry["storage_bytes"] > 0:
            _shared_storages[storage.data_ptr()] = (StorageWeakRef(storage), uuids[device], entry["handle"],
                                                    entry["storage_offset_bytes"], entry["storage_bytes"])
    return out


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def update_info(named_tensors, commit=None, releases=None):
    """The torch_ipc update_info of (name, tensor) pairs: names, dtype_names, shapes
    and ipc_handles (and "commit": "in_place" or "staged" when given)."""
    named = [(n, t) for n, t in named_tensors]
    info = {"names": [n for n, _ in named], "dtype_names": [_dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "ipc_handles": ipc_handles([t for _, t in named], releases)}
    if commit is not None:
        info["commit"] = commit
    return info


def send_update(worker, info, weight_version=None, releases=()):
    """One whole update session on `worker` (a WorkerClient) for a ready
    update_info: start_weight_update, update_weights, finish_weight_update; then
    the release functions (see ipc_handles) are called, whatever happened. Returns
    the worker's weight_info. On an error the worker has aborted the session (its
    next start_weight_update starts afresh) and RefitError is raised."""
    try:
        worker.call("start_weight_update")
        worker.call("update_weights", {"update_info": info})
        finish = {} if weight_version is None else {"weight_version": int(weight_version)}
        worker.call("finish_weight_update", finish)
    finally:
        # The worker has copied what it read (or failed): give back the shares.
        for release in releases:
            try:
                release()
            except Exception:  # a torch without the call: only a counter stays behind
                pass
    return worker.call("weight_info")


def send_weights(worker, named_tensors, weight_version=None, commit=None):
    """Sends (name, CUDA tensor) pairs to `worker` as one update (send_update);
    returns once the worker has copied every byte, with its weight_info."""
    import torch
    named = [(n, t) for n, t in named_tensors]
    releases = []
    info = update_info(named, commit, releases)
    # Work queued on any stream (the optimizer step) must be done before the
    # worker's copies read the tensors.
    for device in {t.device for _, t in named}:
        torch.cuda.synchronize(device)
    return send_update(worker, info, weight_version, releases)


def digest(tensor):
    """What a refit torch_ipc example worker's "digest" call answers for a tensor
    (examples/torch_ipc/digest.h): [sum of bytes, sum of (i + 1) * byte_i], mod 2^64."""
    import torch
    b = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    i = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64)
    mask = (1 << 64) - 1
    return [int(b.sum().item()) & mask, int((b * i).sum().item()) & mask]


def _demo():
    import argparse
    import torch
    p = argparse.ArgumentParser(description="send a small random model to a refit torch_ipc worker")
    p.add_argument("--worker", default="127.0.0.1:5600", help="host:port of the worker's control plane")
    p.add_argument("--secret-file", help="shared secret (as the worker's --auth-secret-file)")
    p.add_argument("--tensors", type=int, default=100)
    args = p.parse_args()
    host, port = args.worker.rsplit(":", 1)
    secret = open(args.secret_file, "rb").read().rstrip(b"\n") if args.secret_file else None
    model = {f"layer.{i}.weight": torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
             for i in range(args.tensors)}
    with WorkerClient(host, int(port), secret) as worker:
        worker.call("init_weight_transfer_engine", {"init_info": {}})
        print(json.dumps(send_weights(worker, model.items(), weight_version=1)))


if __name__ == "__main__":
    _demo()
