#!/usr/bin/env bash
# tests/sglang/run.sh [PYTEST_ARGS...]
#
# refit inside a real SGLang server (docs/sglang.md): makes (once, then reuses)
# tests/sglang's venv (SGLang 0.5.23 from PyPI on CPython 3.12, torch for CPUs;
# tests/sglang/venv.sh), builds refit's wheel for it and installs it there, then
# runs tests/sglang/test_sglang.py under a hard deadline: one
# `python -m sglang.launch_server --device cpu` of a tiny Llama with
# `--custom-weight-loader refit.sglang.load_weights`, updated by refit.sglang.Client;
# then tests/sglang/test_sglang_tp.py, the same at `--tp 2` (one rank per core).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=$(bash tests/sglang/venv.sh | tail -n 1)
pyver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wheel=$(./refit wheel --python "$pyver" | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
echo "sglang: $("$venv/bin/python" -c 'import importlib.metadata as m; print("sglang", m.version("sglang"), "torch", m.version("torch"))'), refit $wheel"
timeout --kill-after=30 "${REFIT_SGLANG_TIMEOUT_S:-900}" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rA tests/sglang/test_sglang.py tests/sglang/test_sglang_tp.py "$@"
