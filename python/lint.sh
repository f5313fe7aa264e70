#!/usr/bin/env bash
# python/lint.sh [--wheel WHEEL] [--ruff-only]
#
# The Python checks CI runs (and a contributor before a commit):
#   1. ruff (config: ruff.toml at the repository root) on python/, tests/python,
#      tests/vllm_serve, tests/verl, tests/sglang, tests/bench/*.py, examples/python
#      and examples/torch_server;
#   2. the wheel as a type checker sees it: WHEEL (default: the newest non-CUDA
#      dist/refit-*.whl for the lint venv's CPython; `./refit wheel` builds one
#      when there is none) installed into the lint venv must hold refit/_refit.pyi
#      and refit/py.typed, and mypy (config: python/pyproject.toml) must find no
#      error in examples/python and tests/python/typing_smoke.py (refit's names as
#      a user's checker sees them) nor in the package as the wheel ships it.
#
# The lint venv holds only ruff, mypy (pinned below, from PyPI) and refit; it is
# made once under ~/.cache/refit (or $REFIT_LINT_VENV) with $REFIT_PYTHON, else
# python3 (the interpreter the wheel is built for), and reused while the pins are
# the same. Exit status 0 when everything is clean.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
root=$(pwd)

RUFF=ruff==0.17.5
MYPY=mypy==2.4.1

die() {
  echo "lint.sh: error: $*" >&2
  exit 1
}
note() { echo "lint.sh: $*" >&2; }

wheel=
mypy_check=1
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) wheel=$(readlink -f "${2:?--wheel needs a file}"); shift 2 ;;
    --ruff-only) mypy_check=0; shift ;;
    *) die "unknown argument $1 (usage: python/lint.sh [--wheel WHEEL] [--ruff-only])" ;;
  esac
done

PYTHON=${REFIT_PYTHON:-python3}
pytag=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') ||
  die "'$PYTHON' does not run (set REFIT_PYTHON to an interpreter)"
venv=${REFIT_LINT_VENV:-$HOME/.cache/refit/venv-lint-$pytag}
stamp="$venv/.refit-lint-stamp"
mkdir -p "$(dirname "$venv")"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$venv.lock"
  flock 9 || die "cannot lock $venv.lock"
fi
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$RUFF $MYPY" ]; then
  note "creating $venv ($RUFF, $MYPY)"
  rm -f "$stamp"
  "$PYTHON" -m venv --clear "$venv" || die "'$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$RUFF" "$MYPY" >&2 ||
    die "pip could not install $RUFF $MYPY"
  echo "$RUFF $MYPY" >"$stamp"
fi

status=0
note "ruff check"
"$venv/bin/ruff" check --no-cache python tests/python tests/vllm_serve tests/verl tests/sglang tests/bench/*.py examples/python examples/torch_server || status=1

if [ "$mypy_check" = 1 ]; then
  if [ -z "$wheel" ]; then
    # The lint venv's CPython's: ./refit wheel --python 3.X leaves other versions' there too.
    wheel=$(ls -t dist/refit-*-cp$pytag-*.whl 2>/dev/null | grep -v '+cuda' | head -n 1 || true)
    if [ -z "$wheel" ]; then
      note "no wheel in dist/: building one (./refit wheel)"
      wheel=$(./refit wheel | tail -n 1)
    fi
  fi
  [ -f "$wheel" ] || die "no wheel at $wheel"
  note "mypy against $wheel"
  # No dependencies: the type check needs refit's own files only (numpy, torch
  # and vLLM are Any, see python/pyproject.toml).
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel" >&2 ||
    die "pip could not install $wheel"
  "$venv/bin/python" - <<'PY' || status=1
import importlib.util, os, sys
spec = importlib.util.find_spec("refit")  # found, not imported: numpy is not here
where = spec.submodule_search_locations[0]
missing = [f for f in ("_refit.pyi", "py.typed") if not os.path.isfile(os.path.join(where, f))]
if missing:
    sys.exit(f"lint.sh: the installed wheel lacks refit/{' and refit/'.join(missing)} (in {where})")
print(f"lint.sh: the wheel installs refit/_refit.pyi and refit/py.typed ({where})", file=sys.stderr)
PY
  "$venv/bin/mypy" --config-file python/pyproject.toml --no-incremental examples/python examples/torch_server tests/python/typing_smoke.py ||
    status=1
  # The package itself as the wheel ships it (its annotations against the
  # extension's generated stubs), from a copy: mypy checks no site-packages.
  shipped=$(mktemp -d)
  "$venv/bin/python" -m zipfile -e "$wheel" "$shipped"
  (cd "$shipped" && "$venv/bin/mypy" --config-file "$root/python/pyproject.toml" --no-incremental -p refit) || status=1
  rm -rf "$shipped"
fi

[ "$status" = 0 ] && note "clean" || note "FAILED (see above)"
exit "$status"
