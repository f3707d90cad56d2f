# Helpers for scripts that emulate a home cluster on one machine: each process in its own
# memory cgroup (v1; file-backed mmap pages are charged to it, so the limit bounds how much
# of a model stays cached) and blkio read throttle (its own "disk" of DISK_MBPS).
# Sourced by scripts/memory-experiment.sh and scripts/journey.sh; they set
#   CG         the parent cgroup's name
#   DISK_MBPS  read throttle per process in MB/s (0 = none)
#   DISK_DEV   the throttled disk's major:minor (`dev_of FILE`)
# and call `trap 'cleanup; remove_groups' EXIT`. Needs root and cgroup v1.

# The disk holding the model, for the blkio throttle (the whole disk, not a partition).
dev_of() {
  local src; src=$(df --output=source "$1" | tail -1)
  local name; name=$(lsblk -no pkname "$src" 2>/dev/null | head -1)
  [ -n "$name" ] || name=$(basename "$src")
  cat "/sys/class/block/$name/dev"
}

pids=()
cleanup() {
  for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  pids=()
}
remove_groups() {
  for c in memory blkio; do
    for d in /sys/fs/cgroup/$c/$CG/*/; do [ -d "$d" ] && rmdir "$d" 2>/dev/null || true; done
    rmdir "/sys/fs/cgroup/$c/$CG" 2>/dev/null || true
  done
}

# make_group NAME LIMIT_MIB: a memory (and blkio) cgroup for one process.
make_group() {
  local m=/sys/fs/cgroup/memory/$CG/$1 b=/sys/fs/cgroup/blkio/$CG/$1
  mkdir -p "$m" "$b"
  # Empty it of pages from a previous run before lowering the limit.
  echo 0 > "$m/memory.force_empty" 2>/dev/null || true
  echo $(( $2 * 1024 * 1024 )) > "$m/memory.limit_in_bytes"
  if [ "$DISK_MBPS" != 0 ]; then
    echo "$DISK_DEV $(( DISK_MBPS * 1000 * 1000 ))" > "$b/blkio.throttle.read_bps_device"
  else
    echo "$DISK_DEV 0" > "$b/blkio.throttle.read_bps_device" 2>/dev/null || true
  fi
}

# start NAME LOG CMD...: runs CMD inside cgroup NAME, in the background.
start() {
  local name=$1 log=$2; shift 2
  sh -c 'echo $$ > /sys/fs/cgroup/memory/'"$CG/$name"'/cgroup.procs; echo $$ > /sys/fs/cgroup/blkio/'"$CG/$name"'/cgroup.procs; exec "$@"' hearth "$@" >"$log" 2>&1 &
  pids+=($!)
}

wait_for() { # wait_for SECONDS CMD...
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

