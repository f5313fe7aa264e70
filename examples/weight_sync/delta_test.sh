#!/usr/bin/env bash
# The main job with --delta over real worker processes: the first update goes full,
# later ones at --change-fraction 0.01 send a small fraction of the model's bytes,
# no worker falls back to full updates, and every tensor verifies on every worker.
# At --change-fraction 1 a delta costs no more than (about) the full update.
set -euo pipefail
bin="$1"
fail() { echo "FAIL: $*" >&2; exit 1; }

# check LOW HIGH FLAGS...: LOW * bytes <= later updates' wire_bytes <= HIGH * bytes
# (LOW: the changes were made and sent, not skipped).
# last_line FLAGS...: the job's JSON line (the job must succeed).
last_line() {
  local out
  out=$("$bin" --quiet "$@") || fail "weight_sync $* exited non-zero: $out"
  printf '%s\n' "$out" | tail -n 1
}

check() {
  local low="$1" high="$2" last
  shift 2
  last=$(last_line "$@")
  python3 - "$last" "$low" "$high" "$@" <<'PY' || fail "bad result for $*: $last"
import json, sys
r, low, limit = json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
assert r["verified"] is True and r["rounds_verified"] == r["updates"], r
wire, n = r["wire_bytes"], r["updates"]
assert len(wire) == n == len(r["update_seconds"]), r
assert wire[0] == r["bytes"], ("the first update has no base: full", wire[0], r["bytes"])
for w in wire[1:]:
    assert low * r["bytes"] <= w <= limit * r["bytes"], ("a later update's wire bytes", w, low, limit, r["bytes"])
d = r["delta"]
assert d["full_fallbacks"] == 0, d
assert d["encoded_buckets"] > 0 and d["encode_s"] > 0, d
print("ok:", " ".join(sys.argv[4:]), "-> wire/bytes", [round(w / r["bytes"], 4) for w in wire])
PY
}

common=(--workers 2 --model-bytes 8M --updates 4 --delta --buffer-bytes 1M)
check 0.005 0.1 "${common[@]}" --change-fraction 0.01
check 0.1 1.05 "${common[@]}" --change-fraction 1
# With checksums: each delta bucket's checksum is checked over its decoded bytes.
check 0.005 0.1 "${common[@]}" --change-fraction 0.01 --checksums
# Staged commits through update sessions: each session's commit records the version.
check 0.005 0.1 "${common[@]}" --change-fraction 0.01 --commit staged
# Relays forward the encoded bytes: a chain of 3 and a tree of 4, checksums at every hop.
check 0.005 0.1 --workers 3 --model-bytes 8M --updates 3 --delta --buffer-bytes 1M --change-fraction 0.01 --checksums
check 0.005 0.1 --workers 4 --topology tree:2 --model-bytes 8M --updates 3 --delta --buffer-bytes 1M \
  --change-fraction 0.01
# Over ucx (shared memory here; a star): each bucket's form before its grant, the
# deltas put into granted slots, with checksums and staged commits too; a chain of
# 3, whose relays forward the encoded bytes.
UCX_TLS=sm,self check 0.005 0.1 "${common[@]}" --engine ucx --change-fraction 0.01 --checksums
UCX_TLS=sm,self check 0.005 0.1 "${common[@]}" --engine ucx --change-fraction 0.01 --commit staged
UCX_TLS=tcp,self UCX_NET_DEVICES=lo check 0.005 0.1 "${common[@]}" --engine ucx --change-fraction 0.01
UCX_TLS=sm,self check 0.005 0.1 --workers 3 --topology chain --model-bytes 8M --updates 3 --delta --buffer-bytes 1M \
  --engine ucx --change-fraction 0.01 --checksums

# The sharded job (tcp_sharded): each (trainer rank, worker) pair its own version;
# every worker's slices checked against the reference slicing of the whole model
# after every update; the later updates a small fraction of the bytes on the wire.
check_sharded() {
  local last
  last=$(last_line "$@")
  python3 - "$last" "$@" <<'PY' || fail "bad result for $*: $last"
import json, sys
r = json.loads(sys.argv[1])
assert r["verified"] is True and r["rounds_verified"] == r["updates"], r
got, wire, n = r["worker_bytes"], r["wire_bytes"], r["updates"]
assert len(got) == len(wire) == n and wire[0] == got[0], r
for g, w in zip(got[1:], wire[1:]):
    assert 0.005 * g <= w <= 0.1 * g, ("a later update's wire bytes", w, g)
d = r["delta"]
pairs = r["trainers"] * r["workers"]
assert d["full_fallbacks"] == 0 and d["delta_workers"] == pairs * (n - 1) and d["encoded_buckets"] > 0, d
print("ok:", " ".join(sys.argv[2:]), "-> wire/bytes", [round(w / g, 4) for w, g in zip(wire, got)])
PY
}
check_sharded --trainers 2 --tp 2 --model-bytes 8M --updates 3 --delta --buffer-bytes 1M --change-fraction 0.01
check_sharded --trainers 3 --tp 2 --model-bytes 8M --updates 3 --delta --buffer-bytes 1M --change-fraction 0.01 \
  --checksums

# --replay: a recorded trajectory (the format of tests/bench/delta_density.py
# --record) instead of the synthetic model: 4 states of two bf16 tensors, about 1%
# of the elements moving by one unit between states.
traj=$(mktemp -d)
trap 'rm -rf "$traj"' EXIT
python3 - "$traj" <<'PY'
import json, os, random, struct, sys
d = sys.argv[1]
shapes = {"layers.0.w": [512, 1024], "head": [3000]}
json.dump({"names": list(shapes), "dtype_names": ["bfloat16"] * 2, "shapes": list(shapes.values())},
          open(os.path.join(d, "layout.json"), "w"))
rng = random.Random(3)
vals = [rng.randrange(0x3000, 0x4000) for _ in range(512 * 1024 + 3000)]
for step in range(4):
    if step:
        for i in rng.sample(range(len(vals)), len(vals) // 100):
            vals[i] += 1
    open(os.path.join(d, "step-%04d.bin" % step), "wb").write(struct.pack("<%dH" % len(vals), *vals))
PY
check 0.005 0.1 --workers 2 --updates 4 --delta --buffer-bytes 256K --replay "$traj"
if err=$("$bin" --quiet --workers 1 --updates 5 --replay "$traj" 2>&1); then fail "--replay past its states accepted"; fi
grep -q "step-0004.bin" <<<"$err" || fail "no reason for refusing --updates past the trajectory: $err"
head -c 100 "$traj/step-0002.bin" >"$traj/step-0002.bin.cut" && mv "$traj/step-0002.bin.cut" "$traj/step-0002.bin"
if err=$("$bin" --quiet --workers 1 --updates 3 --replay "$traj" 2>&1); then fail "a cut state accepted"; fi
grep -q "exactly the layout's" <<<"$err" || fail "no reason for refusing a cut state: $err"

# Without --delta every update is full: wire_bytes is bytes.
out=$("$bin" --quiet --workers 1 --model-bytes 4M --updates 2 --change-fraction 0.01) || fail "plain run: $out"
python3 - "$(printf '%s\n' "$out" | tail -n 1)" <<'PY' || fail "plain run: $out"
import json, sys
r = json.loads(sys.argv[1])
assert r["verified"] is True and r["wire_bytes"] == [r["bytes"]] * r["updates"] and "delta" not in r, r
PY

# Refused before anything starts.
if err=$("$bin" --delta --engine tcp_sharded 2>&1); then fail "--delta over tcp_sharded accepted"; fi
grep -q "the tcp and ucx engines" <<<"$err" || fail "no reason for refusing --delta over tcp_sharded: $err"
echo PASS
