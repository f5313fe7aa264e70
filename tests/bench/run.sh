#!/usr/bin/env bash
# refit's benchmarks, all in one run so the ratios compare like with like on a
# shared, noisy machine:
#   - worker-side TCP throughput vs iperf3 loopback (the physical limit here)
#   - the main job (trainer + 2 workers, ~1 GiB bf16 model) vs torch.distributed
#     gloo broadcast of the same tensor set (Debian's python3-torch), both into
#     resident tensors and the way vLLM's engine does it (fresh tensor + copy)
#   - 100k x 4 KiB tensors vs one 400 MiB tensor (per-tensor overhead)
#   - transfer with equal-cost post-processing vs the larger of the two (overlap)
#   - worker peak RSS vs model + staging + 100 MiB
# Usage: tests/bench/run.sh [--model-bytes 1G] [--updates 3]   (or ./refit bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
model_bytes=1G
updates=3
while [ $# -gt 0 ]; do
  case "$1" in
    --model-bytes) model_bytes="$2"; shift 2 ;;
    --updates) updates="$2"; shift 2 ;;
    *) echo "usage: $0 [--model-bytes SIZE] [--updates N]" >&2; exit 2 ;;
  esac
done
out=$(mktemp -d)
trap 'rm -rf "$out"; [ -n "${iperf_pid:-}" ] && kill "$iperf_pid" 2>/dev/null || true' EXIT

bazel build -c opt //tests/bench:tcp_bench //examples/weight_sync >&2
bin=$(bazel info -c opt bazel-bin 2>/dev/null)

echo "[bench] iperf3 loopback" >&2
port=$((20000 + RANDOM % 20000))
iperf3 -s -p "$port" >/dev/null 2>&1 &
iperf_pid=$!
ok=
# A result counts only if it has the receiver's sum (a refused or cut connection
# can still exit 0 with an "error" member).
for _ in $(seq 50); do
  iperf3 -c 127.0.0.1 -p "$port" -t 3 -J >"$out/iperf.json" 2>/dev/null || true
  if python3 -c 'import json,sys; json.load(open(sys.argv[1]))["end"]["sum_received"]' "$out/iperf.json" 2>/dev/null; then
    ok=1
    break
  fi
  sleep 0.2
done
[ -n "$ok" ] || { echo "[bench] iperf3 loopback failed: $(cat "$out/iperf.json")" >&2; exit 1; }
kill "$iperf_pid" 2>/dev/null || true

echo "[bench] refit TCP engine, worker side" >&2
"$bin/tests/bench/tcp_bench" --updates 5 | tee "$out/tcp.jsonl" >&2

echo "[bench] main job: trainer + 2 workers" >&2
"$bin/examples/weight_sync/weight_sync" --workers 2 --model-bytes "$model_bytes" --updates "$updates" --quiet \
  | tail -n 1 | tee "$out/sync.json" >&2
"$bin/examples/weight_sync/weight_sync" --model-bytes "$model_bytes" --print-layout >"$out/layout.json"

echo "[bench] torch.distributed gloo broadcast, same tensors, trainer + 2 workers" >&2
/usr/bin/python3 tests/bench/gloo_broadcast.py "$out/layout.json" 2 "$updates" resident | tee "$out/gloo.json" >&2
/usr/bin/python3 tests/bench/gloo_broadcast.py "$out/layout.json" 2 "$updates" fresh | tee "$out/gloo_fresh.json" >&2

python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
iperf = json.load(open(f"{d}/iperf.json"))["end"]["sum_received"]["bits_per_second"] / 8e9
tcp = [json.loads(l) for l in open(f"{d}/tcp.jsonl")]
summary = next(l for l in tcp if l["case"] == "summary")
sync = json.load(open(f"{d}/sync.json"))
gloo = json.load(open(f"{d}/gloo.json"))
gloo_fresh = json.load(open(f"{d}/gloo_fresh.json"))
staging = sync["buffer_bytes"] * sync["num_buffers"]
rss_limit = sync["bytes"] + staging + (100 << 20)
report = {
    "iperf3_loopback_gbps": round(iperf, 3),
    "memcpy_gbps": round(summary["memcpy_gbps"], 3),
    "refit_worker_gbps": round(summary["worker_gbps"], 3),
    "worker_vs_iperf3": round(summary["worker_gbps"] / iperf, 3),
    "refit_main_job_gbps_per_worker": round(sync["gbps"], 3),
    "gloo_resident_gbps_per_worker": round(gloo["gbps"], 3),
    "refit_vs_gloo_resident": round(sync["gbps"] / gloo["gbps"], 2),
    "gloo_fresh_copy_gbps_per_worker": round(gloo_fresh["gbps"], 3),
    "refit_vs_gloo_fresh_copy": round(sync["gbps"] / gloo_fresh["gbps"], 2),
    "tiny_vs_big": round(summary["tiny_vs_big"], 3),
    "overlap_wall_vs_larger": round(summary["overlap_wall_vs_larger"], 3),
    "overlap_spinning_wall_vs_larger": round(summary["overlap_spinning_wall_vs_larger"], 3),
    "worker_peak_rss_bytes": sync["worker_peak_rss_bytes"],
    "rss_limit_bytes": rss_limit,
    "rss_vs_limit": round(sync["worker_peak_rss_bytes"] / rss_limit, 3),
    "verified": sync["verified"],
}
print(json.dumps(report))
PY
