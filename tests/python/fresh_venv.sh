#!/usr/bin/env bash
# The wheel in a fresh venv, as a user installs it:
#   1. a venv made from nothing: `pip install WHEEL` (which brings numpy, its one
#      dependency), then a tcp round trip of numpy arrays, the vLLM plugin's entry
#      point listed, the type stubs and py.typed installed, the version the
#      metadata's;
#   2. the same fresh venv given torch and vLLM from the project venv VENV through a
#      .pth file (they are not installed again: 1.3 GiB), refit itself still the one
#      pip installed from the wheel: both examples run in it, the PyTorch trainer
#      feeding the C++ main job's workers and the vLLM worker fed through vLLM's
#      own factories.
# usage: tests/python/fresh_venv.sh WHEEL VENV WEIGHT_SYNC_BINARY
set -euo pipefail
wheel=$(readlink -f "$1")
venv=$(readlink -f "$2")
weight_sync=$(readlink -f "$3")
cd "$(dirname "$0")/../.."
base=$("$venv/bin/python" -c 'import sys; print(sys._base_executable)')
fresh=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$fresh")"' EXIT

echo "fresh venv: $fresh (from $base)"
"$base" -m venv "$fresh"
"$fresh/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
"$fresh/bin/python" - <<'PY'
import importlib.metadata as md, threading
import numpy as np
import refit
assert "/site-packages/refit/" in refit.__file__, refit.__file__
src = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((3, 7), dtype=np.int16)}
sender = refit.Sender("tcp", timeout_ms=10000)
engine = refit.Engine("tcp", timeout_ms=10000, framework="numpy")
info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
t = threading.Thread(target=sender.connect_workers); t.start(); engine.init(info); t.join()
got = {}
t = threading.Thread(target=sender.send_weights, args=(src,)); t.start()
engine.receive(refit.describe(src), lambda batch: got.update({n: a.copy() for n, a in batch})); engine.drain(); t.join()
assert all(got[k].tobytes() == src[k].tobytes() for k in src)
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "refit"]
assert eps and eps[0].value == "refit.vllm:register", eps
import os
here = os.path.dirname(refit.__file__)
for typed in ("_refit.pyi", "py.typed"):  # the extension's stubs and PEP 561's marker
    assert os.path.isfile(os.path.join(here, typed)), f"the wheel did not install refit/{typed}"
assert refit.__version__ == md.version("refit"), (refit.__version__, md.version("refit"))
print("fresh venv: pip install of the wheel and a numpy round trip: ok; vllm.general_plugins entry point:", eps[0].value,
      "; refit/_refit.pyi and refit/py.typed installed; version", refit.__version__)
PY

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_site=$("$fresh/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$fresh_site/zz_project_venv.pth"  # after the fresh venv's own packages: its refit wins
"$fresh/bin/python" -c 'import refit, torch, vllm; assert refit.__file__.startswith("'"$fresh_site"'"), refit.__file__; print("fresh venv: refit", refit.__file__, "torch", torch.__version__, "vllm", vllm.__version__)'
"$fresh/bin/python" examples/python/train_and_sync.py --weight-sync "$weight_sync" --workers 2 --steps 3 | tail -n 1 |
  "$fresh/bin/python" -c 'import json, sys; r = json.loads(sys.stdin.read()); assert r["verified"], r; print("fresh venv: train_and_sync.py verified", r["steps"], "steps to", r["workers"], "C++ workers, losses", [round(x, 3) for x in r["losses"]])'
"$fresh/bin/python" examples/python/vllm_worker.py --steps 3 | tail -n 1 |
  "$fresh/bin/python" -c 'import json, sys; r = json.loads(sys.stdin.read()); assert r["verified"], r; print("fresh venv: vllm_worker.py verified", r["steps"], "steps")'
