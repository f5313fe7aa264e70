"""One trainer-to-worker round trip with the installed wheel, on whatever CPython
runs it (tests/python/versions.sh): a WorkerHost receiving into torch tensors,
driven by a Sender and a WorkerGroup over tcp, twice; then a numpy worker. Exit
status 0 when every byte arrived and the workers' fingerprints verified."""

import sys

import numpy as np
import torch

import refit

assert "/site-packages/refit/" in refit.__file__, refit.__file__


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(256, 64, generator=g, dtype=torch.float32).to(torch.bfloat16),
        "layers.0.w": torch.randn(64, 64, generator=g),
        "layers.0.b": torch.randn(64, generator=g).to(torch.float16),
        "ids": torch.arange(100, dtype=torch.int64),
    }


dest = {k: torch.zeros_like(v) for k, v in model(0).items()}
np_dest = {k: np.zeros(tuple(v.shape), dtype=np.float32) for k, v in model(0).items() if v.dtype == torch.float32}
hosts = [
    refit.WorkerHost("tcp", tensors=dest, timeout_ms=20000),
    refit.WorkerHost("tcp", tensors=np_dest, timeout_ms=20000),
]
sender = refit.Sender("tcp", timeout_ms=20000)
with refit.WorkerGroup([f"127.0.0.1:{hosts[0].port}"], timeout_ms=20000) as group:
    group.connect()
    group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
    for version in (1, 2):
        src = model(version)
        result = group.update(sender, src, version)
        assert result["verified"] and result["version"] == version, result
        bad = [k for k in src if not torch.equal(dest[k], src[k])]
        assert not bad, f"version {version}: differ {bad}"
sender.shutdown()
sender = refit.Sender("tcp", timeout_ms=20000)
with refit.WorkerGroup([f"127.0.0.1:{hosts[1].port}"], timeout_ms=20000) as group:
    group.connect()
    group.init(sender, {"master_address": "127.0.0.1", "master_port": 0})
    src = {k: np.asarray(v) for k, v in model(3).items() if k in np_dest}
    assert group.update(sender, src, 3)["verified"]
    assert all(np_dest[k].tobytes() == src[k].tobytes() for k in src)
sender.shutdown()
for h in hosts:
    h.stop()
print(
    f"round trip ok: CPython {sys.version.split()[0]}, refit {refit.__version__}, torch {torch.__version__}, "
    f"numpy {np.__version__}"
)
