#!/usr/bin/env bash
# Runs the libtorch example (trainer module -> tp 2 worker processes with fused
# qkv/gate_up shards over TCP) and checks its last line: the workers' forward
# passes matched the trainer's, in place, and a wrong update was refused.
set -euo pipefail
bin="$1"
fail() { echo "FAIL: $*" >&2; exit 1; }

check() {
  local tp="$1" out last
  shift
  out=$("$bin" --tp "$tp" "$@") || fail "torch_module_sync --tp $tp $* exited non-zero: $out"
  last=$(printf '%s\n' "$out" | tail -n 1)
  python3 - "$last" "$tp" "$@" <<'PY' || fail "bad result for --tp $tp $*: $last"
import json, sys
r = json.loads(sys.argv[1])
tp = int(sys.argv[2])
for key in ("workers", "tp", "parameters", "bytes", "max_abs_diff", "outputs_match", "rounds",
            "addresses_stable", "libtorch", "wrong_update_refused", "max_abs_diff_before_sync"):
    assert key in r, key
assert r["outputs_match"] is True, r
assert r["workers"] == tp and r["tp"] == tp, r
assert r["parameters"] == 27 and r["bytes"] > 0, r
assert 0 <= r["max_abs_diff"] <= r["tolerance"], r
# The workers start from other weights: without the sync the outputs would differ.
assert r["max_abs_diff_before_sync"] > 100 * r["tolerance"], r
assert r["addresses_stable"] is True and r["wrong_update_refused"] is True, r
assert "error" not in r, r
print("ok: tp", tp, "->", r["rounds"], "rounds, max_abs_diff", r["max_abs_diff"])
PY
}

check 2
check 1 --rounds 3

if err=$("$bin" --tp 3 2>&1); then fail "--tp 3 accepted"; fi
grep -q -- "--tp" <<<"$err" || fail "no message for --tp 3: $err"
echo "1 passed, 0 failed"
