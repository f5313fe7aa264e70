#!/usr/bin/env bash
# The README's "verified on a GPU" column from a synthetic GPU-mode report, end to
# end: step logs as the GPU check leaves them go through gpu_report.py summarize
# (the writer), the summary into status_table (the C++ reader) and gpu_report.py
# verified-backends (the Python reader); both readers must give exactly what the
# steps say: "yes" where a backend's steps passed, "yes (1 GPU)" where some of them
# needed two GPUs, "no" where one failed, timed out or skipped. A dry-run report
# sets nothing.
#
#   status_table_test.sh STATUS_TABLE GPU_REPORT_PY GPU_REPORT_SCHEMA_JSON
set -euo pipefail
table_bin=$(readlink -f "$1") report_py=$(readlink -f "$2") schema=$(readlink -f "$3")
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/status_table_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# gpu_report.py reads its schema from its own folder, as in the bundle.
mkdir -p "$tmp/cuda" "$tmp/rep/steps" "$tmp/reports"
cp "$report_py" "$schema" "$tmp/cuda/"
pass='[==========] 2 tests ran.
[  PASSED  ] 2 tests.'
failed='[  FAILED  ] X.y (3 ms)
[  FAILED  ] 1 test, listed below:
[  FAILED  ] X.y'
two='[ RUN      ] T.a
t.cc:9: Skipped
needs 2 GPUs (NCCL refuses two ranks on one device); this machine has 1
[  SKIPPED ] T.a (0 ms)
[  PASSED  ] 0 tests.
[  SKIPPED ] 1 test, listed below:'
step() {  # name kind backends rc log
  printf '%s\t%s\t%s\tran\t%s\t1.0\t60\n' "$1" "$2" "$3" "$4" >>"$tmp/rep/steps.tsv"
  printf '%s\n' "$5" >"$tmp/rep/steps/$1.log"
}
: >"$tmp/rep/steps.tsv"
step preflight preflight - 0 "host: synthetic"
step s_loopback gtest loopback 0 "$pass"
step s_tcp gtest tcp 1 "$failed"
step s_ucx gtest ucx 0 "$pass"
step s_two gtest_2gpu ucx,nccl 0 "$two"
step s_nccl gtest nccl 0 "$pass"
step s_ipc json cuda_ipc 0 '{"skipped": true, "reason": "no torch"}'
step s_sharded gtest torch_ipc,tcp_sharded 0 "$pass"
step s_torch json torch_ipc 124 ''
echo '{"commit": "synthetic", "dirty": false}' >"$tmp/rep/stamp.json"
python3 "$tmp/cuda/gpu_report.py" summarize --report "$tmp/rep" --mode gpu --budget 60 --elapsed 9 >"$tmp/summary.txt" || true
cat "$tmp/summary.txt"
[ -s "$tmp/rep/summary.json" ] || fail "gpu_report.py wrote no summary"
python3 - "$tmp/rep/summary.json" <<'PY' || fail "the summary does not say what the steps did"
import json, sys
s = json.load(open(sys.argv[1]))
got = {x["name"]: (x["status"], x["backends"], x["ok"]) for x in s["steps"]}
want = {"preflight": ("passed", [], True), "s_loopback": ("passed", ["loopback"], True),
        "s_tcp": ("failed", ["tcp"], False), "s_ucx": ("passed", ["ucx"], True),
        "s_two": ("needs 2 GPUs", ["ucx", "nccl"], True), "s_nccl": ("passed", ["nccl"], True),
        "s_ipc": ("skipped", ["cuda_ipc"], False), "s_sharded": ("passed", ["torch_ipc", "tcp_sharded"], True),
        "s_torch": ("timeout", ["torch_ipc"], False)}
assert got == want, got
assert s["mode"] == "gpu" and s["ok"] is False and s["schema"] == "refit-gpu-report/2", s
PY
cp "$tmp/rep/summary.json" "$tmp/reports/synthetic.json"

expect() {  # backend -> what the column must say
  case "$1" in
    loopback|tcp_sharded) echo "yes" ;;
    ucx|nccl) echo "yes (1 GPU)" ;;
    *) echo "no" ;;
  esac
}
"$table_bin" --reports "$tmp/reports" --schema "$schema" >"$tmp/table.md"
cat "$tmp/table.md"
python3 "$tmp/cuda/gpu_report.py" verified-backends "$tmp/reports/synthetic.json" >"$tmp/python.tsv"
rows=0
while IFS='|' read -r _ name _ _ _ _ _ _ _ col _; do
  name=$(echo "$name" | tr -d ' `'); col=$(echo "$col" | sed 's/^ *//; s/ *$//')
  case "$name" in ''|backend|---) continue ;; esac
  rows=$((rows + 1))
  [ "$col" = "$(expect "$name")" ] || fail "status_table says '$col' for $name, the report says '$(expect "$name")'"
  py=$(awk -F'\t' -v b="$name" '$1 == b { print $2 }' "$tmp/python.tsv")
  [ -z "$py" ] || [ "$py" = "$col" ] || fail "gpu_report.py says '$py' for $name, status_table '$col'"
done <"$tmp/table.md"
[ $rows -ge 5 ] || fail "the table lists $rows backends"
grep -q '| yes |' "$tmp/table.md" || fail "no backend said yes"
grep -q '| no |' "$tmp/table.md" || fail "no backend said no"

# A dry run's report proves nothing.
python3 - "$tmp/reports/synthetic.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); s["mode"] = "dry"; json.dump(s, open(sys.argv[1], "w"))
PY
"$table_bin" --reports "$tmp/reports" --schema "$schema" >"$tmp/dry.md"
if awk -F'|' 'NR > 2 { print $(NF - 1) }' "$tmp/dry.md" | grep -q yes; then
  cat "$tmp/dry.md"
  fail "a dry-run report set the column"
fi
echo "PASS ($rows backends)"
