#!/usr/bin/env bash
# Figures on a real GPU, one command: hearth (a `cuda` or `vulkan` build) against llama.cpp
# on the same accelerator, same layers, same process (`hearth bench`, which also says
# whether both engines wrote the same greedy text): every layer and the output layer
# there (`--gpu-layers 99`), every layer with the LM head on the CPU, half the layers;
# the MoE model whole and with its experts in RAM; then `hearth serve` with
# `--gpu-layers auto` under the load its users send (scripts/load.py: one stream's TPOT,
# 8 streams' aggregate, a 2,000-token prompt's TTFT).
#
#   scripts/gpu-bench.sh HEARTH_BINARY TOKENIZER_GGUF OUT_DIR
#
# The models are random-weight (`hearth-lab make-model`, written in seconds), shaped as the
# models homes run: a Llama-3-8B-shaped dense model (q4_0, ~4 GB) and a Qwen3-MoE-shaped
# one (64 experts, 8 used). TOKENIZER_GGUF lends them its vocabulary (any GGUF: the
# default model, or a small one made from it). Env: THREADS (default: all cores), MODELS
# (where the models go, default /tmp/hearth-gpu-models), REPS (default 3), DENSE_SHAPE and
# MOE_SHAPE (`hearth-lab make-model` arguments, to try the script on a small machine).
set -uo pipefail
bin=$(realpath "$1"); tok=$(realpath "$2"); out=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
threads=${THREADS:-$(nproc)}
models=${MODELS:-/tmp/hearth-gpu-models}
reps=${REPS:-3}
mkdir -p "$models" "$out"
# Each step is bounded: a hang on a driver must not eat the machine's whole lease.
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@"; echo "== rc $?"; }

step 120 "$bin" profile --fresh --threads "$threads" 2>&1 | tee "$out/profile.txt"
dense=$models/llama8b-shape-q4_0.gguf
moe=$models/qwen3moe-shape-q4_0.gguf
dense_shape=${DENSE_SHAPE:---layers 32 --embd 4096 --ff 14336 --heads 32 --kv-heads 8}
moe_shape=${MOE_SHAPE:---layers 24 --embd 2048 --heads 32 --kv-heads 4 --head-dim 128 --experts 64 --experts-used 8 --expert-ff 768}
moe_layers=$(grep -oE -- '--layers [0-9]+' <<<"$moe_shape" | cut -d' ' -f2)
# shellcheck disable=SC2086 # the shapes are argument lists
[ -f "$dense" ] || step 300 "$bin" make-model --model "$tok" $dense_shape --type q4_0 --out "$dense"
# shellcheck disable=SC2086
[ -f "$moe" ] || step 300 "$bin" make-model --model "$tok" --arch qwen3moe $moe_shape --type q4_0 --out "$moe"

{
  step 240 "$bin" bench --model "$dense" --threads "$threads" --gpu-layers 99 --reps "$reps" --sequences 8
  dense_layers=$(grep -oE -- '--layers [0-9]+' <<<"$dense_shape" | cut -d' ' -f2)
  step 240 "$bin" bench --model "$dense" --threads "$threads" --gpu-layers "$dense_layers" --reps "$reps" --sequences 8
  step 240 "$bin" bench --model "$dense" --threads "$threads" --gpu-layers 16 --reps 1 --sequences 8
  step 240 "$bin" bench --model "$moe" --threads "$threads" --gpu-layers 99 --reps "$reps" --sequences 8
  step 240 "$bin" bench --model "$moe" --threads "$threads" --gpu-layers 99 --experts-in-ram "$moe_layers" --reps 1 --sequences 8
} 2>&1 | tee "$out/bench.txt"

port=18181
"$bin" serve --model "$dense" --threads "$threads" --parallel 8 --gpu-layers auto --port "$port" > "$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
{
  url=http://127.0.0.1:$port
  step 120 python3 "$here/scripts/load.py" "$url" tpot --max-tokens 64 --reps 2
  step 120 python3 "$here/scripts/load.py" "$url" streams 8 --steady --max-tokens 128 --reps 1
  step 120 python3 "$here/scripts/load.py" "$url" ttft 2000 --reps 2
  curl -s "$url/metrics" | grep -E '^hearth_device_gpu_layers|^hearth_(ttft|tpot)_seconds_(sum|count)'
} 2>&1 | tee "$out/serve.txt"
kill "$pid"; wait "$pid" 2>/dev/null
