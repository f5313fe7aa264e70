#!/usr/bin/env bash
# The fault suite's short run: one scenario of every fault kind. Passes only when
# the report's last line shows every fault detected, no lost update and no hang.
set -euo pipefail
# Under a sanitizer (REFIT_SANITIZER, set by .bazelrc's asan and tsan test configs)
# every process runs several times slower on a 2-core machine: the peers' deadline
# grows with it (the suite scales its stalls and waits from it).
extra=()
[ -n "${REFIT_SANITIZER:-}" ] && extra=(--timeout-ms 5000)
# Further arguments go to the suite (suite_ucx_test: --engine ucx).
suite=$1 binary=$2
shift 2
out=$("$suite" --binary "$binary" --short "${extra[@]}" "$@") || { echo "$out"; echo "FAIL: the suite exited non-zero" >&2; exit 1; }
last=$(printf '%s\n' "$out" | tail -n 1)
python3 - "$last" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
for key in ("faults_injected", "faults_detected", "lost_updates", "hangs", "recoveries"):
    assert key in r, key
assert r["faults_injected"] >= 5, r
for kind in ("frozen_trainer", "staged_kill_after_chunk", "kill_trainer", "stale_trainer", "corrupt"):
    assert r["by_kind"].get(kind, {}).get("injected", 0) >= 1, (kind, r)
assert r["faults_detected"] == r["faults_injected"], r
assert r["lost_updates"] == 0 and r["hangs"] == 0, r
assert r["passed"] is True, r
print("ok:", r["faults_detected"], "of", r["faults_injected"], "faults detected, seed", r["seed"])
PY
