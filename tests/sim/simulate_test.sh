#!/usr/bin/env bash
# tests/sim/BUILD: simulate_test. Arguments: the simulate binary, the main job.
set -euo pipefail
simulate=$1
job=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "simulate_test: $*" >&2; exit 1; }

"$job" --role trainer --print-layout --model-bytes 16M >"$tmp/meta.json"
run() { "$simulate" --metadata "$tmp/meta.json" --rate 1gbit --buffer-bytes 1M --json "$@"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

star1=$(run --workers 1 --topology star | field seconds)
star4=$(run --workers 4 --topology star | field seconds)
chain4=$(run --workers 4 --topology chain | field seconds)
tree4=$(run --workers 4 --topology tree:2 | field seconds)
limit4=$(run --workers 4 --topology star | field limit_seconds)
ucx4=$(run --workers 4 --topology chain --engine ucx | field seconds)
staged=$(run --workers 1 --topology star --staged | field seconds)
delta=$(run --workers 1 --topology star --delta 0.1 | field seconds)
echo "star@1 $star1 star@4 $star4 chain@4 $chain4 tree:2@4 $tree4 limit(star@4) $limit4 ucx chain@4 $ucx4 staged@1 $staged delta@1 $delta"
python3 - "$star1" "$star4" "$chain4" "$tree4" "$limit4" "$ucx4" "$staged" "$delta" <<'PY' || fail "an invariant does not hold (above)"
import sys
star1, star4, chain4, tree4, limit4, ucx4, staged, delta = map(float, sys.argv[1:])
checks = {
    "a star's trainer sends 4 copies: star@4 ~ 4x star@1": 3.9 <= star4 / star1 <= 4.1,
    "a chain's trainer sends one: chain@4 within 1.1x of star@1": chain4 / star1 <= 1.1,
    "a binary tree's nodes send two: tree:2@4 ~ 2x star@1": 1.9 <= tree4 / star1 <= 2.2,
    "no run beats the busiest NIC's bytes at line rate": star4 >= limit4,
    "ucx's relay stores and forwards whole buckets: no faster than tcp's cut-through": ucx4 >= chain4,
    "a staged commit costs time": staged > star1,
    "a delta at 0.1 moves less: faster than a full update": delta < star1,
}
bad = [k for k, ok in checks.items() if not ok]
for k in bad:
    print("FAILED:", k)
sys.exit(1 if bad else 0)
PY

# Bad input: a clear error and status 2 (usage) or 1, never a crash.
if out=$("$simulate" --metadata "$tmp/meta.json" --topology ring 2>&1); then fail "--topology ring accepted"; fi
grep -q "topology" <<<"$out" || fail "--topology ring: '$out' does not name the topology"
if out=$("$simulate" --metadata "$tmp/missing.json" 2>&1); then fail "a missing --metadata accepted"; fi
grep -q "cannot read" <<<"$out" || fail "missing --metadata: '$out'"
echo '{"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[-1]]}' >"$tmp/bad.json"
if out=$("$simulate" --metadata "$tmp/bad.json" 2>&1); then fail "a negative shape accepted"; fi
grep -q "shape" <<<"$out" || fail "negative shape: '$out'"
if out=$(run --workers 0 2>&1); then fail "--workers 0 accepted"; fi
grep -q "workers" <<<"$out" || fail "--workers 0: '$out'"
echo "simulate_test: ok"
