#!/usr/bin/env bash
# Halda's prediction against the measured TPOT, on emulated clusters on one machine: a
# head and two workers on loopback with different thread counts and plans. For each
# scenario the head serves greedy streamed requests, then `GET /admin/plan` gives the
# measured TPOT (mean of the last 64 single-token decode steps) and the cost model's TPOT
# for the running plan at the context those steps had. Results: docs/benchmarks.md.
#
#   scripts/plan-accuracy.sh [MAX_TOKENS]
#
# Needs a release build (cargo build --release --workspace) and the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOKENS="${1:-96}"
KEY=plan-accuracy
source scripts/roles.sh

# label, head threads, worker threads, then the plan flags (--windows ... or --plan-strategy ...)
run() {
  local label="$1" head_threads="$2" worker_threads="$3" w1 w2
  shift 3
  start worker --listen 127.0.0.1:0 --threads "$worker_threads"; w1="$ADDR"
  start worker --listen 127.0.0.1:0 --threads "$worker_threads"; w2="$ADDR"
  start serve --port 0 --threads "$head_threads" --workers "$w1,$w2" --admin-key "$KEY" --replan-idle 0 "$@"
  scripts/tpot.py "http://$ADDR" --max-tokens "$TOKENS" --reps 2 >/dev/null
  curl -sf "http://$ADDR/admin/plan" -H "Authorization: Bearer $KEY" | LABEL="$label" python3 -c '
import json, os, sys
v = json.load(sys.stdin)
shape = ",".join(str(m["window"]) for m in v["members"])
pred, meas = v["predicted_tpot_ms_at_measured_context"], v["measured_tpot_ms"]
label, k, ctx = os.environ["LABEL"], v["rounds"], v["measured_context"]
hop = v.get("measured_hop_ms")
hop = f"{hop:.2f}" if hop is not None else "–"
print(f"| {label} | {shape} (k = {k}) | {ctx:.0f} | {hop} | {pred:.2f} | {meas:.2f} | {100 * (pred - meas) / meas:+.0f}% |")'
  cleanup
}

echo "| scenario | plan (windows, ring order) | context | hop ms | predicted ms | measured ms | error |"
echo "|---|---|---:|---:|---:|---:|---:|"
run "Halda, head 2 threads, workers 1 thread" 2 1 --plan-strategy halda
run "Halda, every process 1 thread" 1 1 --plan-strategy halda
run "even, every process 1 thread" 1 1 --plan-strategy even
run "even, every process 2 threads" 2 2 --plan-strategy even
run "windows 4,3,3, every process 1 thread" 1 1 --windows 4,3,3
run "windows 2,4,4, head 2 threads, workers 1 thread" 2 1 --windows 2,4,4
