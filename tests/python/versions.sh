#!/usr/bin/env bash
# refit's wheels on every CPython it supports (CI runs this; docs/python.md):
#   3.10, 3.13  the wheel built for it (./refit wheel --python X), installed with pip
#               into a venv of numpy and torch (python/requirements-torch.txt, made
#               once by python/venv.sh), imported with both, and one trainer-to-
#               worker round trip of torch tensors through WorkerHost, Sender and
#               WorkerGroup (tests/python/round_trip.py);
#   3.12        the full suite (tests/python) in a venv of python/requirements-vllm.txt
#               for 3.12, against the cp312 wheel;
#   (3.11: the README's test command runs the full suite.)
# and pip itself refuses a wheel built for another interpreter (its tags), before
# anything is imported.
#
#   tests/python/versions.sh [3.10 3.12 3.13]
set -euo pipefail
cd "$(dirname "$0")/../.."
versions=${*:-3.10 3.12 3.13}
say() { printf '[versions] %s\n' "$*" >&2; }
python_for() {
  local p
  p=$(pyenv prefix "$(pyenv versions --bare | grep -E "^$1(\.[0-9]+)?$" | tail -n 1)" 2>/dev/null)/bin/python3
  [ -x "$p" ] || { say "no CPython $1 (pyenv)"; return 1; }
  echo "$p"
}
status=0
declare -A wheels venvs
for v in $versions; do
  t0=$(date +%s)
  py=$(python_for "$v")
  wheels[$v]=$(./refit wheel --python "$v" | tail -n 1)
  tag=cp${v/./}
  case "${wheels[$v]}" in *"-$tag-$tag-"*) ;; *) say "$v: the wheel ${wheels[$v]} is not tagged $tag"; status=1; continue ;; esac
  unzip -p "${wheels[$v]}" '*.dist-info/METADATA' | grep -q '^Requires-Python: >=3.10$' ||
    { say "$v: the wheel's METADATA lacks Requires-Python: >=3.10"; status=1; }
  if [ "$v" = 3.12 ]; then
    venv=$(REFIT_PYTHON=$py bash python/venv.sh | tail -n 1)
    venvs[$v]=$venv
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "${wheels[$v]}"
    say "$v: the full suite (tests/python) with ${wheels[$v]}"
    REFIT_REQUIRE_PYTHON=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python || status=1
  else
    venv=$(REFIT_PYTHON=$py bash python/venv.sh --requirements python/requirements-torch.txt \
      --check tests/python/torch_venv_check.py | tail -n 1)
    venvs[$v]=$venv
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "${wheels[$v]}"
    say "$v: import with numpy and torch, one round trip"
    "$venv/bin/python" tests/python/round_trip.py || status=1
  fi
  say "$v: $(($(date +%s) - t0)) s"
done
# pip refuses a wheel whose tags the interpreter does not take: the first version's
# wheel offered to the second version's venv.
set -- $versions
if [ $# -lt 2 ]; then
  say "one version only: pip's refusal of another CPython's wheel not checked"
elif [ -n "${wheels[$1]:-}" ] && [ -n "${venvs[$2]:-}" ]; then
  first=$1 v=$2 venv=${venvs[$2]}
  if "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --dry-run "${wheels[$first]}" \
    >/tmp/refit-versions-pip.log 2>&1; then
    say "pip on $v accepted the $first wheel ${wheels[$first]}"
    status=1
  elif grep -q "is not a supported wheel on this platform" /tmp/refit-versions-pip.log; then
    say "pip on $v refuses the $first wheel: $(grep -m1 'not a supported wheel' /tmp/refit-versions-pip.log)"
  else
    say "pip on $v failed on the $first wheel for another reason:"
    cat /tmp/refit-versions-pip.log >&2
    status=1
  fi
else
  say "pip's refusal not checked: $1 or $2 failed above"
  status=1
fi
[ $status -eq 0 ] && say "ok: $versions" || say "FAILED"
exit $status
