#!/usr/bin/env bash
# tests/sim/BUILD: simulate_test. Arguments: the simulate binary, the main job, a
# platform file.
set -euo pipefail
simulate=$1
job=$2
platform=$3
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

# Sharded (M trainer ranks to N workers) from a Hugging Face config: a tiny Llama
# and a tiny DeepSeek-V3-style MoE.
cat >"$tmp/llama.json" <<'JSON'
{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
JSON
cat >"$tmp/moe.json" <<'JSON'
{"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
 "n_routed_experts": 8, "n_shared_experts": 1, "num_hidden_layers": 3, "first_k_dense_replace": 1,
 "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
 "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1024}
JSON
"$simulate" --hf-config "$tmp/moe.json" --print-model | grep -q "^deepseek_v3: " || fail "--print-model"
shard() { "$simulate" --hf-config "$tmp/$1.json" --rate 400gbit --buffer-bytes 64K --json "${@:2}"; }
one=$(shard llama --fsdp 2 --tp 2)
two=$(shard llama --fsdp 2 --tp 2 --replicas 2)
fp8=$(shard llama --fsdp 2 --tp 2 --weights fp8)
moe=$(shard moe --hsdp 2,2 --tp 4)
delta=$(shard llama --fsdp 2 --tp 2 --delta 0.05)
staged=$(shard llama --fsdp 2 --tp 2 --staged)
sums=$(shard llama --fsdp 2 --tp 2 --checksums)
python3 - "$one" "$two" "$fp8" "$moe" "$delta" "$staged" "$sums" <<'PY' || fail "a sharded invariant does not hold (above)"
import json, sys
one, two, fp8, moe, delta, staged, sums = (json.loads(a) for a in sys.argv[1:])
def tx(p): return sum(n["tx_bytes"] for n in p["nics"])
def rx(p): return sum(n["rx_bytes"] for n in p["nics"])
checks = {
    "every byte sent is received": all(abs(tx(p) - rx(p)) < 1 for p in (one, two, fp8, moe, delta)),
    "two replicas take twice the bytes": abs(tx(two) - 2 * tx(one)) < 1,
    "fp8 weights move fewer bytes": tx(fp8) < 0.7 * tx(one),
    "a delta moves fewer bytes": tx(delta) < 0.5 * tx(one),
    "no run beats the busiest NIC at line rate": all(p["seconds"] >= p["limit_seconds"] for p in (one, two, fp8, moe)),
    "a staged commit costs time, in its own phase": staged["seconds"] > one["seconds"] and
        [p for p in staged["phases"] if p["name"] == "commit"][0]["seconds"] > 0,
    "checksums cost time and move the same bytes": sums["seconds"] > one["seconds"] and tx(sums) == tx(one),
    "the MoE's experts arrive (bytes to every worker)": all(n["rx_bytes"] > 0 for n in moe["nics"] if n["host"].startswith("worker")),
}
bad = [k for k, ok in checks.items() if not ok]
for k in bad:
    print("FAILED:", k)
print("sharded: one", one["seconds"], "two replicas", two["seconds"], "fp8", fp8["seconds"], "moe", moe["seconds"],
      "delta", delta["seconds"])
sys.exit(1 if bad else 0)
PY
# An oversubscribed fat tree: 2 GPUs a node, uplinks at half their NICs' sum (a
# model of about 1 GB, so that bandwidth, not latency, sets the time).
cat >"$tmp/mid.json" <<'JSON'
{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
 "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
JSON
mid() { "$simulate" --hf-config "$tmp/mid.json" --rate 400gbit --buffer-bytes 64M --json --fsdp 2 --tp 2 "$@"; }
plain=$(mid)
over=$(mid --gpus-per-node 2 --oversubscription 2)
python3 - "$plain" "$over" <<'PY' || fail "oversubscription: an invariant does not hold (above)"
import json, sys
one, over = (json.loads(a) for a in sys.argv[1:])
ratio = over["seconds"] / one["seconds"]
print("oversubscribed 2x: %.2fx the time, limit at %s" % (ratio, over["busiest_nic"]))
sys.exit(0 if 1.8 <= ratio <= 2.2 and over["busiest_nic"].endswith(".uplink") and
         over["seconds"] >= over["limit_seconds"] else 1)
PY
if out=$(shard llama --fsdp 2 --tp 2 --oversubscription 0.5 2>&1); then fail "--oversubscription 0.5 accepted"; fi
grep -q "oversubscription" <<<"$out" || fail "--oversubscription 0.5: '$out'"

# A platform file of one's own: the same transfer, a spine shared by both pairs'
# routes; one without the hosts the layout needs is refused naming the host.
own=$(shard llama --fsdp 2 --tp 2 --platform "$platform")
python3 -c "import json,sys; p=json.loads(sys.argv[1]); assert p['seconds'] > 0 and p['busiest_nic'], p" "$own" ||
  fail "--platform $platform: $own"
if out=$(shard llama --fsdp 4 --tp 2 --platform "$platform" 2>&1); then fail "a platform without trainer2 accepted"; fi
grep -q "no host 'trainer2'" <<<"$out" || fail "--platform without trainer2: '$out'"
echo '{"model_type": "gpt2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 8, "num_attention_heads": 1}' >"$tmp/gpt2.json"
if out=$("$simulate" --hf-config "$tmp/gpt2.json" --print-model 2>&1); then fail "model_type gpt2 accepted"; fi
grep -q "model_type 'gpt2'" <<<"$out" || fail "gpt2: '$out'"

# --help and -h: the usage on stdout, status 0; an unknown flag: stderr, status 2.
for h in --help -h; do
  out=$("$simulate" "$h" 2>"$tmp/err") || fail "$h: status $?"
  grep -q "^usage: simulate" <<<"$out" || fail "$h: no usage on stdout: '$out'"
  grep -q -- "--hf-config" <<<"$out" || fail "$h: the usage names no --hf-config"
  [ ! -s "$tmp/err" ] || fail "$h wrote to stderr: $(cat "$tmp/err")"
done
rc=0
"$simulate" --no-such-flag >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "--no-such-flag: status $rc, not 2"
[ ! -s "$tmp/out" ] && grep -q "unknown argument '--no-such-flag'" "$tmp/err" ||
  fail "--no-such-flag: stdout '$(cat "$tmp/out")', stderr '$(cat "$tmp/err")'"

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
