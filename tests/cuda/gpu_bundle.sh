#!/usr/bin/env bash
# Prepares the GPU check for a machine with a GPU and no Bazel: builds every GPU
# test and benchmark binary here with --config=cuda (CUDA runtime and OpenSSL
# linked statically; no libtorch; only libnccl.so.2 is loaded from the machine)
# and copies them, the check's scripts and a commit stamp into gpu-bundle/
# (ignored by git), stripped of debug info and checked to stay, with the tree,
# under 60 MiB.
# The ucx engine's device-memory test loads UCX dynamically: the bundle carries
# PyPI's libucx-cu13 (UCX with CUDA transports; tests/cuda/requirements-ucx.txt,
# from a venv python/venv.sh makes) under ucx/, as the wheel lays it out.
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
      tests/engines/nccl/nccl_gpu_test examples/torch_ipc/worker tests/cuda/ucx_device_gpu_test)
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

# UCX with CUDA support: the libraries and transport modules the ucx test loads,
# in the wheel's layout (its modules find the CUDA runtime it ships by RPATH).
ucx_venv=$(bash python/venv.sh --requirements tests/cuda/requirements-ucx.txt --check tests/cuda/ucx_venv_check.py |
           tail -n 1)
ucx_site=$("$ucx_venv/bin/python" -c 'import libucx, os; print(os.path.dirname(os.path.dirname(libucx.__file__)))')
ucx_libs=(libucx/lib/libucp.so.0 libucx/lib/libucs.so.0 libucx/lib/libuct.so.0 libucx/lib/libucm.so.0
          libucx/lib/ucx/libuct_cma.so.0 libucx/lib/ucx/libuct_cuda.so.0 libucx/lib/ucx/libucm_cuda.so.0)
ucx_libs+=($(cd "$ucx_site" && ls libucx_cu13.libs/libcudart-*.so.*))
for f in "${ucx_libs[@]}"; do
  mkdir -p "$dest/ucx/${f%/*}"
  cp -L "$ucx_site/$f" "$dest/ucx/$f"
  chmod u+w "$dest/ucx/$f"
  strip --strip-debug "$dest/ucx/$f"
done

# Everything the steps run is in the bundle.
for p in $(grep -v '^#' tests/cuda/gpu_steps.txt | cut -d'|' -f4 | grep -oE '(tests|examples)/[A-Za-z0-9_./]+' | sort -u); do
  [ -e "$dest/$p" ] || { echo "gpu_bundle: gpu_steps.txt runs $p, which the bundle does not carry" >&2; exit 1; }
done

# Nothing but libc, libstdc++, libgcc, the driver and NCCL may be loaded from the
# GPU machine; anything else would have to be bundled.
allowed='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|libnccl|libcuda)\.so'
# UCX (the ucx test) comes from the bundle: resolved there, with what it needs.
for f in "${bins[@]}"; do
  extra=$(LD_LIBRARY_PATH="$(readlink -f "$dest")/ucx/libucx/lib" ldd "$dest/$f" | grep -v "=> $(readlink -f "$dest")/ucx/" |
          awk '{print $1}' | sed 's|.*/||' | grep -vE "$allowed" || true)
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
# The device machine takes the tree and the carried bundle, 64 MiB in all; keep 4
# MiB of it free.
tree=$(git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
echo "gpu-bundle: $dest, $(( size / 1048576 )) MiB (with the tree $(( (size + ${tree:-0}) / 1048576 )) MiB), commit ${commit:0:12}$([ "$dirty" = true ] && echo ' (dirty)')"
if [ $(( size + ${tree:-0} )) -gt $(( 60 * 1048576 )) ]; then
  echo "gpu_bundle: the bundle and the tree are over 60 MiB (the GPU machine takes 64 MiB in all)" >&2
  exit 1
fi
