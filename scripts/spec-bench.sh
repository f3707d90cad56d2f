#!/usr/bin/env bash
# Speculative decoding through the ring (docs/benchmarks.md): head + 2 workers on loopback,
# each ring frame delayed like a home Wi-Fi hop (--emulate-hop-ms, default 5 ms), greedy
# TPOT with and without speculation (n-gram drafts; the default model as its own draft model)
# on a repetitive text and a fresh answer (greedy), and on a sampled answer (temperature 1,
# fixed seed: the same text either way) whose drafts mostly fail,
# with the tokens per ring traversal and the draft acceptance from the head's metrics.
#
#   scripts/spec-bench.sh [HOP_MS] [MAX_TOKENS]
#
# Needs a release build (cargo build --release --workspace) and the default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
HOP="${1:-5}"
TOKENS="${2:-96}"
source scripts/roles.sh

# A draft model whose drafts always fail, at a small model's cost: random weights, the
# default model's vocabulary (what the overhead of a failing draft model is).
FAILING="models/random-draft-2x256.gguf"
[ -f "$FAILING" ] || "$HEARTH" make-model --layers 2 --embd 256 --ff 512 --heads 4 --kv-heads 2 --type q8_0 --out "$FAILING" >&2

REPETITIVE='The cat sat on the mat.\nThe cat sat on the mat.\nThe cat sat on the mat.\nThe cat sat on the mat.\nThe cat sat on the mat.\nThe cat'
FRESH='Explain in detail how a bicycle works, part by part.'

# label, prompt, temperature, extra serve flags
run() {
  local label="$1" prompt="$2" temperature="$3" w1 w2
  shift 3
  start worker --listen 127.0.0.1:0 --threads 1 --emulate-hop-ms "$HOP"; w1="$ADDR"
  start worker --listen 127.0.0.1:0 --threads 1 --emulate-hop-ms "$HOP"; w2="$ADDR"
  start serve --port 0 --threads 1 --workers "$w1,$w2" --windows 10,10,10 --replan-idle 0 --emulate-hop-ms "$HOP" "$@"
  local best median
  read -r best median _ _ < <(scripts/tpot.py "http://$ADDR" --prompt "$prompt" --max-tokens "$TOKENS" --reps 2 --temperature "$temperature" --seed 7)
  curl -sf "http://$ADDR/metrics" | LABEL="$label" BEST="$best" MEDIAN="$median" python3 -c '
import os, sys
m = {}
for line in sys.stdin:
    if line.startswith("hearth_") and " " in line:
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
tokens = m.get("hearth_generated_tokens_total", 0)
steps = m.get("hearth_decode_sequence_steps_total", 0)
prop, acc = m.get("hearth_spec_draft_tokens_total", 0), m.get("hearth_spec_accepted_tokens_total", 0)
rate = f"{100 * acc / prop:.0f}% of {prop:.0f}" if prop else "-"
label, best, median = os.environ["LABEL"], float(os.environ["BEST"]) * 1e3, float(os.environ["MEDIAN"]) * 1e3
print(f"| {label} | {best:.1f} | {median:.1f} | {tokens / steps:.2f} | {rate} |")'
  cleanup
}

echo "| setup (hop $HOP ms, k = 1, $TOKENS tokens) | best TPOT ms | median TPOT ms | tokens per traversal | drafts accepted |"
echo "|---|---:|---:|---:|---:|"
run "repetitive text, greedy, no speculation" "$REPETITIVE" 0
run "repetitive text, greedy, --spec-mode ngram" "$REPETITIVE" 0 --spec-mode ngram
run "repetitive text, greedy, the model as its own --draft-model" "$REPETITIVE" 0 --draft-model "$MODEL"
run "fresh answer, greedy, no speculation" "$FRESH" 0
run "fresh answer, greedy, --spec-mode ngram" "$FRESH" 0 --spec-mode ngram
run "fresh answer, greedy, the model as its own --draft-model" "$FRESH" 0 --draft-model "$MODEL"
run "sampled answer, no speculation" "$FRESH" 1.0
run "sampled answer, --spec-mode ngram" "$FRESH" 1.0 --spec-mode ngram
run "sampled answer, the model as its own --draft-model" "$FRESH" 1.0 --draft-model "$MODEL"
run "fresh answer, greedy, a small draft model that is always wrong" "$FRESH" 0 --draft-model "$FAILING"
run "sampled answer, a small draft model that is always wrong" "$FRESH" 1.0 --draft-model "$FAILING"
