#!/usr/bin/env bash
# A worker that cannot start says why in one line and exits non-zero (no abort, no
# core): too few descriptors for its event loop, a listen address that is not one.
set -u
bin=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
check() {  # DESCRIPTION EXPECTED-TEXT COMMAND...
  local what=$1 want=$2
  shift 2
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  [ $rc -eq 1 ] || fail "$what: exit status $rc, expected 1 (134 is an abort): $err"
  [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] || fail "$what: not one line: $err"
  case "$err" in *"$want"*) ;; *) fail "$what: '$err' does not say '$want'" ;; esac
  echo "ok: $what: $err"
}
check "--listen not-an-ip" "not an IP address" "$bin" --role worker --listen not-an-ip
if [ -n "${ASAN_OPTIONS:-}${TSAN_OPTIONS:-}" ]; then
  # The sanitizer runtimes themselves break with 4 descriptors (UBSan reports a bad
  # vptr inside asio while unwinding); the plain build checks this case.
  echo "skipped: ulimit -n 4 under a sanitizer (its runtime needs descriptors of its own)"
else
  check "ulimit -n 4" "Too many open files" bash -c 'ulimit -n 4; exec "$0" --role worker' "$bin"
fi
echo PASS
