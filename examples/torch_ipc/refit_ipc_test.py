"""refit_ipc.py without a GPU: its control-plane client (framing, authentication,
error answers) against a real refit worker host running the torch_ipc engine over
host memory, a whole update described as refit_ipc describes tensors, and the
reading of reduce_tensor's tuple. The CUDA part (reduce_tensor on real tensors) is
tests/cuda/torch_ipc_check.py, on a GPU."""

import argparse
import os
import random
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refit_ipc  # noqa: E402

WORKER_BIN = None


def py_digest(data):
    mask = (1 << 64) - 1
    return [sum(data) & mask, sum((i + 1) * b for i, b in enumerate(data)) & mask]


def Worker(*args):
    return refit_ipc.WorkerProcess([WORKER_BIN, *args], timeout=30)


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.worker = Worker()

    def tearDown(self):
        self.worker.stop()

    def connect(self, **kw):
        return refit_ipc.WorkerClient("127.0.0.1", self.worker.port, timeout=30, **kw)

    def describe(self, client, tensors):
        """Puts `tensors` ([(name, dtype, shape, bytes)]) one after another in one
        exported allocation (with gaps and an element offset, as PyTorch's caching
        allocator places storages); returns the update_info."""
        blob = bytearray()
        places = []
        for name, dtype, shape, data in tensors:
            blob += bytes(512 - len(blob) % 512)  # the next storage starts on a 512-byte boundary
            element = {"float32": 4, "bfloat16": 2, "int8": 1}[dtype]
            places.append((len(blob), element))
            blob += bytes(element) + data  # the tensor starts one element into its storage
        exported = client.call("export_test_memory", {"hex": bytes(blob).hex()})
        handle = bytes.fromhex(exported["handle"])
        entries = []
        for (name, dtype, shape, data), (start, element) in zip(tensors, places):
            stride, s = [], 1
            for d in reversed(shape):
                stride.insert(0, s)
                s *= d
            entry = refit_ipc.handle_entry(handle, start, element + len(data), 1, shape, stride)
            entries.append({exported["gpu"]: entry})
        return {"names": [t[0] for t in tensors], "dtype_names": [t[1] for t in tensors],
                "shapes": [list(t[2]) for t in tensors], "ipc_handles": entries}

    def model(self, seed):
        rng = random.Random(seed)
        out = []
        for i in range(30):
            shape = [rng.randint(1, 9), rng.randint(1, 40)]
            dtype = ["float32", "bfloat16", "int8"][i % 3]
            n = shape[0] * shape[1] * {"float32": 4, "bfloat16": 2, "int8": 1}[dtype]
            out.append((f"layers.{i}.weight", dtype, shape, bytes(rng.getrandbits(8) for _ in range(n))))
        return out

    def test_a_whole_update_arrives_byte_for_byte(self):
        with self.connect() as client:
            client.call("init_weight_transfer_engine", {"init_info": {"buffer_bytes": 4096}})
            for version, seed in [(1, 7), (2, 8)]:
                tensors = self.model(seed)
                info = self.describe(client, tensors)
                state = refit_ipc.send_update(client, info, weight_version=version)
                self.assertEqual(state["weight_version"], version)
                self.assertEqual(state["state"], "clean")
                got = client.call("digest")
                for name, _, _, data in tensors:
                    self.assertEqual(got[name], py_digest(data), name)

    def test_bad_entries_come_back_as_typed_errors_and_the_worker_goes_on(self):
        with self.connect() as client:
            client.call("init_weight_transfer_engine", {"init_info": {}})
            tensors = [("a", "float32", [3, 5], bytes(range(60))), ("b", "int8", [4, 6], bytes(range(24)))]
            info = self.describe(client, tensors)
            bad = dict(info, ipc_handles=[info["ipc_handles"][0], dict(info["ipc_handles"][1])])
            key = next(iter(bad["ipc_handles"][1]))
            bad["ipc_handles"][1][key] = dict(bad["ipc_handles"][1][key], stride=[1, 4])  # a transposed view
            with self.assertRaises(refit_ipc.RefitError) as caught:
                refit_ipc.send_update(client, bad)
            self.assertEqual(caught.exception.kind, "invalid_argument")
            self.assertIn("not contiguous", caught.exception.message)
            self.assertIn("'b'", caught.exception.message)
            with self.assertRaises(refit_ipc.RefitError) as caught:
                client.call("no_such_method")
            self.assertIn("no_such_method", caught.exception.message)
            state = refit_ipc.send_update(client, info, weight_version=5)
            self.assertEqual(state["weight_version"], 5)

    def test_entries_from_reduce_tensors_tuple(self):
        released = []

        class Storage:
            @staticmethod
            def _release_ipc_counter(handle, offset, device):
                released.append((handle, offset, device))

        def rebuild_cuda_tensor():
            pass

        handle = bytes(range(64))
        args = (object, (4, 8), (8, 1), 3, Storage, "torch.bfloat16", 0, handle, 1024, 2048, False,
                b"/refcount", 16, b"event", True)
        entry, device, release = refit_ipc.entry_from_reduction(rebuild_cuda_tensor, args)
        self.assertEqual(device, 0)
        self.assertEqual(entry, {"handle": handle.hex(), "storage_offset_bytes": 2048, "storage_bytes": 1024,
                                 "offset": 3, "size": [4, 8], "stride": [8, 1]})
        release()
        self.assertEqual(released, [(b"/refcount", 16, 0)])

        def rebuild_storage_fd():
            pass
        with self.assertRaises(ValueError):
            refit_ipc.entry_from_reduction(rebuild_storage_fd, (1, 2, 3))


class AuthTest(unittest.TestCase):
    def test_shared_secret(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "secret")
            with open(path, "w") as f:
                f.write("s3cret\n")
            os.chmod(path, 0o600)
            worker = Worker("--auth-secret-file", path)
            try:
                with refit_ipc.WorkerClient("127.0.0.1", worker.port, secret="s3cret", timeout=30) as c:
                    self.assertIn("state", c.call("weight_info"))
                for wrong in ["other", None]:
                    with self.assertRaises(PermissionError) as caught:
                        refit_ipc.WorkerClient("127.0.0.1", worker.port, secret=wrong, timeout=30)
                    self.assertIn("secret", str(caught.exception))
            finally:
                worker.stop()


class WorkerProcessTest(unittest.TestCase):
    """Nothing a trainer starts outlives it or hangs it."""

    def test_a_worker_that_never_reports_is_killed_at_the_deadline(self):
        t0 = time.monotonic()
        with self.assertRaisesRegex(RuntimeError, "did not report its port within 1 s"):
            refit_ipc.WorkerProcess(["sleep", "60"], timeout=1, grace=1)
        self.assertLess(time.monotonic() - t0, 10)

    def test_a_worker_that_exits_first_says_so(self):
        with self.assertRaisesRegex(RuntimeError, "exited"):
            refit_ipc.WorkerProcess(["true"], timeout=10)

    def test_stop_kills_a_worker_that_ignores_sigterm(self):
        script = "trap '' TERM; echo REFIT_WORKER_PORT 1; exec sleep 60"
        w = refit_ipc.WorkerProcess(["bash", "-c", script], timeout=10, grace=0.5)
        self.assertEqual(w.port, 1)
        self.assertEqual(w.stop(), -9)

    def test_the_worker_learns_its_trainers_pid(self):
        script = 'echo REFIT_WORKER_PORT "$REFIT_TRAINER_PID"; exec sleep 60'
        with refit_ipc.WorkerProcess(["bash", "-c", script], timeout=10) as w:
            self.assertEqual(w.port, os.getpid())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker-bin", required=True)
    args, rest = parser.parse_known_args()
    WORKER_BIN = os.path.abspath(args.worker_bin)
    unittest.main(argv=[sys.argv[0]] + rest)
