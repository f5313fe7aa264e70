#!/usr/bin/env bash
# Prepares the GPU check for a machine with a GPU and no Bazel: builds every GPU
# test and benchmark binary here with --config=cuda (CUDA runtime and OpenSSL
# linked statically; no libtorch; only libnccl.so.2 is loaded from the machine)
# and copies them, the check's scripts, refit's CUDA wheel for the GPU machine's
# Python (unpacked under python/cpXY, for the Python steps) and a commit stamp into
# gpu-bundle/ (ignored by git), stripped of symbols. With --archive, also one
# .tar.xz of it (the binaries share most of their bytes: CUDA runtime, refit,
# OpenSSL; xz's window finds them), which is what travels to the GPU machine,
# checked to stay under 32 MiB (the device tool moves 64 MiB of tree and carried
# files in all).
# The ucx engine's device-memory test loads UCX dynamically: the bundle carries
# PyPI's libucx-cu13 (UCX with CUDA transports; tests/cuda/requirements-ucx.txt,
# from a venv python/venv.sh makes) under ucx/, as the wheel lays it out.
#
#   tests/cuda/gpu_bundle.sh [--archive FILE.tar.xz] [OUT_DIR]   (default: gpu-bundle)
#
# REFIT_GPU_PYTHONS: the CPython versions to carry the CUDA wheel for (default
# 3.12, the GPU machine's; "none" for none), each from pyenv or python3.X on PATH.
#
# Then, on the GPU machine (the archive carried along with the tree), exactly:
#
#   bash tests/cuda/gpu_run.sh .device/gpu-bundle.tar.xz "$OUT"
#
# (gpu_run.sh unpacks it and runs gpu-bundle/tests/cuda/gpu_check.sh.)
#
# (README, "The GPU check", says how the device tool is called.)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
archive=""
if [ "${1:-}" = --archive ]; then
  archive=${2:?--archive needs a file}
  shift 2
fi
dest=${1:-gpu-bundle}
bins=(tests/cuda/raii_test tests/cuda/await_gpu_test tests/cuda/unpack_test tests/cuda/convert_kernels_test
      tests/cuda/fill_bytes_test tests/cuda/await_test tests/cuda/pipeline_gpu_test tests/cuda/kernel_bench
      tests/cuda/pipeline_bench tests/cuda/engine_gpu_test tests/cuda/multi_gpu_test
      tests/cuda/tensor_map_target_gpu_test tests/engines/nccl/nccl_gpu_test examples/torch_ipc/worker
      tests/cuda/ucx_device_gpu_test)
scripts=(tests/cuda/gpu_check.sh tests/cuda/gpu_preflight.sh tests/cuda/gpu_report.py tests/cuda/gpu_report_schema.json
         tests/cuda/gpu_steps.txt tests/cuda/torch_ipc_check.py tests/cuda/python_gpu_check.py
         tests/bench/torch_ipc_bench.py examples/torch_ipc/refit_ipc.py tests/verl/gpu_check.py tests/verl/ranks.py)
# refit.verl's GPU check imports verl's names from this stand-in there (its README).
mapfile -t standin < <(find tests/verl/standin -type f -name '*.py' | sort)
scripts+=("${standin[@]}")
labels=()
for b in "${bins[@]}"; do labels+=("//${b%/*}:${b##*/}"); done
bazel build --config=cuda "${labels[@]}"
bin=$(bazel info --config=cuda bazel-bin 2>/dev/null)

rm -rf "$dest"
for f in "${bins[@]}"; do
  mkdir -p "$dest/${f%/*}"
  cp "$bin/$f" "$dest/$f"
  chmod u+w "$dest/$f"
  # Symbols too, not only debug info: a failure's stack is read here, from the
  # same commit's build (STAMP.json names it).
  strip --strip-all "$dest/$f"
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
  strip --strip-unneeded "$dest/ucx/$f"
done

# refit's CUDA wheel for each Python the GPU machine may run the Python steps with,
# unpacked (python/cpXY/refit/...): they import it with PYTHONPATH, no pip there.
for v in ${REFIT_GPU_PYTHONS:-3.12}; do
  [ "$v" = none ] && break
  wheel=$(./refit wheel --cuda --python "$v" | tail -n 1)
  tag=cp${v/./}
  mkdir -p "$dest/python/$tag"
  python3 -m zipfile -e "$wheel" "$dest/python/$tag"
  find "$dest/python/$tag" -name '*.so' -exec strip --strip-unneeded {} +
done

# Everything the steps run is in the bundle.
for p in $(grep -v '^#' tests/cuda/gpu_steps.txt | cut -d'|' -f5 | grep -oE '(tests|examples)/[A-Za-z0-9_./]+' | sort -u); do
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
echo "gpu-bundle: $dest, $(( size / 1048576 )) MiB unpacked, commit ${commit:0:12}$([ "$dirty" = true ] && echo ' (dirty)')"
du -sb "$dest"/tests/cuda/* "$dest"/tests/engines/*/* "$dest"/examples/*/* "$dest"/python/* "$dest"/ucx 2>/dev/null |
  sort -rn | head -n 6 | awk '{ printf "  %5.1f MiB  %s\n", $1 / 1048576, $2 }'
[ -n "$archive" ] || exit 0
mkdir -p "$(dirname "$archive")"
tar -C "$dest" -cf - . | xz -9 -T2 -c >"$archive.tmp" && mv "$archive.tmp" "$archive"
packed=$(stat -c %s "$archive")
# The device machine takes the tree and the carried archive, 64 MiB in all: the
# archive keeps to half of it.
tree=$(git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
echo "gpu-bundle archive: $archive, $(( packed / 1048576 )) MiB (with the tree $(( (packed + ${tree:-0}) / 1048576 )) MiB)"
if [ "$packed" -gt $(( 32 * 1048576 )) ]; then
  echo "gpu_bundle: the archive is $(( packed / 1048576 )) MiB, over its 32 MiB" >&2
  exit 1
fi
if [ $(( packed + ${tree:-0} )) -gt $(( 60 * 1048576 )) ]; then
  echo "gpu_bundle: the archive and the tree are over 60 MiB (the GPU machine takes 64 MiB in all)" >&2
  exit 1
fi
