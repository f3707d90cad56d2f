#!/usr/bin/env bash
# Runs a command (by default the test suite, scripts/test.sh) on a host made unlike this
# one, to find tests that pass only at this host's speed (docs/robustness.md):
#
#   scripts/host-conditions.sh slow [COMMAND...]   the command and everything it starts in a
#                                                  cgroup (v1) with a CPU quota of half a core
#                                                  (HEARTH_CPU_QUOTA: cores, e.g. 0.5)
#   scripts/host-conditions.sh hog  [COMMAND...]   beside one busy loop per core minus one, at
#                                                  normal priority (another program's work)
#   scripts/host-conditions.sh fast [COMMAND...]   as it is (the baseline, for the same log)
#
# Needs root for the cgroup. The test binaries must be built first (a build under a half-
# core quota takes hours): `cargo test --release --workspace --no-run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=${1:?usage: scripts/host-conditions.sh slow|hog|fast [COMMAND...]}
shift
[ $# -gt 0 ] || set -- scripts/test.sh
case "$mode" in
  slow)
    quota=${HEARTH_CPU_QUOTA:-0.5}
    group=/sys/fs/cgroup/cpu/hearth-slow-$$
    mkdir "$group"
    trap 'cat "$group/tasks" 2>/dev/null | xargs -r kill 2>/dev/null; sleep 1; rmdir "$group" 2>/dev/null || true' EXIT
    period=100000
    echo "$period" >"$group/cpu.cfs_period_us"
    awk -v q="$quota" -v p="$period" 'BEGIN { printf "%d\n", q * p }' >"$group/cpu.cfs_quota_us"
    echo "host-conditions: $* in $group, $quota core(s)" >&2
    # The child joins the group before it runs the command: all it starts stays inside.
    status=0
    bash -c 'echo $$ > "$1/tasks"; shift; exec "$@"' _ "$group" "$@" || status=$?
    exit "$status"
    ;;
  hog)
    hogs=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
    pids=()
    for _ in $(seq "$hogs"); do
      bash -c 'while :; do :; done' &
      pids+=($!)
    done
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
    echo "host-conditions: $* beside $hogs busy loop(s)" >&2
    status=0
    "$@" || status=$?
    exit "$status"
    ;;
  fast)
    exec "$@"
    ;;
  *)
    echo "usage: scripts/host-conditions.sh slow|hog|fast [COMMAND...]" >&2
    exit 2
    ;;
esac
