#!/usr/bin/env bash
# Runs lib/cuda's GPU test binaries and the kernel benchmark, already built here with
#   bazel build --config=cuda //tests/cuda/...
# on a machine with a GPU, where Bazel need not exist: copy the binaries (they link
# the CUDA runtime statically; the machine needs glibc >= this one's and a driver)
# and run
#   tests/cuda/gpu_check.sh DIR_WITH_THE_BINARIES
# A test that skips (no device) counts as a failure here: this script is the GPU check.
set -u
dir=${1:-$(bazel info --config=cuda bazel-bin 2>/dev/null)/tests/cuda}
tests="raii_test await_gpu_test unpack_test convert_kernels_test fill_bytes_test await_test"
status=0
for t in $tests; do
  out=$(timeout 120 "$dir/$t" 2>&1)
  rc=$?
  if [ $rc -ne 0 ] || grep -q "SKIPPED" <<<"$out"; then
    echo "FAIL $t (rc=$rc)"
    tail -40 <<<"$out"
    status=1
  else
    echo "PASS $t: $(grep -E '^\[  PASSED  \]' <<<"$out")"
  fi
done
timeout 120 "$dir/kernel_bench" || status=1
exit $status
