#!/usr/bin/env bash
# The TCP engine's relay against its star on an emulated network, where the
# network and not the CPU is the limit: the trainer and every worker in a network
# namespace of their own, each joined to a switch (a bridge in its own namespace)
# by a veth pair with a token-bucket limit in both directions (each host has
# RATE up and RATE down, like a NIC). With 1, 2, 4 and 8 workers a star's time
# grows ~N (the trainer's egress carries N copies); a chain's stays within 1.3x
# of one worker's (each hop carries one copy, forwarded cut-through).
#
# Usage (as root: namespaces need CAP_NET_ADMIN):
#   tests/bench/netns_scale.sh [--rate 1gbit] [--model-bytes 64M] [--workers "1 2 4 8"]
#                              [--topologies "star chain tree:2 chain+checksums chain+staged star+delta"]
#                              [--rounds 3] [--updates 2] [--buffer-bytes 8M] [--change-fraction 0.1]
#                              [--bin DIR] [--json FILE] [--quick] [--engine tcp|ucx]
#                              [--replay DIR]
#   --replay DIR: the main job replays a recorded trajectory (weight_sync --replay,
#   tests/bench/delta_density.py --record DIR) instead of its synthetic model;
#   --model-bytes and --change-fraction do not apply then
#   --engine ucx: the ucx engine over UCX's tcp transport on each host's eth0
#   (UCX_TLS=tcp,self UCX_NET_DEVICES=eth0: its shared-memory transports would
#   bypass the emulated network, the namespaces sharing one kernel).
#   --quick: the CI version (--workers "1 4" --rounds 1 --model-bytes 32M --topologies "star chain")
#   "sharded:M" (a topology of its own): the sharded job, M trainer ranks (FSDP
#   Shard(0)) to N tensor-parallel workers (tcp_sharded; --engine ucx:
#   ucx_sharded), each rank and worker on a host of its own: N from --workers.
#   A topology may carry options: "chain+checksums" (per-bucket checksums),
#   "chain+staged" (staged commits), "star+delta" (--delta, each update
#   after the first changing --change-fraction of the elements); each is compared
#   with its plain topology at the same N (run too, if not listed): at the
#   network's limit, where the CPU has room, the checksums (hashed on a thread of
#   their own ahead of the stream, verified beside the loads) should cost at most
#   1.05x and staged commits at most 1.25x; a delta update at a fraction <= 0.1 at
#   most 0.3x of a full one (updates after the first, both sides: the first has no
#   base; needs --updates 2 or more).
# Prints one table (medians over rounds, min-max in brackets) and checks:
#   chain(N) / chain(1) <= 1.3 and star(N) / star(1) >= 0.6 N for every N.
# Exit 0: checks met; 1: a check failed or a run failed; 2: usage; 77: this
# machine cannot make namespaces (not root, no ip/tc), said why.
set -euo pipefail
cd "$(dirname "$0")/../.."

rate=1gbit
model_bytes=64M
replay=""  # --replay DIR
workers_list="1 2 4 8"
topologies="star chain tree:2 chain+checksums chain+staged star+delta"
change_fraction=0.1  # +delta: the fraction of elements each update after the first changes
rounds=3
updates=2
buffer_bytes=8M      # several buckets even in a small model: the pipeline, not one bucket, is measured
bin=
json_out=
engine=tcp
argv=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate="$2"; shift 2 ;;
    --model-bytes) model_bytes="$2"; shift 2 ;;
    --workers) workers_list="$2"; shift 2 ;;
    --topologies) topologies="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --updates) updates="$2"; shift 2 ;;
    --buffer-bytes) buffer_bytes="$2"; shift 2 ;;
    --change-fraction) change_fraction="$2"; shift 2 ;;
    --replay) replay="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --quick) workers_list="1 4"; rounds=1; model_bytes=32M; topologies="star chain"; shift ;;
    -h|--help) sed -n 2,27p "$0"; exit 0 ;;
    *) echo "netns_scale: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
# command, commit, date, rounds for the JSON (tests/bench/benchmeta.py), as the run starts
meta=$(python3 tests/bench/benchmeta.py --rounds "$rounds" -- tests/bench/netns_scale.sh "${argv[@]}")
case "$engine" in
  tcp) ;;
  ucx) export UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 ;;
  *) echo "netns_scale: --engine: tcp or ucx, not '$engine'" >&2; exit 2 ;;
esac
# Each topology with options is compared with its plain one: run that too.
with_bases=
for topo in $topologies; do
  base=${topo%%+*}
  case " $topologies $with_bases " in *" $base "*) ;; *) with_bases="$with_bases $base" ;; esac
  with_bases="$with_bases $topo"
done
topologies="${with_bases# }"
case " $topologies " in
  *+delta*)
    [ "$updates" -ge 2 ] || { echo "netns_scale: +delta: needs --updates 2 or more (the first is full)" >&2; exit 2; }
    ;;
esac
case " $workers_list " in *" 1 "*) ;; *) echo "netns_scale: --workers must include 1 (the baseline)" >&2; exit 2 ;; esac

for tool in ip tc python3; do
  command -v "$tool" >/dev/null || { echo "netns_scale: cannot run: '$tool' is not installed (Debian: iproute2)" >&2; exit 77; }
done
[ "$(id -u)" -eq 0 ] || { echo "netns_scale: cannot run: network namespaces need root (CAP_NET_ADMIN)" >&2; exit 77; }

if [ -z "$bin" ]; then
  bazel build -c opt //examples/weight_sync >&2
  bin="$(bazel info -c opt bazel-bin 2>/dev/null)/examples/weight_sync/weight_sync"
fi
[ -f "$bin" ] || bin="$bin/examples/weight_sync/weight_sync"
[ -x "$bin" ] || { echo "netns_scale: no weight_sync binary at '$bin'" >&2; exit 2; }

p="rf$$"             # every name this run makes starts with it
max_workers=0
for n in $workers_list; do [ "$n" -gt "$max_workers" ] && max_workers=$n; done
# The sharded job's trainer ranks after rank 0 take hosts of their own too.
max_hosts=$max_workers
for topo in $topologies; do
  case "$topo" in
    sharded:*)
      m=${topo%%+*}
      m=${m#sharded:}
      case "$m" in '' | *[!0-9]* | 0) echo "netns_scale: '$topo': expected sharded:M, M trainer ranks" >&2; exit 2 ;; esac
      [ $((max_workers + m - 1)) -gt "$max_hosts" ] && max_hosts=$((max_workers + m - 1))
      ;;
  esac
done
out=$(mktemp -d)
worker_pids=()

stop_workers() {
  for pid in "${worker_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${worker_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  worker_pids=()
}
cleanup() {
  stop_workers
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$p" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "$out"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- the network
# One switch namespace with a bridge; host h (0 = trainer, 1..N = workers) is
# namespace ${p}h$h at 10.77.0.(h+1), its veth eth0 <-> the switch's port s$h.
# tbf on eth0 limits what the host sends, tbf on s$h what it receives.
# Any step of the setup that this machine refuses (no veth, bridge or tbf support
# in its kernel, a container without the rights) means the check cannot run here:
# exit 77 naming the step, never a half-built network.
net() {
  "$@" 2>"$out/err" || {
    echo "netns_scale: cannot run: '$*' failed: $(cat "$out/err")" >&2
    exit 77
  }
}
shape() {  # shape NS DEV
  net ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 256kb latency 200ms
}
net ip netns add "${p}sw"
net ip -n "${p}sw" link add name bridge0 type bridge
net ip -n "${p}sw" link set bridge0 up
net ip -n "${p}sw" link set lo up
for h in $(seq 0 "$max_hosts"); do
  ns="${p}h$h"
  net ip netns add "$ns"
  net ip link add name eth0 netns "$ns" type veth peer name "s$h" netns "${p}sw"
  net ip -n "$ns" addr add "10.77.0.$((h + 1))/24" dev eth0
  net ip -n "$ns" link set lo up
  net ip -n "$ns" link set eth0 up
  net ip -n "${p}sw" link set "s$h" master bridge0
  net ip -n "${p}sw" link set "s$h" up
  shape "$ns" eth0
  shape "${p}sw" "s$h"
done
model_args=(--model-bytes "$model_bytes")
if [ -n "$replay" ]; then
  model_args=(--replay "$(readlink -f "$replay")")
  model_bytes="replay:$replay"
fi
# The sharded job starts its workers and ranks itself, each through this: the
# host's namespace by its address (10.77.0.(h+1)), then the binary.
cat >"$out/enter.sh" <<EOF
#!/bin/sh
address=\$1
shift
exec ip netns exec "${p}h\$((\${address##*.} - 1))" "\$@"
EOF
chmod +x "$out/enter.sh"
echo "[netns] engine $engine; $((max_hosts + 1)) hosts on one switch, $rate each way per host (tbf), model $model_bytes" \
  "in $buffer_bytes buckets," \
  "$updates updates per run, $rounds rounds" >&2

# ---------------------------------------------------------------- one run
# run N TOPOLOGY ROUND: fresh workers in hosts 1..N, the trainer in host 0;
# appends the trainer's JSON (plus n, topology, round) to $out/runs.jsonl.
run() {
  local n=$1 topo=$2 round=$3 connect="" h port opt rc=0
  local base=${topo%%+*} extra=()
  if [ "$base" != "$topo" ]; then
    for opt in $(echo "${topo#*+}" | tr '+' ' '); do
      case "$opt" in
        checksums) extra+=(--checksums) ;;
        staged) extra+=(--commit staged) ;;
        delta)
          extra+=(--delta)
          [ -n "$replay" ] || extra+=(--change-fraction "$change_fraction")
          ;;
        *) echo "netns_scale: unknown topology option '$opt' in '$topo'" >&2; return 2 ;;
      esac
    done
  fi
  if [ "${base#sharded:}" != "$base" ]; then
    local m=${base#sharded:} hosts=""
    for h in $(seq 1 $((n + m - 1))); do hosts="${hosts:+$hosts,}10.77.0.$((h + 1))"; done
    ip netns exec "${p}h0" "$bin" --engine "$engine" --listen 10.77.0.1 --trainers "$m" --tp "$n" \
      --spawn-hosts "$hosts" --spawn-via "$out/enter.sh" "${model_args[@]}" --buffer-bytes "$buffer_bytes" \
      --updates "$updates" "${extra[@]}" --timeout-ms 60000 --quiet >"$out/t.out" 2>"$out/t.err" || rc=$?
    record "$n" "$topo" "$round" "$rc"
    return
  fi
  for h in $(seq 1 "$n"); do
    ip netns exec "${p}h$h" "$bin" --role worker --engine "$engine" --listen "10.77.0.$((h + 1))" --timeout-ms 60000 \
      >"$out/w$h.out" 2>"$out/w$h.err" &
    worker_pids+=($!)
  done
  for h in $(seq 1 "$n"); do
    port=
    for _ in $(seq 200); do
      port=$(awk '/^REFIT_WORKER_PORT/ {print $2}' "$out/w$h.out")
      [ -n "$port" ] && break
      sleep 0.05
    done
    [ -n "$port" ] || { echo "netns_scale: worker $h printed no port: $(cat "$out/w$h.err")" >&2; return 1; }
    connect="${connect:+$connect,}10.77.0.$((h + 1)):$port"
  done
  ip netns exec "${p}h0" "$bin" --engine "$engine" --listen 10.77.0.1 --connect "$connect" --load-model "${model_args[@]}" \
    --buffer-bytes "$buffer_bytes" \
    --updates "$updates" --topology "$base" "${extra[@]}" --timeout-ms 60000 --quiet >"$out/t.out" 2>"$out/t.err" || rc=$?
  stop_workers
  record "$n" "$topo" "$round" "$rc"
}

# record N TOPOLOGY ROUND RC: the trainer's last line ($out/t.out) as a run.
record() {
  local n=$1 topo=$2 round=$3 rc=$4
  if [ "$rc" -ne 0 ] || ! tail -n 1 "$out/t.out" | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["verified"] else 1)'; then
    echo "netns_scale: $topo with $n workers failed (exit $rc): $(tail -n 3 "$out/t.err") $(tail -n 1 "$out/t.out")" >&2
    return 1
  fi
  tail -n 1 "$out/t.out" | python3 -c '
import json, sys
r = json.load(sys.stdin)
r.update(n=int(sys.argv[1]), topology=sys.argv[2], round=int(sys.argv[3]))
print(json.dumps(r))' "$n" "$topo" "$round" >>"$out/runs.jsonl"
  tail -n 1 "$out/runs.jsonl" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("[netns] round %d: %7s x%d: %.3f s per update" % (r["round"], r["topology"], r["n"], r["seconds"] / r["updates"]))' >&2
}

# Rounds interleave every configuration, so a noisy minute hits all of them.
for round in $(seq 1 "$rounds"); do
  for n in $workers_list; do
    for topo in $topologies; do
      run "$n" "$topo" "$round"
    done
  done
done

python3 - "$out/runs.jsonl" "$rate" "$model_bytes" "${json_out:-}" "$engine" "$change_fraction" "$meta" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
rate, model, json_out = sys.argv[2], sys.argv[3], sys.argv[4]
topos = list(dict.fromkeys(r["topology"] for r in runs))
ns = sorted({r["n"] for r in runs})
def per_update(n, t):
    return [r["seconds"] / r["updates"] for r in runs if r["n"] == n and r["topology"] == t]
med = {(n, t): statistics.median(per_update(n, t)) for n in ns for t in topos}
# Updates after the first (a delta's first update has no base and goes full).
def later(n, t):
    return statistics.median(statistics.mean(r["update_seconds"][1:]) for r in runs
                             if r["n"] == n and r["topology"] == t)
def later_wire(n, t):
    return statistics.median(statistics.mean(r["wire_bytes"][1:]) / r["bytes"] for r in runs
                             if r["n"] == n and r["topology"] == t)
print(f"relay vs star over {sys.argv[5]}, {model} model, {rate} per host each way; seconds per update, "
      f"median of {len(per_update(ns[0], topos[0]))} rounds [min-max]; ratio to 1 worker")
head = f"{'workers':>7} | " + " | ".join(f"{t:>24}" for t in topos)
print(head)
print("-" * len(head))
for n in ns:
    cells = []
    for t in topos:
        v = per_update(n, t)
        cells.append(f"{med[(n, t)]:6.3f} [{min(v):.3f}-{max(v):.3f}] {med[(n, t)] / med[(1, t)]:4.2f}x")
    print(f"{n:>7} | " + " | ".join(f"{c:>24}" for c in cells))
failures = []
for n in ns:
    if n == 1:
        continue
    if "chain" in topos and med[(n, "chain")] / med[(1, "chain")] > 1.3:
        failures.append(f"chain({n}) / chain(1) = {med[(n, 'chain')] / med[(1, 'chain')]:.2f} > 1.3")
    if "star" in topos and med[(n, "star")] / med[(1, "star")] < 0.6 * n:
        failures.append(f"star({n}) / star(1) = {med[(n, 'star')] / med[(1, 'star')]:.2f} < 0.6 x {n}: "
                        "the network is not the limit here, so the table says nothing")
costs = []
for t in topos:
    if "+" not in t:
        continue
    base, opts = t.split("+", 1)
    if base not in topos:
        continue
    limit = 1.05 if opts == "checksums" else 1.25 if opts == "staged" else None
    delta = "delta" in opts.split("+")
    if delta:
        limit = 0.3 if float(sys.argv[6]) <= 0.1 else None  # the issue's target: at density <= 10%
    for n in ns:
        r = later(n, t) / later(n, base) if delta else med[(n, t)] / med[(n, base)]
        note = f" (updates after the first; wire {later_wire(n, t):.3f} of the bytes)" if delta else ""
        costs.append(f"{t} / {base} at {n} workers: {r:.3f}" + note + (f" (target <= {limit})" if limit else ""))
        if limit and r > limit:
            failures.append(f"{t} costs {r:.3f}x of {base} at {n} workers, more than {limit}x")
for c in costs:
    print("cost: " + c)
summary = {**json.loads(sys.argv[7]), "engine": sys.argv[5], "rate": rate, "model": model,
           "median_s_per_update": {f"{t}@{n}": med[(n, t)] for n in ns for t in topos},
           "runs": runs, "failures": failures}
if json_out:
    json.dump(summary, open(json_out, "w"), indent=1)
for f in failures:
    print("CHECK FAILED: " + f)
print("checks: " + ("met" if not failures else f"{len(failures)} failed"))
sys.exit(1 if failures else 0)
PY
