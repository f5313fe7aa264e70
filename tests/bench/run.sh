#!/usr/bin/env bash
# refit's loopback benchmarks. Every figure is the median of ROUNDS rounds with its
# spread (min-max); every ratio is taken within a round (so a noisy minute hits
# both sides) and then its median reported. Each round measures, in turn:
#   - the limits, N = 1, 2, 4: N independent iperf3 process pairs, summed (its
#     128 KiB buffers stay in the CPU's cache), and N independent socket pairs
#     moving the model's size from resident memory into resident memory
#     (tests/bench/socket_pairs.py: what a weight transfer's bytes must do)
#   - refit's main job (examples/weight_sync: trainer + N workers, a bf16 model of
#     MODEL bytes), aggregate worker throughput at N = 1, 2, 4
#   - torch.distributed gloo broadcast of the same tensors into resident tensors and
#     the way vLLM's engine does it (fresh tensor + copy), 2 workers
#   - Mooncake's transfer engine over TCP (PyPI mooncake-transfer-engine-non-cuda,
#     in a venv this script makes and reuses), the same tensors into 2 targets
#   - one 400 MiB tensor, trainer + 1 worker: refit vs gloo
#   - the cost of checksums and of staged commits at 2 workers (steady-state update
#     time over plain: the median of the updates after the first)
#   - tcp_bench (in-process): 100k x 4 KiB vs one 400 MiB tensor, pipeline overlap
#   - the workers' peak RSS vs model + staging + 100 MiB
# Usage: tests/bench/run.sh [--model-bytes 1G] [--updates 3] [--rounds 3] [--json FILE]
#        (or ./refit bench ...)
# --json FILE: the summary and every round's figures, with what tests/bench/benchmeta.py
# records at the start (command, commit, date, rounds); docs/bench/loopback.json is
# this script's, and tests/bench/figures.py makes the docs' tables from it.
set -euo pipefail
cd "$(dirname "$0")/../.."
model_bytes=1G
updates=3
rounds=3
json_out=
argv=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    --model-bytes) model_bytes="$2"; shift 2 ;;
    --updates) updates="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    *) echo "usage: $0 [--model-bytes SIZE] [--updates N] [--rounds N] [--json FILE]" >&2; exit 2 ;;
  esac
done
meta=$(python3 tests/bench/benchmeta.py --rounds "$rounds" -- tests/bench/run.sh "${argv[@]}")
out=$(mktemp -d)
iperf_pids=()
trap 'for p in "${iperf_pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$out"' EXIT

bazel build -c opt //tests/bench:tcp_bench //examples/weight_sync >&2
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
sync_bin="$bin/examples/weight_sync/weight_sync"

# Mooncake: a venv of its own (the wheel is ~46 MB), made once and reused.
venv=.bench-venv
mooncake_py=
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
  mooncake_py="$venv/bin/python"
elif python3 -m venv "$venv" >"$out/venv.log" 2>&1 &&
     "$venv/bin/pip" install -q mooncake-transfer-engine-non-cuda >>"$out/venv.log" 2>&1 &&
     "$venv/bin/python" -c 'import mooncake.engine' >>"$out/venv.log" 2>&1; then
  mooncake_py="$venv/bin/python"
else
  echo "[bench] Mooncake not measured: it did not install: $(tail -n 2 "$out/venv.log" | tr '\n' ' ')" >&2
  tail -n 2 "$out/venv.log" | tr '\n' ' ' >"$out/mooncake_missing"
fi

"$sync_bin" --model-bytes "$model_bytes" --print-layout >"$out/layout.json"
# One 400 MiB bf16 tensor, the same for refit (--one-tensor) and gloo.
python3 -c 'import json; print(json.dumps({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[209715200]]}))' \
  >"$out/one.json"

# iperf3 with N independent process pairs on loopback; prints the summed GB/s.
iperf_pairs() {
  local n=$1 i base=$((20000 + RANDOM % 20000))
  iperf_pids=()
  for i in $(seq "$n"); do
    iperf3 -s -1 -p $((base + i)) >/dev/null 2>&1 &
    iperf_pids+=($!)
  done
  sleep 0.3
  local cpids=()
  for i in $(seq "$n"); do
    iperf3 -c 127.0.0.1 -p $((base + i)) -t 3 -J >"$out/iperf$i.json" 2>/dev/null &
    cpids+=($!)
  done
  for p in "${cpids[@]}"; do wait "$p" || true; done
  for p in "${iperf_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  iperf_pids=()
  python3 - "$out" "$n" <<'PY'
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
total = 0.0
for i in range(1, n + 1):
    r = json.load(open(f"{d}/iperf{i}.json"))
    if "error" in r or "sum_received" not in r.get("end", {}):
        sys.exit(f"iperf3 pair {i} of {n} failed: {r.get('error', 'no receiver sum')}")
    total += r["end"]["sum_received"]["bits_per_second"] / 8e9
print(total)
PY
}

# The main job's last JSON line; fails unless every update verified.
main_job() {
  "$sync_bin" --quiet "$@" | tail -n 1 >"$out/job.json"
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r["verified"] else "unverified: " + json.dumps(r))' \
    "$out/job.json"
  cat "$out/job.json"
}

for round in $(seq "$rounds"); do
  echo "[bench] round $round of $rounds" >&2
  r="$out/round$round"
  mkdir -p "$r"
  for n in 1 2 4; do
    iperf_pairs "$n" >"$r/iperf$n"
    python3 tests/bench/socket_pairs.py "$n" "$(python3 tests/bench/layout.py "$out/layout.json")" "$updates" >"$r/pairs$n.json"
    main_job --workers "$n" --model-bytes "$model_bytes" --updates "$updates" >"$r/refit$n.json"
    echo "[bench]   N=$n: iperf3 pairs $(cat "$r/iperf$n") GB/s, socket pairs" \
      "$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["aggregate_gbps"],3))' "$r/pairs$n.json") GB/s, refit" \
      "$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(round(r["gbps"]*r["workers"],3), "GB/s aggregate, worker loop lag", r["worker_loop_lag_ms"])' "$r/refit$n.json")" >&2
  done
  # What checksums and staged commits cost where the transfer keeps both cores busy.
  main_job --workers 2 --model-bytes "$model_bytes" --updates "$updates" --checksums >"$r/refit2_checksums.json"
  main_job --workers 2 --model-bytes "$model_bytes" --updates "$updates" --commit staged >"$r/refit2_staged.json"
  /usr/bin/python3 tests/bench/gloo_broadcast.py "$out/layout.json" 2 "$updates" resident >"$r/gloo.json"
  /usr/bin/python3 tests/bench/gloo_broadcast.py "$out/layout.json" 2 "$updates" fresh >"$r/gloo_fresh.json"
  if [ -n "$mooncake_py" ]; then
    GLOG_minloglevel=2 "$mooncake_py" tests/bench/mooncake_bench.py "$out/layout.json" 2 "$updates" \
      >"$r/mooncake.json" 2>"$r/mooncake.err" || { cat "$r/mooncake.err" >&2; exit 1; }
  fi
  main_job --workers 1 --one-tensor --model-bytes 400M --updates "$updates" >"$r/refit_one.json"
  /usr/bin/python3 tests/bench/gloo_broadcast.py "$out/one.json" 1 "$updates" resident >"$r/gloo_one.json"
  "$bin/tests/bench/tcp_bench" --updates 3 >"$r/tcp.jsonl"
done

python3 - "$out" "$rounds" "$model_bytes" "${json_out:-}" "$meta" "$updates" <<'PY'
import json, os, statistics, sys
d, rounds, model, json_out, meta = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
updates = int(sys.argv[6])
def load(r, name):
    return json.load(open(f"{d}/round{r}/{name}"))
mooncake = os.path.exists(f"{d}/round1/mooncake.json")
per_round = []
for r in range(1, rounds + 1):
    m = {}
    for n in (1, 2, 4):
        iperf = float(open(f"{d}/round{r}/iperf{n}").read())
        job = load(r, f"refit{n}.json")
        agg = job["gbps"] * job["workers"]
        pairs = load(r, f"pairs{n}.json")["aggregate_gbps"]
        m[f"iperf3_{n}_pairs_gbps"] = iperf
        m[f"socket_{n}_pairs_resident_gbps"] = pairs
        m[f"refit_{n}_workers_aggregate_gbps"] = agg
        m[f"refit_vs_iperf3_{n}"] = agg / iperf
        m[f"refit_vs_socket_pairs_{n}"] = agg / pairs
    job2 = load(r, "refit2.json")
    # Steady state: the updates after the first (which faults in what it touches first).
    def steady(job):
        return statistics.median(job["update_seconds"][1:] or job["update_seconds"])
    m["checksums_cost_2"] = steady(load(r, "refit2_checksums.json")) / steady(job2)
    m["staged_cost_2"] = steady(load(r, "refit2_staged.json")) / steady(job2)
    gloo = load(r, "gloo.json")
    fresh = load(r, "gloo_fresh.json")
    m["gloo_resident_2_workers_gbps_per_worker"] = gloo["gbps"]
    m["gloo_fresh_copy_2_workers_gbps_per_worker"] = fresh["gbps"]
    m["refit_vs_gloo_resident_2"] = job2["gbps"] / gloo["gbps"]
    m["refit_vs_gloo_fresh_copy_2"] = job2["gbps"] / fresh["gbps"]
    if mooncake:
        mc = load(r, "mooncake.json")
        m["mooncake_2_targets_gbps_per_target"] = mc["gbps"]
        m["refit_vs_mooncake_2"] = job2["gbps"] / mc["gbps"]
    one, gone = load(r, "refit_one.json"), load(r, "gloo_one.json")
    m["refit_one_400MiB_tensor_gbps"] = one["gbps"]
    m["gloo_one_400MiB_tensor_gbps"] = gone["gbps"]
    m["refit_vs_gloo_one_tensor"] = one["gbps"] / gone["gbps"]
    tcp = [json.loads(l) for l in open(f"{d}/round{r}/tcp.jsonl")]
    s = next(l for l in tcp if l["case"] == "summary")
    m["memcpy_gbps"] = s["memcpy_gbps"]
    m["tiny_vs_big"] = s["tiny_vs_big"]
    m["overlap_wall_vs_larger"] = s["overlap_wall_vs_larger"]
    staging = job2["buffer_bytes"] * job2["num_buffers"]
    m["rss_vs_limit"] = job2["worker_peak_rss_bytes"] / (job2["bytes"] + staging + (100 << 20))
    m["worker_loop_lag_update_max_ms"] = max(load(r, f"refit{n}.json")["worker_loop_lag_ms"]["update"] for n in (1, 2, 4))
    per_round.append(m)
keys = list(per_round[0])
summary = {}
for k in keys:
    v = [m[k] for m in per_round]
    summary[k] = {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
targets = {"refit_vs_iperf3_1": 0.95, "refit_vs_iperf3_2": 0.95, "refit_vs_iperf3_4": 0.95,
           "refit_vs_socket_pairs_1": 0.95, "refit_vs_socket_pairs_2": 0.95, "refit_vs_socket_pairs_4": 0.95,
           "refit_vs_gloo_resident_2": 1.3, "refit_vs_mooncake_2": 1.5, "refit_vs_gloo_one_tensor": 1.0}
print(f"refit loopback benchmarks: {model} bf16 model, medians of {rounds} rounds [min-max]")
for k in keys:
    s = summary[k]
    t = targets.get(k)
    mark = "" if t is None else (f"   (target >= {t}: {'met' if s['median'] >= t else 'NOT MET'})")
    print(f"  {k:44s} {s['median']:9.3f} [{s['min']:.3f}-{s['max']:.3f}]{mark}")
if not mooncake:
    print("  Mooncake: not measured: " + open(f"{d}/mooncake_missing").read().strip())
job = load(1, "refit2.json")
report = {**meta, "model": model, "bytes": job["bytes"], "tensors": job["tensors"], "updates": updates,
          "summary": summary, "per_round": per_round,
          "unmet": [k for k, t in targets.items() if k in summary and summary[k]["median"] < t]}
if not mooncake:
    report["mooncake_not_measured"] = open(f"{d}/mooncake_missing").read().strip()
if json_out:
    json.dump(report, open(json_out, "w"), indent=1)
print(json.dumps({k: v["median"] for k, v in summary.items()}))
PY
