#!/usr/bin/env bash
# What batch-invariant kernels cost (--batch-invariant; on whenever speculation is): TPOT
# of a short prompt and TTFT of a ~1,500-token prompt of real text, llama.cpp's default
# kernels against ggml's reference ones, alternating in one run. Results: docs/benchmarks.md.
#
#   scripts/invariance-bench.sh [REPS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPS="${1:-2}"
source scripts/roles.sh
LONG="$(head -c 6000 testdata/prima-cpp-excerpt.txt)"
declare -A tpot ttft
for rep in $(seq 1 "$REPS"); do
  for mode in default invariant; do
    extra=(); [ "$mode" = invariant ] && extra=(--batch-invariant)
    start serve --port 0 --threads 2 "${extra[@]}"
    read -r best _ _ _ < <(scripts/tpot.py "http://$ADDR" --max-tokens 128 --reps 3)
    # A different first word each time: a repeated prompt would come from the prompt cache.
    for n in 1 2 3; do
      read -r _ _ long_ttft _ < <(scripts/tpot.py "http://$ADDR" --prompt "Take $n: $LONG" --max-tokens 4 --reps 1)
      ttft[$mode]="${ttft[$mode]:-} $long_ttft"
    done
    tpot[$mode]="${tpot[$mode]:-} $best"
    cleanup
  done
done
python3 - "${tpot[default]}" "${tpot[invariant]}" "${ttft[default]}" "${ttft[invariant]}" <<'PY'
import sys
d, i, dl, il = ([float(x) for x in a.split()] for a in sys.argv[1:])
print(f"decode TPOT (best of reps): default {min(d)*1e3:.2f} ms, batch-invariant {min(i)*1e3:.2f} ms, ratio {min(i)/min(d):.3f}")
print(f"TTFT, ~1,500-token prompt (best): default {min(dl)*1e3:.0f} ms, batch-invariant {min(il)*1e3:.0f} ms, ratio {min(il)/min(dl):.3f}")
PY
