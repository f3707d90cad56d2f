#!/usr/bin/env bash
# TPOT of the ring on one machine (loopback): a single node against head + 2 workers,
# for thread counts, window shapes and OpenMP spin settings. Results: docs/benchmarks.md.
#
#   scripts/ring-bench.sh [MAX_TOKENS] [REPS]
#
# Needs a release build (cargo build --release --workspace) and the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOKENS="${1:-128}"
REPS="${2:-3}"
source scripts/roles.sh

# label, threads per process, windows (or "single"), GOMP_SPINCOUNT ("" for hearth's own)
run() {
  local label="$1" threads="$2" windows="$3" head
  SPIN="$4"
  if [ "$windows" = single ]; then
    start serve --port 0 --threads "$threads"
  else
    local w1 w2
    start worker --listen 127.0.0.1:0 --threads "$threads"; w1="$ADDR"
    start worker --listen 127.0.0.1:0 --threads "$threads"; w2="$ADDR"
    start serve --port 0 --threads "$threads" --workers "$w1,$w2" --windows "$windows"
  fi
  head="$ADDR"
  read -r best median _ _ < <(scripts/tpot.py "http://$head" --max-tokens "$TOKENS" --reps "$REPS")
  local hop="-"
  if [ "$windows" != single ]; then
    # Per hop: the head's time for frames to come round, less the workers' compute, over
    # the 3 hops of a round (head -> w1 -> w2 -> head).
    hop="$( { curl -s "http://$head/metrics"; for w in "$w1" "$w2"; do echo "PROFILE $("$HEARTH" worker-profile --worker "$w" | tr -d '\n')"; done; } | python3 -c '
import json, sys
rt = n = compute = 0.0
for line in sys.stdin:
    if line.startswith("hearth_ring_round_trip_seconds_sum"): rt = float(line.split()[1])
    elif line.startswith("hearth_ring_round_trip_seconds_count"): n = float(line.split()[1])
    elif line.startswith("PROFILE "): compute += sum(w["compute_s"] for w in json.loads(line[8:])["windows"])
print(f"{(rt - compute) / n / 3 * 1e6:.0f}" if n else "-")')"
  fi
  printf '%-48s %9.2f %9.2f %9s\n' "$label" "$(echo "$best*1000" | bc -l)" "$(echo "$median*1000" | bc -l)" "$hop"
  cleanup
}

printf '%-48s %9s %9s %9s\n' "setup (greedy $TOKENS tokens, $REPS runs)" "best ms" "median ms" "µs/hop"
run "single node, 1 thread" 1 single ""
run "single node, 2 threads" 2 single ""
run "ring 10,10,10 (k=1), 1 thread each" 1 10,10,10 ""
run "ring 10,10,10 (k=1), 2 threads each" 2 10,10,10 ""
run "ring 4,3,3 (k=3), 2 threads each" 2 4,3,3 ""
run "ring 10,10,10, 2 threads, libgomp's default spin" 2 10,10,10 300000
