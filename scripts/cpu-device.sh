#!/usr/bin/env bash
# Runs a command as an emulated device of its own: in a cpu cgroup (v1) with a CPU quota,
# so the processes of a ring on one machine each get a device's worth of CPU, as they would
# on separate machines, instead of sharing every core. Needs root and the cgroup v1 cpu
# controller at /sys/fs/cgroup/cpu (this project's CI machine kind has it).
#
#   scripts/cpu-device.sh NAME CORES COMMAND [ARGS...]
#
# NAME names the cgroup (hearth-device-NAME, made if missing, reused if present); CORES is
# the quota in cores, fractional allowed (0.6 = 6 ms of CPU time every 10 ms). The command
# replaces this shell, so its PID is the one the caller started. `scripts/cpu-device.sh
# --remove NAME` removes the cgroup once nothing runs in it.
set -euo pipefail
ROOT=/sys/fs/cgroup/cpu
# The period of the quota: short, so a device is as fast as its quota at the scale of one
# step. With CFS's default 100 ms a member that computes 10 ms and then waits for the others
# never reaches its quota and runs at a whole core's speed: a ring taking one micro-batch
# at a time would look faster than on real devices of that speed, and pipelining (which
# keeps every member busy) slower than it is.
# CPU_PERIOD_US overrides it: on a fast machine, where a member's step takes a few
# milliseconds, a 10 ms period stalls a member for 4 ms at a time (0.6 core) in the middle
# of a pipeline, which no real device of that speed does.
PERIOD_US="${CPU_PERIOD_US:-10000}"
if [ "${1:-}" = --remove ]; then
  rmdir "$ROOT/hearth-device-$2" 2>/dev/null || true
  exit 0
fi
[ $# -ge 3 ] || { echo "usage: $0 NAME CORES COMMAND [ARGS...]" >&2; exit 2; }
name="$1" cores="$2"
shift 2
[ -w "$ROOT" ] || { echo "$0: $ROOT is not writable (needs root and cgroup v1's cpu controller)" >&2; exit 1; }
cg="$ROOT/hearth-device-$name"
mkdir -p "$cg"
quota="$(python3 -c "import sys; print(max(1000, int(float(sys.argv[1]) * $PERIOD_US)))" "$cores")"
echo "$PERIOD_US" > "$cg/cpu.cfs_period_us"
echo "$quota" > "$cg/cpu.cfs_quota_us"
echo $$ > "$cg/cgroup.procs"
exec "$@"
