#!/usr/bin/env bash
# .ci/prune_caches.sh: frees disk space that no later build can use, before CI
# builds. A CI run on this machine stopped at "No space left on device" after
# the caches of earlier clones had filled the disk (2026-12-06).
#
# - Bazel output bases (~/.cache/bazel/_bazel_root/*) of workspaces that no
#   longer exist: each clone of the repository gets one (1-2 GB), and a deleted
#   clone never uses its base again.
# - ./refit check's output bases (~/.cache/refit-check-<hash>-<config>, 1-3 GB
#   each): one set per checkout path. A set whose checkout is gone (recorded in
#   its CHECKOUT file), or that records none and was last built over 2 days ago.
# - The shared disk cache (~/.cache/refit/bazel-disk): while the disk has less
#   than $REFIT_CI_MIN_FREE_GB (default 15) free, its oldest files, by
#   modification time, are deleted until the cache is at 70% of its size. A
#   file deleted is a cache miss later, never a wrong result.
# Prints what it freed. Never fails the run: a cache it cannot prune stays.
set -u
cache=${XDG_CACHE_HOME:-$HOME/.cache}
freed=0
drop() {  # drop DIR WHY
  local kb
  kb=$(du -sk "$1" 2>/dev/null | cut -f1)
  chmod -R u+w "$1" 2>/dev/null
  if rm -rf "$1" 2>/dev/null; then
    freed=$((freed + ${kb:-0}))
    echo "prune_caches: removed $1 (${kb:-0} KiB; $2)"
  fi
}

for base in "$cache"/bazel/_bazel_root/*/; do
  marker="$base/DO_NOT_BUILD_HERE"
  [ -f "$marker" ] || continue
  workspace=$(cat "$marker" 2>/dev/null)
  [ -n "$workspace" ] && [ ! -d "$workspace" ] && drop "${base%/}" "its workspace $workspace is gone"
done

for base in "$cache"/refit-check-*; do
  [ -d "$base" ] || continue
  if [ -f "$base/CHECKOUT" ]; then
    checkout=$(cat "$base/CHECKOUT" 2>/dev/null)
    [ -n "$checkout" ] && [ ! -d "$checkout" ] && drop "$base" "its checkout $checkout is gone"
  elif [ -n "$(find "$base" -maxdepth 0 -mtime +2 2>/dev/null)" ]; then
    drop "$base" "no CHECKOUT recorded and unused for 2 days"
  fi
done

disk=$cache/refit/bazel-disk
min_free_kb=$((${REFIT_CI_MIN_FREE_GB:-15} * 1024 * 1024))
free_kb=$(df -Pk "$cache" 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ -d "$disk" ] && [ -n "$free_kb" ] && [ "$free_kb" -lt "$min_free_kb" ]; then
  size_kb=$(du -sk "$disk" | cut -f1)
  target_kb=$((size_kb * 7 / 10))
  echo "prune_caches: $((free_kb / 1024)) MiB free; trimming $disk from $((size_kb / 1024)) MiB to $((target_kb / 1024)) MiB"
  find "$disk" -type f -printf '%T@ %k %p\n' 2>/dev/null | sort -n |
    awk -v excess=$((size_kb - target_kb)) '{ if (done >= excess) exit; done += $2; print substr($0, index($0, $3)) }' |
    while IFS= read -r f; do rm -f -- "$f"; done
  freed=$((freed + size_kb - $(du -sk "$disk" | cut -f1)))
fi
# A fresh machine has no cache folder yet: the free space of the nearest folder that exists.
where=$cache
while [ ! -d "$where" ] && [ "$where" != / ]; do where=$(dirname "$where"); done
echo "prune_caches: freed $((freed / 1024)) MiB; $(($(df -Pk "$where" | awk 'NR == 2 {print $4}') / 1024)) MiB free"
exit 0
