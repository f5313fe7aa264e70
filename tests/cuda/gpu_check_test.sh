#!/usr/bin/env bash
# The GPU check's harness on its own (no GPU, no CUDA build): a fake bundle whose
# steps pass, hang with a grandchild that ignores SIGTERM, and come after the
# budget is spent. The check must finish near its budget, kill the grandchild,
# report each step as what it was, and leave exactly its 3 report files.
#
#   gpu_check_test.sh GPU_CHECK_SH GPU_PREFLIGHT_SH GPU_REPORT_PY GPU_REPORT_SCHEMA_JSON
set -euo pipefail
check=$(readlink -f "$1") preflight=$(readlink -f "$2") report=$(readlink -f "$3") schema=$(readlink -f "$4")
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/gpu_check_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

bundle="$tmp/bundle"
mkdir -p "$bundle/tests/cuda"
cp "$check" "$preflight" "$report" "$schema" "$bundle/tests/cuda/"
echo '{"commit": "0123456789abcdef", "dirty": false}' >"$bundle/STAMP.json"
# A "GPU test" that passes, one that skips with its reason, a benchmark that skips,
# a step that hangs (its grandchild ignores SIGTERM), and one the budget leaves out.
cat >"$bundle/steps.txt" <<'EOF'
# name | kind | backends | timeout_s | command
passes  | gtest_cpu | - | 20 | echo '[==========] 1 test ran.'; echo '[  PASSED  ] 1 test.'
skips   | gtest | nccl | 20 | printf 'x.cc:1: Skipped\nno CUDA device: no driver here\n[  SKIPPED ] 1 test, listed below:\n[  PASSED  ] 0 tests.\n'
bench   | json  | nccl, cuda_ipc | 20 | echo '{"bench":"b","skipped":true,"reason":"no GPU"}'
hangs   | json  | - | 100 | bash -c 'trap "" TERM; echo $$ > grandchild.pid; while :; do sleep 1; done' & trap "" TERM; wait
late    | gtest | - | 20 | echo never
EOF
out="$tmp/out"
cd "$bundle"
t0=$(date +%s)
set +e
REFIT_GPU_DRY_RUN=1 REFIT_GPU_STEPS="$bundle/steps.txt" REFIT_GPU_BUDGET_S=8 REFIT_GPU_KILL_AFTER_S=1 \
  REFIT_GPU_MIN_STEP_S=2 bash "$bundle/tests/cuda/gpu_check.sh" "$bundle" "$out" >"$tmp/stdout" 2>&1
rc=$?
set -e
wall=$(( $(date +%s) - t0 ))
cat "$tmp/stdout"
[ $rc -eq 1 ] || fail "exit status $rc, expected 1 (a step timed out)"
[ $wall -le 14 ] || fail "took ${wall}s with an 8 s budget and 1 s kill-after"
[ -s "$bundle/grandchild.pid" ] || fail "the hanging step never started its grandchild"
gc=$(cat "$bundle/grandchild.pid")
# Dead, or a zombie its new parent has yet to reap.
alive() { [ -e "/proc/$1" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
for _ in 1 2 3 4 5 6 7 8 9 10; do alive "$gc" || break; sleep 0.2; done
if alive "$gc"; then kill -KILL "$gc"; fail "the grandchild ($gc) that ignores SIGTERM survived its step"; fi
[ "$(ls "$out" | sort | xargs)" = "gpu-check.log gpu-report.tar.gz gpu-summary.json" ] || fail "report files: $(ls "$out")"
python3 - "$out/gpu-summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
got = {x["name"]: (x["status"], x["ok"]) for x in s["steps"]}
want = {"preflight": ("passed", True), "passes": ("passed", True), "skips": ("skipped", True),
        "bench": ("skipped", True), "hangs": ("timeout", False), "late": ("not run (budget)", False)}
assert got == want, got
assert next(x for x in s["steps"] if x["name"] == "bench")["backends"] == ["nccl", "cuda_ipc"], s["steps"]
assert s["mode"] == "dry" and s["ok"] is False, s
assert s["stamp"]["commit"] == "0123456789abcdef", s["stamp"]
skip = next(x for x in s["steps"] if x["name"] == "skips")
assert skip["reason"] == "no CUDA device: no driver here", skip
hang = next(x for x in s["steps"] if x["name"] == "hangs")
assert hang["wall_s"] < 9.5, hang
print("summary as expected")
EOF
grep -qE '==== step hangs \(json\): ran rc=(124|137)' "$out/gpu-check.log" || fail "combined log lacks the hanging step"
# Listed into a file first: `tar | grep -q` under pipefail fails whenever grep's early
# exit hits tar with SIGPIPE (seen as a flaky "tarball lacks a step log" under load).
tar -tzf "$out/gpu-report.tar.gz" >"$tmp/listing" || fail "the tarball cannot be listed"
grep -q 'gpu-report/steps/passes.log' "$tmp/listing" || fail "tarball lacks a step log"
# verify-dry-run refuses this report (a step timed out) ...
if python3 "$bundle/tests/cuda/gpu_report.py" verify-dry-run "$out" >"$tmp/verify" 2>&1; then
  fail "verify-dry-run accepted a report with a timed-out step"
fi
grep -q 'step hangs: timeout' "$tmp/verify" || { cat "$tmp/verify"; fail "verify-dry-run did not name the timed-out step"; }

# ... and accepts one where every step skipped or passed as it should.
grep -vE '^(hangs|late) ' "$bundle/steps.txt" >"$bundle/good.txt"
rm -rf "$out"
REFIT_GPU_DRY_RUN=1 REFIT_GPU_STEPS="$bundle/good.txt" bash "$bundle/tests/cuda/gpu_check.sh" "$bundle" "$out" >"$tmp/stdout2" 2>&1 ||
  { cat "$tmp/stdout2"; fail "the good dry run failed"; }
python3 "$bundle/tests/cuda/gpu_report.py" verify-dry-run "$out" || fail "verify-dry-run refused a good dry run"
echo "PASS"
