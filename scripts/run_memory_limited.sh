#!/usr/bin/env bash
# Run a command under a hard memory limit (a cgroup), for the files-larger-than-RAM mode:
#   scripts/run_memory_limited.sh BYTES command args...
# e.g. a third of the model file:
#   scripts/run_memory_limited.sh $(( $(stat -c %s f.gguf) / 3 )) \
#       .venv/bin/ds4-bench -m f.gguf --paging lowmem --ctx-start 32 --ctx-max 32 --gen-tokens 8
# Drops the page cache first (root only), so pages already cached by others are not free rides
# (EVICT_ONLY=FILE: only that file's pages, e.g. the model, leaving other files cached),
# and prints the cgroup's peak usage and the limit afterwards. Needs root and a memory cgroup
# (v1 at /sys/fs/cgroup/memory or v2 at /sys/fs/cgroup); exits 2 without one.
set -u
limit=${1:?usage: run_memory_limited.sh BYTES command...}; shift
name=ds4-limit-$$
if [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/$name; mkdir "$cg" || exit 2
  echo "$limit" > "$cg/memory.limit_in_bytes"; peak=memory.max_usage_in_bytes
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  cg=/sys/fs/cgroup/$name; mkdir "$cg" || exit 2
  echo "$limit" > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null; peak=memory.peak
else
  echo "no memory cgroup here" >&2; exit 2
fi
sync
if [ -n "${EVICT_ONLY:-}" ]; then
  # only this file's cached pages go (others' cached files stay: a benchmark running beside this
  # one keeps its page cache); GNU dd: nocache with count=0 advises the whole file out
  dd if="$EVICT_ONLY" iflag=nocache count=0 status=none || echo "note: could not evict $EVICT_ONLY" >&2
else
  echo 1 > /proc/sys/vm/drop_caches 2>/dev/null || echo "note: could not drop the page cache" >&2
fi
bash -c 'echo $$ > "$0/cgroup.procs" 2>/dev/null || echo $$ > "$0/tasks"; exec "$@"' "$cg" "$@"
rc=$?
echo "memory limit $limit B, peak usage $(cat "$cg/$peak" 2>/dev/null || echo '?') B" >&2
rmdir "$cg" 2>/dev/null
exit $rc
