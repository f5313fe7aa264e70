#!/usr/bin/env bash
# Prepares the GPU check for a machine with a GPU and no Bazel: builds every GPU
# test and benchmark binary here with --config=cuda (CUDA runtime and OpenSSL
# linked statically; no libtorch; only libnccl.so.2 is loaded from the machine)
# and copies them, the check's scripts and a commit stamp into gpu-bundle/
# (ignored by git), stripped of debug info and checked to stay under 40 MiB.
#
#   tests/cuda/gpu_bundle.sh [OUT_DIR]      (default: gpu-bundle)
#
# Then, on the GPU machine (the bundle carried along with the tree), exactly:
#
#   bash gpu-bundle/tests/cuda/gpu_check.sh gpu-bundle "$OUT"
#
# (README, "The GPU check", says how the device tool is called.)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
dest=${1:-gpu-bundle}
bins=(tests/cuda/raii_test tests/cuda/await_gpu_test tests/cuda/unpack_test tests/cuda/convert_kernels_test
      tests/cuda/fill_bytes_test tests/cuda/await_test tests/cuda/pipeline_gpu_test tests/cuda/kernel_bench
      tests/cuda/pipeline_bench tests/cuda/engine_gpu_test
      tests/engines/nccl/nccl_gpu_test examples/torch_ipc/worker)
scripts=(tests/cuda/gpu_check.sh tests/cuda/gpu_preflight.sh tests/cuda/gpu_report.py tests/cuda/gpu_steps.txt
         tests/cuda/torch_ipc_check.py tests/bench/torch_ipc_bench.py examples/torch_ipc/refit_ipc.py)
labels=()
for b in "${bins[@]}"; do labels+=("//${b%/*}:${b##*/}"); done
bazel build --config=cuda "${labels[@]}"
bin=$(bazel info --config=cuda bazel-bin 2>/dev/null)

rm -rf "$dest"
for f in "${bins[@]}"; do
  mkdir -p "$dest/${f%/*}"
  cp "$bin/$f" "$dest/$f"
  chmod u+w "$dest/$f"
  strip --strip-debug "$dest/$f"
done
for f in "${scripts[@]}"; do
  mkdir -p "$dest/${f%/*}"
  cp "$f" "$dest/$f"
done
chmod +x "$dest"/tests/cuda/*.sh

# Everything the steps run is in the bundle.
for p in $(grep -v '^#' tests/cuda/gpu_steps.txt | cut -d'|' -f4 | grep -oE '(tests|examples)/[A-Za-z0-9_./]+' | sort -u); do
  [ -e "$dest/$p" ] || { echo "gpu_bundle: gpu_steps.txt runs $p, which the bundle does not carry" >&2; exit 1; }
done

# Nothing but libc, libstdc++, libgcc, the driver and NCCL may be loaded from the
# GPU machine; anything else would have to be bundled.
allowed='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|libnccl|libcuda)\.so'
for f in "${bins[@]}"; do
  extra=$(ldd "$dest/$f" | awk '{print $1}' | sed 's|.*/||' | grep -vE "$allowed" || true)
  if [ -n "$extra" ]; then
    echo "gpu_bundle: $f needs shared libraries the GPU machine may not have: $extra" >&2
    exit 1
  fi
done

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=false
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=true
cat >"$dest/STAMP.json" <<EOF
{"commit": "$commit", "dirty": $dirty, "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "builder_glibc": "$(ldd --version | head -n 1 | awk '{print $NF}')", "config": "--config=cuda", "binaries": ${#bins[@]}}
EOF

size=$(du -sb "$dest" | cut -f1)
echo "gpu-bundle: $dest, $(( size / 1048576 )) MiB, commit ${commit:0:12}$([ "$dirty" = true ] && echo ' (dirty)')"
if [ "$size" -gt $(( 40 * 1048576 )) ]; then
  echo "gpu_bundle: the bundle is over 40 MiB (what the GPU machine takes with the tree is 64 MiB)" >&2
  exit 1
fi
