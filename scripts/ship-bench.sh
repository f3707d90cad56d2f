#!/usr/bin/env bash
# The model shipped from the head (docs/benchmarks.md, "The model from the head"): a head
# and a worker on two network namespaces joined by a veth pair, the link from the head
# throttled with tc's token bucket (RATE), the worker started without the model. It joins
# by discovery, the head plans with it (`even`: half the layers each), the worker fetches
# the header and its windows; the script prints the time from the worker's start to the
# plan with it, the bytes the head sent, what the worker's windows need, and the size of
# the head's file.
#
#   MODEL=models/bench/r2g.gguf RATE=100mbit scripts/ship-bench.sh
#
# Settings (environment): MODEL (default: the default model), RATE (100mbit), HEARTH (the
# release binary). Needs root (namespaces, tc) and a release build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth-lab}"
MODEL="${MODEL:-$(scripts/fetch-model.sh)}"
RATE="${RATE:-100mbit}"
SECRET="ship-bench-secret"
ADMIN="ship-bench-admin"
id=$$
A="hearth-shipa-$id" B="hearth-shipb-$id"
VA="hsa$((id % 100000))" VB="hsb$((id % 100000))"
NET="10.77.$((id % 250))"
work="$(mktemp -d)"
cleanup() {
  [ -n "${worker_pid:-}" ] && kill "$worker_pid" 2>/dev/null || true
  [ -n "${head_pid:-}" ] && kill "$head_pid" 2>/dev/null || true
  wait 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$A"; ip netns add "$B"
ip link add "$VA" type veth peer name "$VB"
for pair in "$A $VA 1" "$B $VB 2"; do
  read -r ns dev host <<<"$pair"
  ip link set "$dev" netns "$ns"
  ip -n "$ns" addr add "$NET.$host/24" broadcast "$NET.255" dev "$dev"
  ip -n "$ns" link set "$dev" up
  ip -n "$ns" link set lo up
  ip -n "$ns" route add 224.0.0.0/4 dev "$dev"
done
tc -n "$A" qdisc add dev "$VA" root tbf rate "$RATE" burst 256kb latency 500ms

export HEARTH_LOG=info
ip netns exec "$A" "$HEARTH" serve --model "$MODEL" --port 8080 --host "$NET.1" --threads 1 \
  --cluster-secret "$SECRET" --admin-key "$ADMIN" --ctx-size 512 --parallel 1 >"$work/head.log" 2>&1 &
head_pid=$!
api="http://$NET.1:8080"
in_a() { ip netns exec "$A" "$@"; }
for _ in $(seq 600); do in_a curl -sf "$api/health" >/dev/null 2>&1 && break; sleep 1; done
in_a curl -sf "$api/health" >/dev/null || { cat "$work/head.log"; exit 1; }

start=$(date +%s.%N)
ip netns exec "$B" "$HEARTH" worker --listen 0.0.0.0:9090 --threads 1 --cluster-secret "$SECRET" \
  --model-dir "$work/shipped" >"$work/worker.log" 2>&1 &
worker_pid=$!
admin() { in_a curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
for _ in $(seq 120); do admin "$api/admin/cluster" | grep -q "\"$NET.2:9090\"" && break; sleep 0.5; done
joined=$(date +%s.%N)
admin -X POST -H 'Content-Type: application/json' -d '{"strategy":"even"}' "$api/admin/replan" >/dev/null
for _ in $(seq 7200); do
  admin "$api/admin/plan" | grep -q "\"name\":\"$NET.2:9090\"" && break
  sleep 0.5
done
planned=$(date +%s.%N)
metrics="$(in_a curl -sf "$api/metrics")"
served=$(awk '/^hearth_model_bytes_served_total/ {print $2}' <<<"$metrics")
needed=$(grep '^hearth_model_fetch_bytes{' <<<"$metrics" | grep 'kind="needed"' | awk '{print $2}')
size=$(stat -c %s "$MODEL")
on_disk=$(du -B1 "$work/shipped"/*.gguf | awk '{print $1}')
answer=$(in_a curl -sf "$api/v1/completions" -H 'Content-Type: application/json' -d '{"model":"","prompt":"The","max_tokens":8,"temperature":0}' | head -c 300)
awk -v model="$MODEL" -v size="$size" -v rate="$RATE" -v start="$start" -v joined="$joined" -v planned="$planned" \
    -v served="$served" -v needed="$needed" -v disk="$on_disk" 'BEGIN {
  printf "model %s: %.2f GB; link %s from the head\n", model, size / 1e9, rate
  printf "worker start -> joined: %.1f s; -> planned with (windows fetched): %.1f s\n", joined - start, planned - start
  printf "bytes sent by the head: %.0f; needed by the worker (header + windows): %.0f; ratio %.4f\n", served, needed, served / needed
  printf "the worker file takes %.0f bytes of disk (sparse, %.0f long)\n", disk, size
  printf "effective rate while fetching: %.1f MB/s\n", served / (planned - joined) / 1e6
}'
echo "answer through the ring: $answer"
grep -E "fetching the model|manifest" "$work/worker.log" "$work/head.log" | tail -n 6 || true
