#!/usr/bin/env bash
# The GPU check: runs the GPU tests and benchmarks of a bundle made by
# tests/cuda/gpu_bundle.sh (prebuilt binaries and scripts; nothing is built here),
# within a global time budget, and always leaves its report under OUT:
#
#   bash gpu-bundle/tests/cuda/gpu_check.sh gpu-bundle "$OUT"
#
#   OUT/gpu-check.log       every step's output, one after another, and the table
#   OUT/gpu-summary.json    per step: status, reason, wall time, figures; the
#                           environment; the bundle's commit stamp
#   OUT/gpu-report.tar.gz   every step's full log, the summary, the stamp
#
# The steps are tests/cuda/gpu_steps.txt, run in order after a preflight (machine,
# driver, GPUs, `ldd` of every binary, a one-line torch CUDA smoke test), each
# under `timeout --kill-after` in a session of its own whose every process is
# killed when the step ends, its output written to a file. A step that would start
# with less than REFIT_GPU_MIN_STEP_S left of the budget is "not run (budget)".
#
# Without a GPU (no nvidia-smi reporting one) it is a dry run: every step still
# runs, and each GPU step must skip with its reason; CI runs it that way so the
# harness cannot rot between shots. On a GPU machine a skip is a failure.
#
# Environment (all optional):
#   REFIT_GPU_BUDGET_S     global budget in seconds (default 420, for a 600 s command)
#   REFIT_GPU_KILL_AFTER_S SIGKILL this long after a step's SIGTERM (default 5)
#   REFIT_GPU_MIN_STEP_S   least budget left to start a step (default 5)
#   REFIT_GPU_PYTHON       the python3 with torch (default /opt/torch/.venv/bin/python3
#                          when present, else python3)
#   REFIT_NCCL_LIB         directory of libnccl.so.2 (default: that python's
#                          nvidia/nccl/lib, else the CUDA toolkit's)
#   REFIT_GPU_DRY_RUN=1    force a dry run; REFIT_GPU_STEPS another steps file
# Exit status 0 when every step passed (GPU) or skipped as it should (dry run).
set -u

if [ $# -ne 2 ] || [ ! -d "$1" ]; then
  echo "usage: gpu_check.sh BUNDLE_DIR OUT_DIR" >&2
  exit 2
fi
bundle=$(cd "$1" && pwd -P)
mkdir -p "$2" || exit 2
out=$(cd "$2" && pwd -P)
here="$bundle/tests/cuda"
start=$EPOCHREALTIME
budget=${REFIT_GPU_BUDGET_S:-420}
kill_after=${REFIT_GPU_KILL_AFTER_S:-5}
min_step=${REFIT_GPU_MIN_STEP_S:-5}
steps_file=${REFIT_GPU_STEPS:-$here/gpu_steps.txt}

work=$(mktemp -d "${TMPDIR:-/tmp}/refit-gpu-check.XXXXXX")
rep="$work/gpu-report"
mkdir -p "$rep/steps"
: >"$rep/steps.tsv"

say() { printf '[gpu-check %6.1fs] %s\n' "$(elapsed)" "$*"; }
elapsed() { awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# ---- environment for the steps
py=${REFIT_GPU_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then py=/opt/torch/.venv/bin/python3; else py=$(command -v python3 || echo python3); fi
fi
export PY="$py"
# The CUDA wheel the bundle carries for that interpreter, unpacked under python/cpXY.
PYTAG=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null || echo unknown)
export PYTAG
export PATH="$(dirname "$py"):$PATH"
nccl_lib=${REFIT_NCCL_LIB:-}
if [ -z "$nccl_lib" ]; then
  for d in "$(dirname "$py")"/../lib/python3*/site-packages/nvidia/nccl/lib "${CUDA_HOME:-/usr/local/cuda}/lib64" \
           /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/libnccl.so.2" ]; then nccl_lib=$(cd "$d" && pwd -P); break; fi
  done
fi
export REFIT_NCCL_LIB="$nccl_lib"
export LD_LIBRARY_PATH="${nccl_lib:+$nccl_lib:}${bundle}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The python that writes the report: the system's, so a broken venv still gets one.
report_py=$(command -v python3 || echo "$py")

# ---- GPU or dry run
mode=gpu
dry_reason=""
if [ "${REFIT_GPU_DRY_RUN:-0}" = 1 ]; then
  mode=dry; dry_reason="REFIT_GPU_DRY_RUN=1"
elif ! command -v nvidia-smi >/dev/null 2>&1 && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  mode=dry; dry_reason="no GPU on this machine (no nvidia-smi, no /dev/nvidia*)"
elif command -v nvidia-smi >/dev/null 2>&1 &&
     timeout -k 5 30 nvidia-smi -L >"$rep/nvidia-smi-L.txt" 2>&1 && ! grep -q '^GPU ' "$rep/nvidia-smi-L.txt"; then
  mode=dry; dry_reason="nvidia-smi lists no GPU: $(head -c 200 "$rep/nvidia-smi-L.txt" | tr '\n' ' ')"
fi
export REFIT_GPU_MODE=$mode

current_pgid=""
finished=0
finish() {
  [ "$finished" = 1 ] && return
  finished=1
  [ -n "$current_pgid" ] && kill -KILL -- "-$current_pgid" 2>/dev/null
  local total; total=$(elapsed)
  cp "$bundle/STAMP.json" "$rep/stamp.json" 2>/dev/null || echo '{"commit": "unknown (no STAMP.json in the bundle)"}' >"$rep/stamp.json"
  "$report_py" "$here/gpu_report.py" summarize --report "$rep" --mode "$mode" --dry-reason "$dry_reason" \
      --budget "$budget" --elapsed "$total" >"$rep/table.txt" 2>&1
  local rc=$?
  [ -s "$rep/summary.json" ] || printf '{"ok": false, "mode": "%s", "error": "the summary could not be written; see table.txt"}\n' \
      "$mode" >"$rep/summary.json"
  # The combined log: header, each step's output (long ones cut in the middle;
  # the tarball keeps them whole), the table.
  {
    echo "refit GPU check: mode=$mode${dry_reason:+ ($dry_reason)} budget=${budget}s elapsed=${total}s"
    echo "bundle stamp: $(tr -d '\n' <"$rep/stamp.json")"
    while IFS=$'\t' read -r name kind backends state code wall limit; do
      echo
      echo "==== step $name ($kind): $state rc=$code wall=${wall}s limit=${limit}s"
      local f="$rep/steps/$name.log"
      [ -f "$f" ] || continue
      if [ "$(wc -c <"$f")" -gt 400000 ]; then
        head -c 200000 "$f"; echo; echo "[... cut; whole log in gpu-report.tar.gz ...]"; tail -c 200000 "$f"
      else
        cat "$f"
      fi
    done <"$rep/steps.tsv"
    echo
    cat "$rep/table.txt"
  } >"$out/gpu-check.log" 2>&1
  cp "$rep/summary.json" "$out/gpu-summary.json"
  # Logs past 8 MiB are cut so the tarball stays well under what comes back.
  for f in "$rep"/steps/*.log; do
    [ -f "$f" ] && [ "$(wc -c <"$f")" -gt 8388608 ] && { tail -c 8388608 "$f" >"$f.tail" && mv "$f.tail" "$f"; }
  done
  tar -C "$work" -czf "$out/gpu-report.tar.gz" gpu-report 2>/dev/null
  cat "$rep/table.txt"
  rm -rf "$work"
  [ $rc -eq 0 ] && exit_status=0 || exit_status=1
}
exit_status=1
trap 'finish; exit $exit_status' EXIT
trap 'say "interrupted: writing the report"; exit 1' TERM INT HUP

# Runs one step: NAME KIND BACKENDS LIMIT_S COMMAND. The command runs from the bundle root
# in a new session (so every process it starts is in one process group), under
# timeout with kill-after, output to its log file; whatever of that group is still
# alive afterwards is killed.
run_step() {
  local name=$1 kind=$2 backends=$3 limit=$4 cmd=$5
  local left; left=$(awk -v b="$budget" -v e="$(elapsed)" 'BEGIN { printf "%d", b - e }')
  if [ "$left" -lt "$min_step" ]; then
    printf '%s\t%s\t%s\tnot_run\t-\t0\t%s\n' "$name" "$kind" "$backends" "$limit" >>"$rep/steps.tsv"
    say "$name: not run (budget: ${left}s left)"
    return
  fi
  local t=$limit
  [ "$left" -lt "$t" ] && t=$left
  local log="$rep/steps/$name.log" s=$EPOCHREALTIME
  say "$name: start (limit ${t}s)"
  ( cd "$bundle" && exec setsid timeout -k "$kill_after" "$t" bash -c "$cmd" ) >"$log" 2>&1 </dev/null &
  current_pgid=$!
  wait "$current_pgid"
  local rc=$?
  kill -KILL -- "-$current_pgid" 2>/dev/null
  current_pgid=""
  local wall; wall=$(awk -v a="$s" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\tran\t%s\t%s\t%s\n' "$name" "$kind" "$backends" "$rc" "$wall" "$t" >>"$rep/steps.tsv"
  say "$name: rc=$rc wall=${wall}s"
}

say "mode=$mode${dry_reason:+ ($dry_reason)} budget=${budget}s python=$py ($PYTAG) nccl=${nccl_lib:-none}"
run_step preflight preflight - 60 "bash '$here/gpu_preflight.sh'"
# Surrounding blanks off (not xargs: it reads quotes, and the steps file's comments
# have apostrophes).
trim() {
  local s=$1
  s="${s#"${s%%[![:space:]]*}"}"
  printf '%s' "${s%"${s##*[![:space:]]}"}"
}
while IFS='|' read -r name kind backends limit cmd; do
  name=$(trim "$name")
  case "$name" in ''|'#'*) continue ;; esac
  kind=$(trim "$kind"); limit=$(trim "$limit")
  backends=$(echo "$backends" | tr -d ' ')
  cmd=$(echo "$cmd" | sed 's/^ *//')
  run_step "$name" "$kind" "${backends:--}" "$limit" "$cmd"
done <"$steps_file"
exit  # the EXIT trap writes the report and sets the status
