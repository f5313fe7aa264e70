#!/usr/bin/env bash
# refit used as an adopter uses it, outside its own workspace (CI runs this):
#   1. Bazel: this directory is a workspace of its own whose WORKSPACE has only the
#      README's five lines; it builds demo.cc (which includes <refit/refit.h> and has
#      a lib/config.h of its own) against @refit//:refit and runs a trainer-to-worker
#      update with it.
#   2. The same workspace builds it again with --config=cuda: refit's GPU engines
#      (nccl, cuda_ipc) compile and register from outside refit's tree.
#   3. pkg-config: ./refit install --prefix DIR, then CMake's pkg_check_modules
#      builds the same demo.cc against DIR and runs it.
#   4. Every installed header compiles cleanly under -Wall -Wextra -Werror.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd -P)
root=$(cd "$here/../.." && pwd -P)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say() { printf '[consumer] %s\n' "$*" >&2; }

# CMake and pkg-config build the non-Bazel consumer (Debian: cmake, pkg-config).
if ! command -v cmake >/dev/null || ! command -v pkg-config >/dev/null; then
  say "installing cmake and pkg-config"
  sudo=(); [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake pkg-config >/dev/null ||
    { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake pkg-config >/dev/null; }
fi

cd "$here"
say "1. bazel build //:demo in a workspace of its own (WORKSPACE: local_repository + refit_dependencies())"
bazel build //:demo
bazel-bin/demo

say "2. --config=cuda from this workspace: refit's GPU engines built and registered"
# The generated @refit_local_cuda names @refit's own config_setting (a Label), so
# the GPU engines build from outside refit's tree; no GPU is needed to build them.
bazel build --config=cuda //:demo
bazel-bin/demo | tee "$tmp/cuda_demo.txt"
for engine in nccl cuda_ipc; do
  grep -q "^backends:.* $engine" "$tmp/cuda_demo.txt" || { say "--config=cuda: engine $engine not registered"; exit 1; }
done
bazel shutdown

say "3. ./refit install --prefix DIR, then CMake (pkg_check_modules) builds demo.cc against it"
cd "$root"
./refit install --prefix "$tmp/prefix"
cmake -S "$here" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/build" -j 2 >/dev/null
"$tmp/build/demo"

say "4. every installed header under -Wall -Wextra -Werror"
( cd "$tmp/prefix/include" && find refit -name '*.h' | sort | sed 's|.*|#include <&>|' ) > "$tmp/all_headers.cc"
echo 'int main() {}' >> "$tmp/all_headers.cc"
flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags refit)
# shellcheck disable=SC2086
g++ $flags -Wall -Wextra -Werror -fsyntax-only "$tmp/all_headers.cc"
say "   $(grep -c include "$tmp/all_headers.cc") headers clean"
say "all consumer checks passed"
