#!/usr/bin/env bash
# Builds the libFuzzer targets with clang 14 (--config=fuzz, which is --config=asan:
# in the output base ./refit check's ASan run uses, they are already built) and
# fuzzes each one for a bounded time from a copy of its seed corpus (the
# repository is not modified). Prints one summary line; exits non-zero if the
# build fails or any target crashes, leaving the reproducer and log in the work dir.
#
#   tests/fuzz/run.sh                      20000 runs per target, at most 60 s each
#   FUZZ_RUNS=-1 FUZZ_MAX_TIME=600 tests/fuzz/run.sh     a longer session
#   tests/fuzz/run.sh frame_fuzz           one target
#   FUZZ_KEEP=1 tests/fuzz/run.sh          keep the grown corpora (work dir printed)
#
# A crash found here becomes a regression test by copying its reproducer into
# tests/fuzz/corpus/<target>/ (as bad-<what>.bin or ok-<what>.bin once fixed): the
# default build replays every corpus file in `bazel test //...`.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."

runs=${FUZZ_RUNS:-20000}
max_time=${FUZZ_MAX_TIME:-60}
output_base=${FUZZ_OUTPUT_BASE:-/tmp/bzl-fuzz}
jobs=${FUZZ_JOBS:-2}
if [ $# -gt 0 ]; then targets=("$@"); else targets=(info_fuzz frame_fuzz wire_fuzz layout_fuzz delta_fuzz); fi

bazel_fuzz() { bazel --output_base="$output_base" "$1" --config=fuzz --symlink_prefix=/ "${@:2}"; }

start=$(date +%s)
labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:$t"); done
if ! bazel_fuzz build --jobs="$jobs" "${labels[@]}"; then
  echo "fuzz: FAILED to build ${targets[*]} with --config=fuzz"
  exit 2
fi
bin="$(bazel_fuzz info bazel-bin 2>/dev/null)/tests/fuzz"
built=$(date +%s)

work=$(mktemp -d /tmp/refit-fuzz.XXXXXX)
summary=()
failed=0
for t in "${targets[@]}"; do
  cp -r "tests/fuzz/corpus/$t" "$work/corpus-$t"
  chmod -R u+w "$work/corpus-$t"
  log="$work/$t.log"
  rc=0
  # -timeout: one input taking 10 s is a hang, reported like a crash.
  ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$bin/$t" -runs="$runs" -max_total_time="$max_time" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/$t-" -print_final_stats=1 "$work/corpus-$t" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1 || true)
  cov=$(grep -a -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  if [ "$rc" -ne 0 ]; then
    failed=1
    artifact=$(ls "$work/$t-"* 2>/dev/null | head -1 || true)
    summary+=("$t CRASHED (rc $rc, ${artifact:-no reproducer}, log $log)")
    grep -a -m3 -E 'ERROR: |BUG in|runtime error' "$log" >&2 || tail -20 "$log" >&2
  else
    summary+=("$t ok (${execs:-?} runs, coverage ${cov:-?})")
  fi
done
end=$(date +%s)

joined=$(printf '%s, ' "${summary[@]}")
joined=${joined%, }
times="build $((built - start))s, fuzz $((end - built))s, total $((end - start))s"
if [ "$failed" -ne 0 ]; then
  echo "fuzz: FAILED: $joined; $times; reproducers and logs in $work"
  exit 1
fi
if [ -n "${FUZZ_KEEP:-}" ]; then
  echo "fuzz: $joined; $times; grown corpora in $work"
else
  rm -rf "$work"
  echo "fuzz: $joined; $times"
fi
