#!/usr/bin/env bash
# Prepares the GPU check for a machine with a GPU and no Bazel: builds every GPU
# test and benchmark binary here with --config=cuda (CUDA runtime linked
# statically; no libtorch) and copies them, with gpu_check.sh, into gpu-bundle/
# (ignored by git). On the GPU machine, from the repository root:
#
#   LD_LIBRARY_PATH=<dir with libnccl.so.2> gpu-bundle/tests/cuda/gpu_check.sh gpu-bundle REPORT_DIR
#
# (e.g. a torch venv's site-packages/nvidia/nccl/lib; that venv's python3 first on
# PATH for the PyTorch checks). The check prints PASS/FAIL per
# binary and the benchmarks' JSON lines, and writes them under REPORT_DIR.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
bins=(tests/cuda/raii_test tests/cuda/await_gpu_test tests/cuda/unpack_test tests/cuda/convert_kernels_test
      tests/cuda/fill_bytes_test tests/cuda/await_test tests/cuda/pipeline_gpu_test tests/cuda/kernel_bench
      tests/cuda/pipeline_bench tests/engines/nccl/nccl_gpu_test examples/torch_ipc/worker)
labels=()
for b in "${bins[@]}"; do labels+=("//${b%/*}:${b##*/}"); done
bazel build --config=cuda "${labels[@]}"
bin=$(bazel info --config=cuda bazel-bin 2>/dev/null)
rm -rf gpu-bundle
for b in "${bins[@]}"; do
  mkdir -p "gpu-bundle/${b%/*}"
  cp "$bin/$b" "gpu-bundle/$b"
done
cp tests/cuda/gpu_check.sh tests/cuda/torch_ipc_check.py gpu-bundle/tests/cuda/
mkdir -p gpu-bundle/tests/bench
cp tests/bench/torch_ipc_bench.py gpu-bundle/tests/bench/
cp examples/torch_ipc/refit_ipc.py gpu-bundle/examples/torch_ipc/
du -sh gpu-bundle | awk '{print "gpu-bundle: " $1}'
