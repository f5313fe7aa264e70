#!/usr/bin/env bash
# The GPU check's first step (run by gpu_check.sh from the bundle root): what
# machine this is, and whether refit's binaries can run here at all, so that an
# environment failure is told apart from a refit failure in the first seconds.
# Prints "key: value" lines (gpu_report.py picks them up) and the details after.
# Fails when a binary misses a shared library, and on a GPU machine also when
# nvidia-smi or torch cannot use the GPU.
set -u
status=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mode=${REFIT_GPU_MODE:-gpu}
py=${PY:-python3}

echo "host: $(uname -n) $(uname -srm)"
echo "glibc: $(ldd --version 2>&1 | head -n 1)"
echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
echo "cpus: $(nproc) memory: $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
echo "python: $py ($("$py" --version 2>&1))"
echo "nccl_lib: ${REFIT_NCCL_LIB:-none} ($(ls "${REFIT_NCCL_LIB:-/nonexistent}"/libnccl.so* 2>/dev/null | xargs -r -n1 readlink -f | head -n 1))"
echo "stamp: $(tr -d '\n' <STAMP.json 2>/dev/null || echo 'no STAMP.json')"
echo "CUDA_VISIBLE_DEVICES: ${CUDA_VISIBLE_DEVICES-unset}"

if command -v nvidia-smi >/dev/null 2>&1; then
  if timeout -k 5 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader >"$tmp/gpus" 2>&1; then
    sed 's/^/gpu: /' "$tmp/gpus"
    echo "driver: $(head -n 1 "$tmp/gpus" | cut -d, -f3 | xargs)"
  else
    echo "gpu: nvidia-smi failed: $(head -c 300 "$tmp/gpus" | tr '\n' ' ')"
    [ "$mode" = gpu ] && status=1
  fi
else
  echo "gpu: no nvidia-smi"
  [ "$mode" = gpu ] && status=1
fi

# Every binary of the bundle must load here: list what is missing. UCX comes from
# the bundle (ucx/, as gpu_check.sh's ucx step loads it); without a GPU the
# driver's libraries (libcuda, libnvidia-ml: UCX's CUDA modules link them) are
# absent by nature.
missing=0
driver_libs='^$'
[ "$mode" = gpu ] || driver_libs='^(libcuda\.so\.1|libnvidia-ml\.so\.1)$'
while IFS= read -r -d '' f; do
  if LC_ALL=C LD_LIBRARY_PATH="$PWD/ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 20 ldd "$f" \
      >"$tmp/ldd" 2>&1; then
    nf=$(grep 'not found' "$tmp/ldd" | awk '{print $1}' | grep -vE "$driver_libs" | sort -u | xargs)
    if [ -n "$nf" ]; then
      echo "ldd_missing: ${f#./}: $nf"
      missing=1
    fi
  fi
done < <(find . -type f -perm -u+x ! -name '*.sh' ! -name '*.py' -print0 | sort -z)
if [ $missing = 0 ]; then echo "ldd: every binary finds its shared libraries"; else status=1; fi

if [ "$mode" = gpu ]; then
  # One line: torch sees the GPU and runs a kernel on it.
  if timeout -k 5 90 "$py" -c '
import torch
x = torch.ones(4, device="cuda")
nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
print("torch_smoke: ok torch", torch.__version__, "cuda", torch.version.cuda, "nccl", nccl,
      "device", torch.cuda.get_device_name(0), "sum", float((x + 1).sum()))
' >"$tmp/smoke" 2>&1; then
    tail -n 1 "$tmp/smoke"
  else
    echo "torch_smoke: FAILED: $(tail -n 3 "$tmp/smoke" | tr '\n' ' ')"
    status=1
  fi
else
  echo "torch_smoke: not run (dry run: no GPU)"
fi

echo
echo "---- details"
command -v nvidia-smi >/dev/null 2>&1 && timeout -k 5 30 nvidia-smi 2>&1 | head -n 40
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
echo "PATH=$PATH"
env | grep -E '^(NCCL_|CUDA_|REFIT_)' | sort
exit $status
