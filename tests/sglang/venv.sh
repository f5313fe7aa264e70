#!/usr/bin/env bash
# Prints the path of tests/sglang's venv (CPython 3.12, SGLang 0.5.23 on CPU, torch
# 2.13.0; made once by python/venv.sh from tests/sglang/requirements.txt, then
# reused): tests/sglang/run.sh's and tests/bench/sglang_bench.py's.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/sglang
python=${REFIT_SGLANG_PYTHON:-$(pyenv prefix "$(pyenv versions --bare | grep -E '^3\.12(\.[0-9]+)?$' | tail -n 1)" 2>/dev/null)/bin/python3}
[ -x "$python" ] || { echo "sglang: no CPython 3.12 (pyenv install 3.12, or set REFIT_SGLANG_PYTHON)" >&2; exit 1; }
REFIT_PYTHON=$python bash python/venv.sh --requirements "$here/requirements.txt" --check "$here/venv_check.py" | tail -n 1
