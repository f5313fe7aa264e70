#!/usr/bin/env bash
# The GPU check: runs the GPU test binaries and the kernel benchmark, built here with
#   bazel build --config=cuda //tests/cuda/... //tests/engines/nccl/...
# on a machine with a GPU, where Bazel need not exist. Copy bazel-bin's tests/cuda
# and tests/engines/nccl folders (the binaries link the CUDA runtime statically;
# NCCL is loaded from LD_LIBRARY_PATH, e.g. a torch venv's nvidia/nccl/lib) and run
#   tests/cuda/gpu_check.sh BIN_ROOT [REPORT_DIR]
# BIN_ROOT holds tests/cuda/ and tests/engines/nccl/. A test that skips (no device)
# counts as a failure here: this script is the GPU check. With REPORT_DIR, every
# test's output and the benchmark's JSON line are written there too.
set -u
root=${1:-$(bazel info --config=cuda bazel-bin 2>/dev/null)}
report=${2:-}
[ -n "$report" ] && mkdir -p "$report"
tests="tests/cuda/raii_test tests/cuda/await_gpu_test tests/cuda/unpack_test tests/cuda/convert_kernels_test
       tests/cuda/fill_bytes_test tests/cuda/await_test tests/cuda/pipeline_gpu_test
       tests/engines/nccl/nccl_gpu_test"
status=0
for t in $tests; do
  out=$(timeout 120 "$root/$t" 2>&1)
  rc=$?
  [ -n "$report" ] && printf '%s\n' "$out" > "$report/$(basename "$t").log"
  if [ $rc -ne 0 ] || grep -q "SKIPPED" <<<"$out"; then
    echo "FAIL $t (rc=$rc)"
    tail -40 <<<"$out"
    status=1
  else
    echo "PASS $t: $(grep -E '^\[  PASSED  \]' <<<"$out")"
  fi
done
for b in kernel_bench pipeline_bench; do
  bench=$(timeout 300 "$root/tests/cuda/$b") || status=1
  echo "$bench"
  [ -n "$report" ] && printf '%s\n' "$bench" > "$report/$b.json"
done
# PyTorch trainer -> refit worker (torch_ipc): needs python3 with torch and CUDA.
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  ipc="--worker-bin $root/examples/torch_ipc/worker --refit-ipc $root/examples/torch_ipc"
  out=$(timeout 300 python3 "$root/tests/cuda/torch_ipc_check.py" $ipc 2>&1) || status=1
  echo "$out"
  [ -n "$report" ] && printf '%s\n' "$out" > "$report/torch_ipc_check.log"
  bench=$(timeout 400 python3 "$root/tests/bench/torch_ipc_bench.py" $ipc) || status=1
  echo "$bench"
  [ -n "$report" ] && printf '%s\n' "$bench" > "$report/torch_ipc_bench.json"
else
  echo "FAIL torch_ipc: python3 has no torch with CUDA (put the torch venv's python3 first on PATH)"
  status=1
fi
exit $status
