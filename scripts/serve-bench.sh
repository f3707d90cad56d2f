#!/usr/bin/env bash
# The single node against upstream llama-server (docs/benchmarks.md, "The single node
# against llama-server"): the same GGUF, THREADS threads, STREAMS slots each, run in
# alternating order round after round, measured with scripts/load.py through each one's
# OpenAI API:
#   TPOT of one greedy stream, and the aggregate tokens/s of STREAMS concurrent streams
# (end-of-text suppressed so every stream runs its TOKENS tokens). Right after each
# server's one-stream TPOT, llama.cpp's bare decode loop (no server, `hearth bench`) runs
# on a prompt of the streams' length: the TPOT over that bare loop is what the server costs
# per token (this host's speed drifts by 10-20% within a minute, so each measurement gets
# its own yardstick, seconds apart). Then `hearth bench` decodes 8 sequences together in
# both bare engines.
#
#   scripts/serve-bench.sh
#
# Settings (environment): MODEL (default: the default model), THREADS (2), STREAMS (8),
# TOKENS (128), ROUNDS (3), SUPPRESS (token ids never sampled; default the default
# model's end-of-text and end-of-turn, 0,2), HEARTH (the release binary), SERVER_CPUS and
# CLIENT_CPUS (taskset CPU lists: the servers and the bare loop on the one, load.py on the
# other, as a client on another device would be; e.g. THREADS=1 SERVER_CPUS=0 CLIENT_CPUS=1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth-lab}"
MODEL="${MODEL:-$(scripts/fetch-model.sh)}"
THREADS="${THREADS:-2}"
STREAMS="${STREAMS:-8}"
TOKENS="${TOKENS:-128}"
ROUNDS="${ROUNDS:-3}"
SUPPRESS="${SUPPRESS:-0,2}"
SERVER_PIN=()
CLIENT_PIN=()
if [ -n "${SERVER_CPUS:-}" ]; then SERVER_PIN=(taskset -c "$SERVER_CPUS"); fi
if [ -n "${CLIENT_CPUS:-}" ]; then CLIENT_PIN=(taskset -c "$CLIENT_CPUS"); fi
# Per slot: load.py's passages (~75 tokens) and their answers, with room to spare.
CTX=1024
BIN="$(scripts/llama-upstream.sh)"
LOGS="$(mktemp -d)"
PID=""
cleanup() {
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
  PID=""
}
trap 'cleanup' EXIT

wait_http() {
  for _ in $(seq 1 1200); do
    if curl -sf "http://$1/health" >/dev/null 2>&1; then return; fi
    sleep 0.25
  done
  echo "$0: $1 never became healthy" >&2; tail -20 "$2" >&2; exit 1
}

start() {
  case "$1" in
    hearth)
      "${SERVER_PIN[@]}" "$HEARTH" serve --model "$MODEL" --port 18320 --threads "$THREADS" --parallel "$STREAMS" --ctx-size "$CTX" >"$LOGS/hearth.log" 2>&1 &
      PID=$!; ADDR=127.0.0.1:18320 ;;
    llama-server)
      # Its defaults otherwise (flash attention on the CPU, a stream of the cache per slot).
      "${SERVER_PIN[@]}" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port 18321 -t "$THREADS" -tb "$THREADS" -np "$STREAMS" \
        -c $(( CTX * STREAMS )) --no-warmup >"$LOGS/llama-server.log" 2>&1 &
      PID=$!; ADDR=127.0.0.1:18321 ;;
  esac
  wait_http "$ADDR" "$LOGS/$1.log"
}

declare -A TPOTS AGGS BARES
bare_loop() {
  "${SERVER_PIN[@]}" "$HEARTH" bench --model "$MODEL" --threads "$THREADS" --prompt-tokens 80 --gen-tokens "$TOKENS" --reps 1 --sequences 0 >"$LOGS/bare.txt"
  python3 -c "import sys; print(next(l for l in open(sys.argv[1]) if l.startswith('| decode (tg')).split('|')[2].strip())" "$LOGS/bare.txt"
}
printf '%-6s %-13s %10s %16s %16s\n' round server "TPOT ms" "${STREAMS} streams t/s" "bare loop ms"
for r in $(seq 1 "$ROUNDS"); do
  order=(hearth llama-server)
  if [ $(( r % 2 )) -eq 0 ]; then order=(llama-server hearth); fi
  for s in "${order[@]}"; do
    start "$s"
    tpot="$("${CLIENT_PIN[@]}" scripts/load.py "http://$ADDR" tpot --max-tokens "$TOKENS" --reps 3 --suppress "$SUPPRESS")"
    # (The server idles meanwhile: its threads sleep.)
    bare="$(bare_loop)"
    agg="$("${CLIENT_PIN[@]}" scripts/load.py "http://$ADDR" streams "$STREAMS" --max-tokens "$TOKENS" --reps 1 --suppress "$SUPPRESS")"
    cleanup
    TPOTS[$s]="${TPOTS[$s]:-} $tpot"
    AGGS[$s]="${AGGS[$s]:-} $agg"
    BARES[$s]="${BARES[$s]:-} $bare"
    printf '%-6s %-13s %10.2f %16.1f %16.2f\n' "$r" "$s" "$(python3 -c "print($tpot * 1000)")" "$agg" "$(python3 -c "print(1000 / $bare)")"
  done
done
# llama.cpp's (and hearth's engine's) bare decode loop on a prompt like the streams'.
"${SERVER_PIN[@]}" "$HEARTH" bench --model "$MODEL" --threads "$THREADS" --prompt-tokens 80 --gen-tokens "$TOKENS" --reps "$ROUNDS" --sequences "$STREAMS" | tee "$LOGS/bench.txt"
python3 - "${TPOTS[hearth]}" "${TPOTS[llama-server]}" "${AGGS[hearth]}" "${AGGS[llama-server]}" "${BARES[hearth]}" "${BARES[llama-server]}" <<'EOF'
import statistics, sys
ht, lt, ha, la, hb, lb = sys.argv[1:]
rounds = lambda s: [float(x) for x in s.split()]
# Through the API against the bare loop run right after it (tokens/s), the median of the rounds.
api_ratio = lambda tpots, bares: statistics.median(1 / (t * b) for t, b in zip(rounds(tpots), rounds(bares)))
hr, lr = api_ratio(ht, hb), api_ratio(lt, lb)
med = lambda s: statistics.median(rounds(s))
ht, lt, ha, la, bare = med(ht), med(lt), med(ha), med(la), statistics.median(rounds(hb) + rounds(lb))
print()
print(f"medians over the rounds: TPOT hearth {ht*1e3:.2f} ms, llama-server {lt*1e3:.2f} ms; "
      f"streams hearth {ha:.1f} t/s, llama-server {la:.1f} t/s")
print(f"hearth vs llama-server: one stream's TPOT {ht/lt:.3f}x (lower is better), "
      f"aggregate tokens/s of the streams {ha/la:.3f}x")
print(f"one stream through the API vs llama.cpp's bare decode loop run right after it (median {1e3/bare:.2f} ms/token): "
      f"hearth {hr:.3f}x, llama-server {lr:.3f}x of its speed (median of the rounds)")
EOF
