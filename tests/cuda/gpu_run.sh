#!/usr/bin/env bash
# On the GPU machine: unpacks the bundle archive tests/cuda/gpu_bundle.sh --archive
# made (carried along with the tree) into a fresh folder and runs the GPU check
# from it, its report under OUT_DIR:
#
#   bash tests/cuda/gpu_run.sh .device/gpu-bundle.tar.xz "$OUT"
#
# Environment: as gpu_check.sh's (REFIT_GPU_BUDGET_S, REFIT_GPU_PYTHON, ...).
set -u
if [ $# -ne 2 ] || [ ! -f "$1" ]; then
  echo "usage: gpu_run.sh BUNDLE.tar.xz OUT_DIR" >&2
  exit 2
fi
archive=$1 out=$2
mkdir -p "$out" || exit 2
dir=$(mktemp -d "${TMPDIR:-/tmp}/refit-gpu-bundle.XXXXXX")
t0=$(date +%s.%N)
# tar with xz where the machine has it, else Python's lzma (the torch venv's).
if ! tar -C "$dir" -xJf "$archive" 2>"$out/unpack.err"; then
  unpacked=0
  for py in python3 /opt/torch/.venv/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$archive" "$dir" \
         2>>"$out/unpack.err"; then
      unpacked=1
      break
    fi
  done
  if [ $unpacked = 0 ]; then
    echo "gpu_run: could not unpack $archive:" >&2
    cat "$out/unpack.err" >&2
    exit 1
  fi
fi
rm -f "$out/unpack.err"
echo "gpu_run: unpacked $archive ($(du -sm "$dir" | cut -f1) MiB) in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
bash "$dir/tests/cuda/gpu_check.sh" "$dir" "$out"
rc=$?
rm -rf "$dir"
exit $rc
