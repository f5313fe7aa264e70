#!/usr/bin/env bash
# Runs examples/minimal: exit status 0 and its "ok" line.
set -u
out=$("$1" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: exit status $rc" >&2; exit 1; }
case "$out" in *"ok: both tensors arrived, version 1"*) echo PASS ;; *) echo "FAIL: no ok line" >&2; exit 1 ;; esac
