#!/usr/bin/env bash
# Delta updates on a recorded real trajectory, on loopback: the main job replays
# it (weight_sync --replay DIR) to 2 workers, full and with --delta, alternating
# within each round; per round the ratio of the median update time after the first
# (the first has no base). Medians over rounds with [min-max].
#
#   python tests/bench/delta_density.py --model 100m --lrs 1e-5 --steps 6 --no-costs --record DIR
#   bash tests/bench/delta_replay.sh DIR [ROUNDS] [--json FILE]
#
# Every update of every run is verified on every worker by the job.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
dir="${1:?usage: delta_replay.sh DIR [ROUNDS] [--json FILE]}"
rounds="${2:-3}"
json=""
[ "${3:-}" = "--json" ] && json="${4:?--json FILE}"
meta=$(python3 tests/bench/benchmeta.py --rounds "$rounds" -- tests/bench/delta_replay.sh "$@")
states=$(ls "$dir"/step-*.bin | wc -l)
bazel build -c opt //examples/weight_sync >&2
bin="$(bazel info -c opt bazel-bin 2>/dev/null)/examples/weight_sync/weight_sync"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for mode in full delta; do
    extra=()
    [ "$mode" = delta ] && extra=(--delta)
    "$bin" --quiet --workers 2 --topology star --updates "$states" --replay "$dir" "${extra[@]}" |
      tail -n 1 | python3 -c "import json,sys; r=json.load(sys.stdin); r['mode']='$mode'; r['round']=$r; print(json.dumps(r))" >>"$out"
    echo "[delta_replay] round $r $mode done" >&2
  done
done
python3 - "$out" "$json" "$meta" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
assert all(r["verified"] for r in runs), "a run did not verify"
def later(r):
    return statistics.median(r["update_seconds"][1:])
rounds = sorted({r["round"] for r in runs})
by = {(r["round"], r["mode"]): r for r in runs}
full = [later(by[(k, "full")]) for k in rounds]
delta = [later(by[(k, "delta")]) for k in rounds]
ratio = [d / f for d, f in zip(delta, full)]
wire = [statistics.median(w / by[(k, "delta")]["bytes"] for w in by[(k, "delta")]["wire_bytes"][1:]) for k in rounds]
fallbacks = sum(by[(k, "delta")]["delta"]["full_fallbacks"] for k in rounds)
s = lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"
b = runs[0]["bytes"]
print(f"real trajectory, {b / 1e6:.0f} MB bf16, {runs[0]['updates']} updates, 2 workers (star, loopback), {len(rounds)} rounds")
print(f"full update (after the first): {s(full)} s")
print(f"delta update (after the first): {s(delta)} s")
print(f"delta / full, same round: {s(ratio)}; wire / bytes {s(wire)}; full fallbacks {fallbacks}")
if sys.argv[2]:
    json.dump({**json.loads(sys.argv[3]), "bytes": b, "full_s": full, "delta_s": delta, "ratio": ratio, "wire": wire,
               "runs": runs}, open(sys.argv[2], "w"), indent=1)
PY
