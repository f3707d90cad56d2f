#!/usr/bin/env bash
# Soak: 64 concurrent clients for 10 minutes (streaming, long prompts of real text,
# cancellations, JSON-schema grammars, stop strings, n = 2) against the single node and
# against head + 2 workers; RSS start/peak/end, answers by status, 429s with Retry-After,
# every slot free at the end. Results: docs/benchmarks.md.
#
#   scripts/soak.sh [SECONDS] [CLIENTS] [single|ring|both]
#
# Needs a release build (cargo build --release --workspace) and the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_RUN="${1:-600}"
CLIENTS="${2:-64}"
WHICH="${3:-both}"
source scripts/roles.sh

# A small queue, so the load also exercises 429 + Retry-After.
SERVE=(--port 0 --parallel 4 --queue-size 16 --ctx-size 4096)
status=0
if [ "$WHICH" != ring ]; then
  start serve "${SERVE[@]}" --threads 2
  scripts/soak.py --url "http://$ADDR" --pids "${PIDS[-1]}" --clients "$CLIENTS" --seconds "$SECONDS_RUN" --label "single node" || status=1
  cleanup
fi
if [ "$WHICH" != single ]; then
  start worker --listen 127.0.0.1:0 --threads 1; w1="$ADDR"; p1="${PIDS[-1]}"
  start worker --listen 127.0.0.1:0 --threads 1; w2="$ADDR"; p2="${PIDS[-1]}"
  start serve "${SERVE[@]}" --threads 1 --workers "$w1,$w2" --windows 8,11,11
  scripts/soak.py --url "http://$ADDR" --pids "${PIDS[-1]},$p1,$p2" --clients "$CLIENTS" --seconds "$SECONDS_RUN" --label "head + 2 workers (8,11,11)" || status=1
fi
exit $status
