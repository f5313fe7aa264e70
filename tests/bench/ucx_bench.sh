#!/usr/bin/env bash
# The ucx engine's benchmark (tests/bench/ucx_bench.py): builds the main job, makes
# NIXL's venv (tests/bench/requirements-nixl.txt), then runs every round.
#
#   bash tests/bench/ucx_bench.sh [--rounds N] [--bytes 1G] [--json OUT] [--no-nixl]
#
# Needs ucx_perftest (Debian's ucx-utils: ./refit setup installs it). Run it on a
# quiet machine: every figure is a ratio within a round, but a busy core skews it.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
args=() nixl=1
for a in "$@"; do
  case "$a" in
    --no-nixl) nixl=0 ;;
    *) args+=("$a") ;;
  esac
done
# What the JSON records as its command (tests/bench/benchmeta.py): this script's line.
export REFIT_BENCH_COMMAND="${REFIT_BENCH_COMMAND:-bash tests/bench/ucx_bench.sh${*:+ $*}}"
command -v ucx_perftest >/dev/null || { echo "ucx_bench: ucx_perftest missing (./refit setup installs ucx-utils)" >&2; exit 1; }
bazel build //examples/weight_sync >&2
py=()
if [ "$nixl" = 1 ]; then
  venv=$(bash python/venv.sh --requirements tests/bench/requirements-nixl.txt --check tests/bench/nixl_venv_check.py | tail -n 1)
  py=(--nixl-python "$venv/bin/python")
fi
exec python3 tests/bench/ucx_bench.py --job bazel-bin/examples/weight_sync/weight_sync "${py[@]}" "${args[@]}"
