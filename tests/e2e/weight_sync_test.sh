#!/usr/bin/env bash
# Runs the main job with real worker processes and checks its last line: every
# tensor verified on every worker, figures present and sane. Then checks that bad
# flags fail with a message instead of running.
set -euo pipefail
bin="$1"
fail() { echo "FAIL: $*" >&2; exit 1; }

check() {
  local out last
  out=$("$bin" --quiet "$@") || fail "weight_sync $* exited non-zero: $out"
  last=$(printf '%s\n' "$out" | tail -n 1)
  python3 - "$last" "$@" <<'PY' || fail "bad result for $*: $last"
import json, sys
r = json.loads(sys.argv[1])
for key in ("engine", "workers", "tensors", "bytes", "updates", "seconds", "gbps",
            "receive_s", "process_s", "overlap", "verified"):
    assert key in r, key
assert r["verified"] is True, r
assert r["gbps"] > 0 and r["seconds"] > 0 and 0 <= r["overlap"] <= 1, r
print("ok:", " ".join(sys.argv[2:]), "->", r["bytes"], "bytes x", r["updates"], "to", r["workers"], "workers")
PY
}

# Tensors larger than a buffer (the embedding) are split across buckets.
check --workers 2 --model-bytes 24M --layers 2 --updates 2 --buffer-bytes 1M --num-buffers 3
# One worker, one buffer: no pipelining, still correct; through staging.
check --workers 1 --model-bytes 16M --layers 1 --updates 1 --buffer-bytes 4M --num-buffers 1 --no-direct
# Three workers with simulated post-processing and per-bucket checksums.
check --workers 3 --model-bytes 16M --layers 1 --updates 2 --buffer-bytes 2M --process-cost 0.05 --checksums
# Staged commits over authenticated connections (a secret file of mode 0600).
secret_dir=$(mktemp -d)
trap 'rm -rf "$secret_dir"' EXIT
printf 'e2e-secret\n' > "$secret_dir/secret"
chmod 600 "$secret_dir/secret"
check --workers 2 --model-bytes 16M --layers 1 --updates 2 --buffer-bytes 1M --commit staged --checksums \
  --auth-secret-file "$secret_dir/secret"
cp "$secret_dir/secret" "$secret_dir/secret.ok" && chmod 600 "$secret_dir/secret.ok"
chmod 644 "$secret_dir/secret"
if err=$("$bin" --auth-secret-file "$secret_dir/secret" 2>&1); then fail "a world-readable secret accepted"; fi
grep -q "chmod 600" <<<"$err" || fail "no advice for a world-readable secret: $err"

# Sharded: M trainer processes, N tp workers, each receiving only what it keeps.
check_sharded() {
  local out last
  out=$("$bin" --quiet "$@") || fail "weight_sync $* exited non-zero: $out"
  last=$(printf '%s\n' "$out" | tail -n 1)
  python3 - "$last" "$@" <<'PY' || fail "bad result for $*: $last"
import json, sys
r = json.loads(sys.argv[1])
for key in ("bytes_per_worker", "trainer_egress_bytes", "plan_s", "rounds_verified", "mode"):
    assert key in r, key
assert r["verified"] is True and r["rounds_verified"] == r["updates"], r
assert len(r["bytes_per_worker"]) == r["tp"] and len(r["trainer_egress_bytes"]) == r["trainers"], r
# Fleet-atomic: every worker committed through the vote and holds its undo.
if "--fleet-atomic" in sys.argv:
    assert r["fleet_atomic"] is True and r["commit"] == "staged" and r["workers_holding_undo"] == r["tp"], r
else:
    assert r["workers_holding_undo"] == 0, r
if r["mode"] == "sharded":
    # Every byte a worker keeps, once: the planned share, not the whole model.
    assert max(r["bytes_per_worker"]) == r["planned_bytes_per_worker_max"], r
    assert max(r["bytes_per_worker"]) < r["bytes"] / r["tp"] * 1.05, r
    assert sum(r["trainer_egress_bytes"]) == sum(r["bytes_per_worker"]), r
else:
    assert min(r["bytes_per_worker"]) == r["bytes"], r
if r["engine"] == "ucx_sharded":
    # What UCX chose for every rank's endpoint to each worker, in the result.
    assert len(r["transports"]) == r["tp"], r
    mode = "put" if "--ucx-puts" in sys.argv else "tag"
    assert all(len(t["trainer_ranks"]) == r["trainers"] and t["mode"] == mode for t in r["transports"]), r
print("ok:", " ".join(sys.argv[2:]), "->", r["bytes_per_worker"], "bytes per worker of", r["bytes"])
PY
}
check_sharded --trainers 2 --tp 2 --model-bytes 24M --layers 2 --updates 2 --checksums --auth-secret-file "$secret_dir/secret.ok"
check_sharded --trainers 3 --tp 2 --model-bytes 16M --layers 1 --updates 2 --buffer-bytes 64K --no-direct
check_sharded --trainers 1 --tp 4 --model-bytes 16M --layers 2 --updates 1
check_sharded --tp 2 --broadcast --model-bytes 16M --layers 1 --updates 2
# Fleet-atomic over tcp_sharded: every worker stages its own slices, votes, commits
# and keeps its previous slices as the undo.
check_sharded --trainers 2 --tp 2 --model-bytes 16M --layers 1 --updates 2 --fleet-atomic --checksums
# A broadcast worker slices the whole tensors it is sent: its model cannot read them
# back, so a fleet-atomic update is refused up front, naming the tensor.
if err=$("$bin" --quiet --tp 2 --broadcast --model-bytes 16M --layers 1 --updates 1 --fleet-atomic 2>&1); then
  fail "a fleet-atomic broadcast to slicing workers was accepted"
fi
grep -q "no worker committed.*" <<<"$err" && grep -q "cannot read back 'model.embed_tokens.weight'" <<<"$err" ||
  fail "no typed refusal for a fleet-atomic broadcast: $err"
# Over UCX (ucx_sharded): shared memory, and UCX's tcp on loopback.
UCX_TLS=sm,self UCX_NET_DEVICES=lo check_sharded --engine ucx --trainers 2 --tp 2 --model-bytes 24M --layers 2 \
  --updates 2 --checksums --auth-secret-file "$secret_dir/secret.ok"
UCX_TLS=tcp,self UCX_NET_DEVICES=lo check_sharded --engine ucx --trainers 3 --tp 2 --model-bytes 16M --layers 1 \
  --updates 2 --buffer-bytes 64K --no-direct
UCX_TLS=sm,self UCX_NET_DEVICES=lo check_sharded --engine ucx --trainers 2 --tp 2 --model-bytes 16M --layers 1 \
  --updates 2 --fleet-atomic
# The ranks' puts straight into the workers' tensors (cma), with checksums.
UCX_TLS=sm,self UCX_NET_DEVICES=lo check_sharded --engine ucx --ucx-puts --trainers 2 --tp 2 --model-bytes 24M \
  --layers 2 --updates 2 --checksums
if err=$("$bin" --tp 2 --workers 3 2>&1); then fail "--tp 2 --workers 3 accepted"; fi
grep -q "tp ranks of one engine" <<<"$err" || fail "no message for --tp 2 --workers 3: $err"
if err=$("$bin" --tp 2 --trainers 2 --broadcast 2>&1); then fail "--broadcast with 2 trainers accepted"; fi
grep -q "one trainer" <<<"$err" || fail "no message for --broadcast --trainers 2: $err"

if err=$("$bin" --workers 0 2>&1); then fail "--workers 0 accepted"; fi
grep -q "workers" <<<"$err" || fail "no message for --workers 0: $err"
if err=$("$bin" --model-bytes 12Q 2>&1); then fail "bad size accepted"; fi
grep -q "unknown unit" <<<"$err" || fail "no message for a bad size: $err"
# --help prints the usage (examples/weight_sync:flags_test checks it names every
# flag) and exits 0; an unknown flag exits 2 with the usage on stderr.
usage=$("$bin" --help) || fail "--help exited non-zero"
for f in --workers --role --rank --slice-tp --tp-rank --stats-file; do
  grep -q -- "^  $f " <<<"$usage" || fail "--help does not describe $f: $usage"
done
rc=0
err=$("$bin" --no-such-flag 2>&1) || rc=$?
[ $rc -eq 2 ] || fail "an unknown flag: exit status $rc, expected 2"
grep -q "unknown flag '--no-such-flag'" <<<"$err" || fail "no message for an unknown flag: $err"
grep -q -- "--stats-file PATH" <<<"$err" || fail "no usage after an unknown flag: $err"
echo "1 passed, 0 failed"
