#!/usr/bin/env bash
# The whole journey of a big model onto a home cluster (docs/benchmarks.md, "The whole
# journey"), as one run:
#   1. a random-weight model with Llama-3.3-70B's shapes (e=8192, ff=28672, 64 heads, 8 KV
#      heads; the default model's vocabulary) in llama.cpp's Q4_K_M mix, written as a
#      2-part split set into a local stand-in for the Hugging Face hub (scripts/hub-standin.py);
#   2. `hearth pull` from the stand-in into the hub cache (HF_ENDPOINT, HF_HUB_CACHE);
#   3. a cold start (page cache dropped) of a head serving `hf:REPO:Q4_K_M` and two workers
#      with no model, each process in a memory cgroup, the three limits summing to less
#      than the model: time to the first answer, the bytes each worker fetched from the
#      head, TPOT of the plain pipeline (one window per device);
#   4. the same devices with PRP (two windows per device, each prefetching its next while
#      the others compute) and without prefetch (the ablation): TPOT;
#   5. a prompt of about 4,000 tokens of real text through the PRP ring: time to first
#      token, TPOT after it.
# Every number comes from this one run; the table and the commands go to $OUT/journey.txt.
# Needs root (cgroups v1, drop_caches), python3, and a release build (hearth-lab).
#
# Settings (environment):
#   LAYERS       layers (default 80, the real model's; ~43 GB, and the stand-in's copy and
#                the pulled one both need that: ~90 GB of disk; fewer layers keep the
#                per-layer shapes and scale the rest)
#   OUT          folder for the model, the hub cache and the logs (default models/journey)
#   LIMIT_PCT    each process's memory limit in % of the model (default 30: 90% in all)
#   DISK_MBPS    read throttle per process in MB/s (default 0 = none)
#   TOKENS       tokens per TPOT measurement (default 12)
#   LONG_CHARS   characters of the prima.cpp paper's text in the long prompt (default
#                16800, about 4,000 tokens)
#   KEEP_HUB=1   keep the stand-in's copy after the pull (default: removed, to halve the disk)
#   HEARTH       the binary (default $CARGO_TARGET_DIR/release/hearth-lab)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth-lab}"
LAYERS="${LAYERS:-80}"
OUT="${OUT:-$root/models/journey}"
LIMIT_PCT="${LIMIT_PCT:-30}"
DISK_MBPS="${DISK_MBPS:-0}"
TOKENS="${TOKENS:-12}"
LONG_CHARS="${LONG_CHARS:-16800}"
KEEP_HUB="${KEEP_HUB:-0}"
HUB_PORT=18400
PORT=18480
WPORT=18490
CG=hearth-journey
REPO=local/llama-3.3-70b-shapes-GGUF
NAME=llama-70b-shapes-Q4_K_M
[ -x "$HEARTH" ] || { echo "no hearth binary at $HEARTH (cargo build --release --workspace)" >&2; exit 1; }
mkdir -p "$OUT"
report="$OUT/journey.txt"
: > "$report"
say() { echo "$*" | tee -a "$report"; }
run() { say "\$ $*"; "$@"; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

# shellcheck source=scripts/lib-cgroups.sh
. "$root/scripts/lib-cgroups.sh"
hub_pid=""
trap 'cleanup; remove_groups; [ -n "$hub_pid" ] && kill "$hub_pid" 2>/dev/null || true' EXIT

# 1. The model, split in two near the middle of its tensor data.
hub_dir="$OUT/hub/$REPO/Q4_K_M"
mkdir -p "$hub_dir"
split_bytes=$(python3 - "$LAYERS" <<'EOF'
import sys
L, e, ff, q, kv, vocab = int(sys.argv[1]), 8192, 28672, 8192, 1024, 49152
q4k = lambda n: n // 256 * 144
q6k = lambda n: n // 256 * 210
more = lambda i: i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2
total = q4k(e * vocab) + e * 4 + q6k(e * vocab)
for i in range(L):
    v, down = (q6k, q6k) if more(i) else (q4k, q4k)
    total += 2 * e * 4 + q4k(e * q) + q4k(e * kv) + v(e * kv) + q4k(q * e) + 2 * q4k(e * ff) + down(ff * e)
largest = q6k(e * vocab)
# Half the data plus the largest tensor: the first part stops past the middle, the rest fits
# the second.
print(total // 2 + largest)
EOF
)
if ! ls "$hub_dir"/*-00001-of-*.gguf >/dev/null 2>&1; then
  t=$(now)
  run "$HEARTH" make-model --arch llama --layers "$LAYERS" --embd 8192 --ff 28672 --heads 64 --kv-heads 8 \
    --type q4_k_m --context-length 8192 --split-max-size "$split_bytes" --out "$hub_dir/$NAME.gguf"
  say "model written in $(since "$t") s"
fi
model_bytes=$(cat "$hub_dir"/*.gguf | wc -c)
model_mib=$(( model_bytes >> 20 ))
limit_mib=$(( model_mib * LIMIT_PCT / 100 ))

# 2. Pulled from the stand-in into the hub cache.
export HF_ENDPOINT="http://127.0.0.1:$HUB_PORT" HF_HUB_CACHE="$OUT/hf-cache"
unset HF_TOKEN
rm -rf "$HF_HUB_CACHE"
python3 scripts/hub-standin.py "$OUT/hub" --port "$HUB_PORT" 2> "$OUT/hub-standin.log" &
hub_pid=$!
wait_for 3600 grep -q "serving" "$OUT/hub-standin.log" || { echo "the hub stand-in did not start" >&2; cat "$OUT/hub-standin.log" >&2; exit 1; }
t=$(now)
say "\$ HF_ENDPOINT=$HF_ENDPOINT HF_HUB_CACHE=$HF_HUB_CACHE $HEARTH pull $REPO:Q4_K_M"
first=$("$HEARTH" pull "$REPO:Q4_K_M" 2> "$OUT/pull.log" | tail -1)
pull_s=$(since "$t")
say "pulled $((model_bytes / 1000000)) MB in $pull_s s: $first"
kill "$hub_pid"; wait "$hub_pid" 2>/dev/null || true; hub_pid=""
[ "$KEEP_HUB" = 1 ] || rm -rf "$OUT/hub"
DISK_DEV=$(dev_of "$first")

# 3-5. The cluster: a head with the model and two workers without, in memory cgroups.
k1=$(( LAYERS / 3 )); k1_windows="$(( LAYERS - 2 * k1 )),$k1,$k1"
half=$(( LAYERS / 6 > 0 ? LAYERS / 6 : 1 ))
prp_windows="$half,$half,$half"
# Prose (the prima.cpp paper's text, as the load scripts use): what a long prompt is.
long_prompt=$(python3 -c 'import sys; print(" ".join(open(sys.argv[2]).read().split())[:int(sys.argv[1])])' "$LONG_CHARS" testdata/prima-cpp-excerpt.txt)
cluster() { # cluster NAME WINDOWS [EXTRA...]: starts the three processes, waits for the head
  local name=$1 windows=$2; shift 2
  cleanup
  sync; echo 3 > /proc/sys/vm/drop_caches
  local addrs=()
  for i in 1 2; do
    make_group "w$i" "$limit_mib"
    start "w$i" "$OUT/$name.w$i.log" "$HEARTH" worker --listen "127.0.0.1:$((WPORT + i))" --model-dir "$OUT/shipped-w$i" --threads 1 "$@"
    addrs+=("127.0.0.1:$((WPORT + i))")
  done
  for i in 1 2; do
    wait_for 60 grep -q "listening on" "$OUT/$name.w$i.log" || { echo "worker $i did not start" >&2; cat "$OUT/$name.w$i.log" >&2; return 1; }
  done
  make_group head "$limit_mib"
  say "\$ $HEARTH serve --model hf:$REPO:Q4_K_M --threads 1 --ctx-size 4608 --workers $(IFS=,; echo "${addrs[*]}") --windows $windows $* (each in a ${limit_mib} MiB cgroup)"
  start head "$OUT/$name.head.log" "$HEARTH" serve --model "hf:$REPO:Q4_K_M" --port "$PORT" --threads 1 --ctx-size 4608 --parallel 1 \
    --workers "$(IFS=,; echo "${addrs[*]}")" --windows "$windows" --replan-idle 0 "$@"
  wait_for 7200 curl -sf "http://127.0.0.1:$PORT/health" || { echo "$name: the head did not start" >&2; tail -5 "$OUT/$name.head.log" >&2; return 1; }
}
tpot() { # tpot PROMPT: "tpot_s ttft_s tokens" of one streamed completion
  # Sampled (seed 1), not greedy: greedy on random weights repeats one token, often a
  # special one whose text is empty, and an empty stream times nothing.
  timeout 7200 scripts/tpot.py "http://127.0.0.1:$PORT" --prompt "$1" --max-tokens "$TOKENS" --reps 1 --suppress 0,1,2 \
    --temperature 1 --seed 1 --timeout 7200 2>>"$OUT/tpot.log" | awk '{ printf "%.3f %.3f %d\n", $1, $3, $4 }'
}
fetched() { # bytes each worker verified from the head, from the head's metrics
  curl -sf "http://127.0.0.1:$PORT/metrics" | awk '/^hearth_model_fetch_bytes\{/ && /kind="verified"/ { printf "%s %.0f MB; ", $1, $2 / 1e6 }'
}

say ""
say "# model: $LAYERS layers of Llama-3.3-70B's shapes, Q4_K_M mix, 2 parts, $((model_bytes / 1000000)) MB; limits: 3 x $limit_mib MiB ($(( 3 * limit_mib )) MiB < $model_mib MiB); disk throttle ${DISK_MBPS} MB/s per process (0: none); 1 thread per process"
t=$(now)
cluster k1 "$k1_windows"
read -r tpot_k1 _ _ <<<"$(tpot "The history of the")"
first_answer=$(since "$t")
say "cold start to the first answer (workers fetching their windows from the head): $first_answer s"
say "fetched: $(fetched)"
say "TPOT, plain pipeline (windows $k1_windows): $tpot_k1 s"
cluster noprf "$prp_windows" --no-prefetch
read -r tpot_noprf _ _ <<<"$(tpot "The history of the")"
say "TPOT, PRP without prefetch (windows $prp_windows x2): $tpot_noprf s"
cluster prp "$prp_windows"
read -r tpot_prp _ _ <<<"$(tpot "The history of the")"
say "TPOT, PRP with prefetch (windows $prp_windows x2): $tpot_prp s"
say "fetched after PRP's windows: $(fetched)"
prompt_tokens_total() { curl -sf "http://127.0.0.1:$PORT/metrics" | awk '/^hearth_prompt_tokens_total/ { print $2 }'; }
before=$(prompt_tokens_total)
read -r long_tpot long_ttft long_n <<<"$(tpot "$long_prompt")"
prompt_tokens=$(python3 -c "import sys; print(int(float(sys.argv[2]) - float(sys.argv[1])))" "$before" "$(prompt_tokens_total)" || echo "?")
say "long prompt ($prompt_tokens tokens of the paper's text), PRP: time to first token $long_ttft s, then TPOT $long_tpot s ($long_n tokens)"
python3 -c "import sys; k,p=float(sys.argv[1]),float(sys.argv[2]); print(f'PRP/plain TPOT ratio: {p/k:.2f}')" "$tpot_k1" "$tpot_prp" | tee -a "$report"
cleanup
