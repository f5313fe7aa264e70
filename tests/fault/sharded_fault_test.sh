#!/usr/bin/env bash
# The fault suite's sharded configuration: the main job with --trainers 2 --tp 2
# (tcp_sharded; with "--engine ucx", ucx_sharded over UCX's shared memory), a trainer rank or a worker SIGKILLed while updates run. Each case
# must end within its deadline (no hang) with a typed error naming the lost side
# (peer_lost, or timeout, never "verified"), the surviving workers must still answer,
# and none may claim weights it does not hold: a worker that says "clean" holds a
# version that was verified before the kill. A clean run first (the control).
# usage: sharded_fault_test.sh WEIGHT_SYNC_BINARY [--engine ucx]
set -euo pipefail
bin=$1
shift
engine=("$@")
if [ "${engine[*]}" = "--engine ucx" ]; then
  export UCX_TLS=${UCX_TLS:-sm,self} UCX_NET_DEVICES=lo  # UCX's tcp would use every interface
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
timeout_ms=4000
# Sanitized builds (REFIT_SANITIZER, from .bazelrc's asan and tsan test configs) run
# several times slower: give the peers' deadline room.
[ -n "${REFIT_SANITIZER:-}" ] && timeout_ms=10000
job=("${engine[@]}" --trainers 2 --tp 2 --model-bytes 128M --layers 8 --vocab 4000 --timeout-ms "$timeout_ms" --checksums)

fail() { echo "FAIL: $*" >&2; exit 1; }

# The control: every byte verified.
timeout 120 "$bin" "${job[@]}" --updates 2 --quiet >"$dir/clean.json" 2>"$dir/clean.log" || fail "the clean run failed: $(tail -3 "$dir/clean.log")"
python3 - "$dir/clean.json" <<'PY' || exit 1
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert r["verified"] and r["rounds_verified"] == 2, r
assert max(r["bytes_per_worker"]) < 0.55 * r["bytes"], r
print("clean: verified,", r["bytes_per_worker"], "bytes per worker of", r["bytes"])
PY

# kill VICTIM ("trainer rank 1" or "worker 1") once update AFTER has been verified.
scenario() {
  local victim=$1 after=$2 name=$3
  local log="$dir/$name.log" out="$dir/$name.json"
  local start=$SECONDS
  # The log exists before the job starts, so that reading it never races its creation.
  : >"$log"
  timeout 240 "$bin" "${job[@]}" --updates 40 >"$out" 2>"$log" &
  local job_pid=$!
  local pid="" ready=0
  while [ $((SECONDS - start)) -lt 120 ]; do
    pid=$(sed -n "s/^\[refit\] pid of $victim: \([0-9]*\)$/\1/p" "$log" | head -1)
    if [ -n "$pid" ] && grep -q "^\[refit\] update $after: .*verified" "$log"; then ready=1; break; fi
    kill -0 "$job_pid" 2>/dev/null || fail "$name: the job ended before update $after was verified: $(tail -5 "$log")"
    sleep 0.05
  done
  [ "$ready" = 1 ] || fail "$name: update $after was not verified within 120 s: $(tail -5 "$log")"
  [ -n "$pid" ] || fail "$name: no pid for $victim in the log: $(tail -5 "$log")"
  kill -9 "$pid"
  local rc=0
  wait "$job_pid" || rc=$?
  [ "$rc" -ne 124 ] || fail "$name: the job hung (killed by timeout)"
  [ "$rc" -ne 0 ] || fail "$name: the job claims success after $victim was killed"
  python3 - "$out" "$name" "$victim" <<'PY' || fail "$name: $(tail -5 "$log")"
import json, re, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
name, victim = sys.argv[2], sys.argv[3]
assert not r["verified"], r
err = r.get("error", "")
assert re.match(r"(peer_lost|timeout|cancelled|protocol_error): ", err), f"untyped error: {err!r}"
verified = r["rounds_verified"] if r["verified"] else None
states = r.get("worker_states_after_failure", [])
assert states, "no worker states after the failure"
answered = 0
for s in states:
    if "unreachable" in s:
        assert victim.startswith("worker") and s["worker"] == int(victim.split()[-1]), f"a live worker did not answer: {s}"
        continue
    answered += 1
    # A worker may hold the last update it verified (the kill came between
    # updates) but never claims the update that failed.
    if s["state"] == "clean":
        assert s["weight_version"] is not None and s["weight_version"] <= r["updates"], s
assert answered >= 1, states
print(f"{name}: {err[:160]} ... states {states}")
PY
  # The claim check above compares against the job's own log of verified updates.
  local last_ok
  last_ok=$(sed -n 's/^\[refit\] update \([0-9]*\): .*verified$/\1/p' "$log" | tail -1)
  python3 - "$out" "${last_ok:-0}" <<'PY' || fail "$name: a worker claims an update that was never verified"
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
last_ok = int(sys.argv[2])
for s in r.get("worker_states_after_failure", []):
    if s.get("state") == "clean":
        assert s["weight_version"] <= last_ok, (s, last_ok)
PY
  echo "$name: ended in $((SECONDS - start)) s, typed error, no false claim"
  # Nothing of the job is left running: every worker and trainer rank it started is gone.
  local p
  for p in $(sed -n 's/^\[refit\] pid of .*: \([0-9]*\)$/\1/p' "$log"); do
    if kill -0 "$p" 2>/dev/null && ! grep -q zombie "/proc/$p/status" 2>/dev/null; then
      fail "$name: process $p of the job is still running"
    fi
  done
}

scenario "trainer rank 1" 2 kill_trainer_rank
scenario "worker 1" 2 kill_worker
echo "sharded fault suite: passed"
