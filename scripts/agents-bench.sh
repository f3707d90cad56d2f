#!/usr/bin/env bash
# The prompt cache on an agent workload (docs/benchmarks.md, "An agent's long context"):
# AGENTS coding agents at once on SLOTS slots, each a TURNS-turn conversation with its own
# system prompt of about SYSTEM tokens of real text and tools (scripts/load.py agents),
# three runs side by side on the same machine:
#   none     --prompt-cache-ram 0 --prompt-cache-size 0: slot reuse and copies across slots
#            only (hearth before the prompt cache)
#   cache    the defaults, on a fresh --prompt-cache-dir
#   restart  the same conversations again after the server (and with RING=1 its workers)
#            was stopped and started again on that directory
# It prints each turn's median time to the first answer chunk per run, then turn 1 and the
# mean over turns 2 on with their ratios to `none`, and the disk the cache used.
#
#   scripts/agents-bench.sh
#
# Settings (environment): MODEL (default: the default model), SYSTEM (2300 "tokens" at
# load.py's 4.2 characters a token; the paper's text makes ~3,200 of the default model's,
# and 20 turns of ~170 tokens and an answer each bring a conversation to ~7,800 of its
# 8,192-token context), AGENTS (4), TURNS (20), SLOTS
# (2), TOKENS (24 per answer), CTX (8192), THREADS (2; 1 per process with RING), RING (1: a
# head and two workers on this machine, WINDOWS 10,10,10), HEARTH (the release binary).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth}"
MODEL="${MODEL:-$(scripts/fetch-model.sh)}"
SYSTEM="${SYSTEM:-2300}"
AGENTS="${AGENTS:-4}"
TURNS="${TURNS:-20}"
SLOTS="${SLOTS:-2}"
TOKENS="${TOKENS:-24}"
CTX="${CTX:-8192}"
RING="${RING:-0}"
WINDOWS="${WINDOWS:-10,10,10}"
if [ "$RING" = 1 ]; then THREADS="${THREADS:-1}"; else THREADS="${THREADS:-2}"; fi
PORT=18180
W1=127.0.0.1:19181
W2=127.0.0.1:19182
export HEARTH_NO_DISCOVERY=true
work="$(mktemp -d)"
cache="$work/prompt-cache"
pids=()

up() {
  for _ in $(seq 1 600); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "agents-bench: no '$2' in $1" >&2
  tail -20 "$1" >&2
  exit 1
}

start() {
  local name=$1
  shift
  if [ "$RING" = 1 ]; then
    for w in "$W1" "$W2"; do
      # Each member keeps its own windows' rows of the blocks, in its own directory.
      local blocks=(--prompt-cache-ram 0 --prompt-cache-size 0)
      [ "$name" = none ] || blocks=(--prompt-cache-dir "$cache/worker-${w##*:}")
      "$HEARTH" worker --listen "$w" --threads "$THREADS" --model "$MODEL" "${blocks[@]}" >"$work/$name-worker-${w##*:}.log" 2>&1 &
      pids+=($!)
      up "$work/$name-worker-${w##*:}.log" "worker listening on "
    done
    set -- "$@" --workers "$W1,$W2" --windows "$WINDOWS"
  fi
  "$HEARTH" serve --port "$PORT" --threads "$THREADS" --parallel "$SLOTS" --ctx-size "$CTX" --model "$MODEL" "$@" >"$work/$name.log" 2>&1 &
  pids+=($!)
  up "$work/$name.log" "listening on http://"
}

stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT

run() {
  python3 scripts/load.py "http://127.0.0.1:$PORT" agents "$SYSTEM" --agents "$AGENTS" --turns "$TURNS" --max-tokens "$TOKENS" >"$work/$1.txt"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^hearth_prompt_(cache|copied|cached)' | sed "s/^/$1: /" >"$work/$1.metrics" || true
}

echo "agents-bench: $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $AGENTS agents x $TURNS turns on $SLOTS slots, system prompts of ~$SYSTEM tokens, ring=$RING" >&2
start none --prompt-cache-ram 0 --prompt-cache-size 0
run none
stop
start cache --prompt-cache-dir "$cache/head"
run cache
stop
start restart --prompt-cache-dir "$cache/head"
run restart
stop

printf '%-5s %10s %10s %10s   %s\n' turn none_s cache_s restart_s "cached tokens (none/cache/restart)"
paste -d' ' "$work/none.txt" "$work/cache.txt" "$work/restart.txt" | awk '{printf "%-5s %10s %10s %10s   %s/%s/%s\n", $1, $2, $6, $10, $4, $8, $12}'
awk 'NR==FNR && $1==1 {n1=$2} NR==FNR && $1=="all" {na=$2} FNR==1 && NR!=FNR {f++} NR!=FNR && $1==1 {t1[f]=$2} NR!=FNR && $1=="all" {ta[f]=$2}
  END {printf "turn 1: cache %.3fx, after restart %.3fx of none; turns 2-: cache %.3fx, after restart %.3fx of none\n", t1[1]/n1, t1[2]/n1, ta[1]/na, ta[2]/na}' \
  "$work/none.txt" "$work/cache.txt" "$work/restart.txt"
echo "disk: $(du -sh "$cache" | cut -f1) in $(find "$cache" -type f | wc -l) block files (every member's)"
cat "$work/cache.metrics" "$work/restart.metrics"
rm -rf "$work"
