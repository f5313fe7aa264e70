#!/usr/bin/env bash
# examples/async_server end to end: the server answers requests on the event loop
# that receives 2 updates (both modes), every answer matches the weights of the
# version it names, and a trainer with another model layout is refused with the
# reason while the server keeps serving its old version. Staging is 2 x 8 MiB (the
# trainer's default, 4 x 256 MiB, is for its benchmark's 1 GiB model): faulting in
# 1 GiB took a TSan build on 2 busy cores past the 20 s init deadline.
set -euo pipefail
server_bin=$1
trainer_bin=$2
tmp=$(mktemp -d "${REFIT_TEST_TMPDIR:-/tmp}/async_server.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT

start_server() {  # mode -> sets control, serve
  "$server_bin" --model-bytes 32M --layers 2 --vocab 4096 --mode "$1" --timeout-ms 20000 \
    > "$tmp/server.out" 2> "$tmp/server.err" &
  pids+=($!)
  for _ in $(seq 200); do
    if grep -q '^ASYNC_SERVER ' "$tmp/server.out"; then break; fi
    sleep 0.05
  done
  line=$(grep '^ASYNC_SERVER ' "$tmp/server.out") || { cat "$tmp/server.err"; echo "server did not start"; exit 1; }
  control=$(echo "$line" | sed -E 's/.*control=([0-9]+).*/\1/')
  serve=$(echo "$line" | sed -E 's/.*serve=([0-9]+).*/\1/')
}

for mode in double_buffered reader_lock; do
  start_server "$mode"
  # A trainer whose model has another layout: refused before a byte moves, named.
  if "$trainer_bin" --server "127.0.0.1:$control" --serve-port "$serve" --model-bytes 32M --layers 3 \
       --vocab 4096 --buffer-bytes 8M --num-buffers 2 --updates 1 --idle-ms 50 --between-ms 50 --timeout-ms 20000 > "$tmp/bad.json" 2> "$tmp/bad.err"; then
    echo "FAIL ($mode): a trainer with another layout was not refused"; cat "$tmp/bad.json" "$tmp/bad.err"; exit 1
  fi
  grep -q 'invalid_argument' "$tmp/bad.json" || { echo "FAIL ($mode): refusal without its reason"; cat "$tmp/bad.json" "$tmp/bad.err"; exit 1; }
  # The real trainer: 2 updates while requests flow; then the server shuts down.
  "$trainer_bin" --server "127.0.0.1:$control" --serve-port "$serve" --model-bytes 32M --layers 2 --vocab 4096 \
    --buffer-bytes 8M --num-buffers 2 --updates 2 --idle-ms 200 --between-ms 100 --request-interval-us 500 --timeout-ms 20000 --shutdown \
    > "$tmp/ok.json" 2> "$tmp/ok.err" || { echo "FAIL ($mode): trainer"; cat "$tmp/ok.json" "$tmp/ok.err"; exit 1; }
  python3 - "$tmp/ok.json" "$mode" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
mode = sys.argv[2]
assert r["ok"], r
assert r["updates_verified"] == 2, r
assert r["answers_mismatched"] == 0, r
assert r["server"]["served_version"] == 2, r
assert r["server"]["mode"] == mode, r
for phase in ("idle", "update", "between"):
    assert r["latency"][phase]["requests"] > 0, (phase, r["latency"])
if mode == "double_buffered":
    assert r["answers_busy"] == 0, r  # readers never wait for an update
print("%s: ok, %d requests, p99 idle %.3f ms / update %.3f ms, %d busy" % (
    mode, r["server"]["requests"], r["latency"]["idle"]["p99_ms"], r["latency"]["update"]["p99_ms"],
    r["answers_busy"]))
PY
  wait "${pids[-1]}" || { echo "FAIL ($mode): server exit status"; cat "$tmp/server.err"; exit 1; }
done
echo PASS
