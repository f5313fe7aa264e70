#!/usr/bin/env bash
# Every C++ file refit tracks is formatted by .clang-format (clang-format 14, Debian's
# clang-format package): clang-format --dry-run -Werror on each; the first findings
# are printed. Fix with: clang-format -i FILE...
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v clang-format >/dev/null || {
  env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-format >/dev/null 2>&1 || true
}
command -v clang-format >/dev/null || { echo "check_format: no clang-format (apt-get install clang-format)"; exit 1; }
files=$(git ls-files '*.cc' '*.h' '*.cu' | grep -v '^third_party/')
bad=0
for f in $files; do
  if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
    [ "$bad" -lt 10 ] && clang-format --dry-run -Werror "$f" 2>&1 | head -n 4
    bad=$((bad + 1))
  fi
done
n=$(echo "$files" | wc -l)
if [ "$bad" -ne 0 ]; then
  echo "check_format: $bad of $n C++ files are not formatted (clang-format -i FILE)"
  exit 1
fi
echo "check_format: $n C++ files formatted ($(clang-format --version | head -n 1))"
