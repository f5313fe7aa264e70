#!/usr/bin/env bash
# Every command the ./refit wrapper lists answers --help and -h with its usage on
# stdout and exit 0, without building or installing anything; an unknown command
# still fails (exit 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
status=0
cmds=$(./refit help | sed -n 's/^  \.\/refit \([a-z]*\) .*/\1/p' | grep -v '^CMD$' | sort -u)
[ -n "$cmds" ] || { echo "check_refit_help: ./refit help lists no commands"; exit 1; }
n=0
for c in $cmds; do
  for flag in --help -h; do
    out=$(timeout 20 ./refit "$c" "$flag" 2>&1)
    rc=$?
    if [ $rc -ne 0 ] || ! grep -q "usage: ./refit $c" <<<"$out"; then
      echo "check_refit_help: ./refit $c $flag exited $rc without its usage: ${out:0:200}"
      status=1
    fi
    n=$((n + 1))
  done
done
if ./refit no-such-command >/dev/null 2>&1; then
  echo "check_refit_help: ./refit no-such-command exited 0"
  status=1
fi
[ $status = 0 ] && echo "check_refit_help: $n help calls answered (commands: $(echo $cmds))"
exit $status
