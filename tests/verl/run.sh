#!/usr/bin/env bash
# tests/verl/run.sh [PYTEST_ARGS...]
#
# refit as verl's checkpoint engine through verl's own registry (verl 0.9.1 from
# PyPI): makes (once, then reuses) the venv of python/requirements-verl.txt with
# python/venv.sh (torch for CPUs, ray, transformers; about 1.3 GB, a few minutes
# cold), builds refit's wheel for it and installs it there, then runs
# tests/verl/test_verl.py under a hard deadline: separate processes per actor and
# rollout rank driven as verl's CheckpointEngineManager drives them.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=$(bash python/venv.sh --requirements python/requirements-verl.txt --check tests/verl/venv_check.py | tail -n 1)
pyver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wheel=$(./refit wheel --python "$pyver" | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
echo "verl: $("$venv/bin/python" -c 'import importlib.metadata as m; print("verl", m.version("verl"), "torch", m.version("torch"))'), refit $wheel"
# Bytecode under the venv, not the checkout, even where PYTHONDONTWRITEBYTECODE
# is set: each rank process imports verl, ray and torch again otherwise.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$venv/.pycache"
REFIT_REQUIRE_VERL=1 timeout --kill-after=30 "${REFIT_VERL_TIMEOUT_S:-900}" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rA tests/verl/test_verl.py "$@"
