#!/usr/bin/env bash
# The memory experiment (docs/benchmarks.md, "The memory experiment"): TPOT of a model
# that does not fit in memory, served by
#   single  one `hearth serve` process holding the whole model, memory = the ring's total
#   k1      the ring, one window per device (plain pipeline)
#   prp     the ring, k >= 2 windows per device, workers prefetching their next window
#   noprf   as prp, with --no-prefetch on every device (the ablation)
#   halda   the ring with the plan Halda chooses from the devices' measured profiles
# "predicted s" is the cost model's TPOT for the plan at the measured context, with the
# ring's measured hop and (MoE) the measured disk share: the share of a non-resident
# layer's expert bytes read per token ("disk share").
# Every process runs in its own memory cgroup (v1; file-backed mmap pages are charged to
# it, so the limit bounds how much of the model stays cached) and, optionally, its own
# blkio read throttle (each process gets its own "disk" of DISK_MBPS). Page cache is
# dropped before every scenario. Needs root, cgroup v1 at /sys/fs/cgroup/{memory,blkio},
# python3, and a release build of hearth.
#
# Usage: scripts/memory-experiment.sh [scenario...]     (default: single k1 prp noprf)
# Settings (environment):
#   HEARTH       the binary             (default $CARGO_TARGET_DIR/release/hearth-lab)
#   MODEL        the GGUF               (default models/random-llama-30x2048-q8_0.gguf,
#                                        written by `hearth-lab make-model` if missing)
#   MAKE_MODEL   `hearth-lab make-model` arguments that write MODEL when it is missing
#                (default: the dense llama above; docs/benchmarks.md has the MoE one)
#   LIMIT_MIB    memory limit of each ring member (default 480)
#   HEAD_LIMIT_MIB  of the head         (default LIMIT_MIB)
#   SINGLE_LIMIT_MIB of the single process (default: the ring's total)
#   DISK_MBPS    read throttle per process in MB/s (default 300; 0 = none). Three readers
#                at 300 MB/s stay below this machine's disk (~1.5 GB/s), so each is a disk of its own
#   WORKERS      ring workers           (default 3; the head is then a relay: window 0)
#   K1_WINDOWS / PRP_WINDOWS  --windows for the ring (default 0,10,10,10 and 0,2,2,2)
#   TOKENS       max_tokens per request (default 12)   RUN_TIMEOUT  seconds per run (600)
#   TEMPERATURE  sampling temperature (default 0: greedy; seed 1). Greedy on random weights
#                repeats a token, and a MoE layer then routes every step to the same
#                experts; sampling gives the varied routing of real text
#   OUT          results folder         (default target/memory-experiment)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth-lab}"
MODEL="${MODEL:-$root/models/random-llama-30x2048-q8_0.gguf}"
LIMIT_MIB="${LIMIT_MIB:-480}"
HEAD_LIMIT_MIB="${HEAD_LIMIT_MIB:-$LIMIT_MIB}"
WORKERS="${WORKERS:-3}"
SINGLE_LIMIT_MIB="${SINGLE_LIMIT_MIB:-$(( HEAD_LIMIT_MIB + WORKERS * LIMIT_MIB ))}"
DISK_MBPS="${DISK_MBPS:-300}"
K1_WINDOWS="${K1_WINDOWS:-0,10,10,10}"
PRP_WINDOWS="${PRP_WINDOWS:-0,2,2,2}"
TOKENS="${TOKENS:-12}"
TEMPERATURE="${TEMPERATURE:-0}"
RUN_TIMEOUT="${RUN_TIMEOUT:-600}"
OUT="${OUT:-$root/target/memory-experiment}"
PORT=18180
WPORT=18190
CG=hearth-exp
SCENARIOS=("$@")
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(single k1 prp noprf)

mkdir -p "$OUT"
[ -x "$HEARTH" ] || { echo "no hearth binary at $HEARTH (cargo build --release --workspace)" >&2; exit 1; }
if [ ! -f "$MODEL" ]; then
  echo "writing $MODEL ..." >&2
  # shellcheck disable=SC2086 # MAKE_MODEL is a list of arguments
  "$HEARTH" make-model ${MAKE_MODEL:---layers 30 --embd 2048 --ff 9216 --type q8_0} --out "$MODEL" >&2
fi
# shellcheck source=scripts/lib-cgroups.sh
. "$root/scripts/lib-cgroups.sh"
DISK_DEV=$(dev_of "$MODEL")
trap 'cleanup; remove_groups' EXIT

# One streamed greedy /v1/completions (no end-of-text: random weights may pick it at once);
# prints "tpot_s ttft_s tokens".
measure() {
  timeout "$RUN_TIMEOUT" scripts/tpot.py "http://127.0.0.1:$PORT" --prompt "The history of the" \
    --max-tokens "$TOKENS" --reps 1 --suppress 0,1,2 --timeout "$RUN_TIMEOUT" --temperature "$TEMPERATURE" --seed 1 | awk '{ printf "%.3f %.3f %d\n", $1, $3, $4 }'
}

profile_workers() { # appends each worker's profile to $1
  for i in $(seq 1 "$WORKERS"); do
    echo "== worker $i" >> "$1"
    "$HEARTH" worker-profile --worker "127.0.0.1:$((WPORT + i))" >> "$1" 2>&1 || true
  done
}

summary_reads() { # total read_compute / read_wait bytes of all workers, MiB per step
  python3 - "$1" <<'EOF'
import json, sys, re
text = open(sys.argv[1]).read()
comp = wait = steps = 0
for chunk in text.split("== worker")[1:]:
    j = json.loads(chunk[chunk.index("{"):])
    for w in j["windows"]:
        comp += w["read_compute_bytes"]; wait += w["read_wait_bytes"]; steps = max(steps, w["steps"])
print(f"{comp/2**20:.0f} {wait/2**20:.0f}")
EOF
}

run_scenario() {
  local s=$1 log="$OUT/$1"
  cleanup
  sync; echo 3 > /proc/sys/vm/drop_caches
  # Every process measures its device afresh, in its cgroup: a profile cached by another
  # run would carry another disk throttle.
  XDG_CACHE_HOME="$(mktemp -d)"
  export XDG_CACHE_HOME
  local common=(--model "$MODEL" --threads 1)
  if [ "$s" = single ]; then
    make_group single "$SINGLE_LIMIT_MIB"
    start single "$log.head.log" "$HEARTH" serve "${common[@]}" --port "$PORT" --ctx-size 256 --parallel 1
  else
    local windows=$K1_WINDOWS extra=() plan=()
    [ "$s" = k1 ] || windows=$PRP_WINDOWS
    [ "$s" = noprf ] && extra=(--no-prefetch)
    if [ "$s" = halda ]; then plan=(--plan-strategy halda); else plan=(--windows "$windows"); fi
    local addrs=()
    for i in $(seq 1 "$WORKERS"); do
      make_group "w$i" "$LIMIT_MIB"
      start "w$i" "$log.w$i.log" "$HEARTH" worker "${common[@]}" --listen "127.0.0.1:$((WPORT + i))" "${extra[@]}"
      addrs+=("127.0.0.1:$((WPORT + i))")
    done
    for i in $(seq 1 "$WORKERS"); do
      wait_for 60 grep -q "listening on" "$log.w$i.log" || { echo "worker $i did not start" >&2; cat "$log.w$i.log" >&2; return 1; }
    done
    make_group head "$HEAD_LIMIT_MIB"
    start head "$log.head.log" "$HEARTH" serve "${common[@]}" --port "$PORT" --ctx-size 256 --parallel 1 \
      --workers "$(IFS=,; echo "${addrs[*]}")" "${plan[@]}" --admin-key memory-experiment --replan-idle 0 "${extra[@]}"
  fi
  wait_for 300 curl -sf "http://127.0.0.1:$PORT/health" || { echo "$s: head did not start" >&2; tail -5 "$log.head.log" >&2; return 1; }
  local result; result=$(measure) || { echo "$s: request failed or timed out" >&2; return 1; }
  local reads="- -" predicted="- -"
  if [ "$s" != single ]; then
    # The cost model's TPOT for this plan on the profiles the head gathered (each worker
    # measured inside its own cgroup and disk throttle), at the context the steps had.
    curl -sf "http://127.0.0.1:$PORT/admin/plan" -H "Authorization: Bearer memory-experiment" > "$log.plan.json" || true
    predicted=$(python3 -c 'import json,sys; j=json.load(sys.stdin); v=j["predicted_tpot_ms_at_measured_context"]; d=j.get("measured_disk_share"); print((f"{v/1e3:.3f}" if v else "-") + " " + (f"{d:.4f}" if d is not None else "-"))' < "$log.plan.json" || echo "- -")
    : > "$log.profile.json"
    profile_workers "$log.profile.json"
    reads=$(summary_reads "$log.profile.json" 2>/dev/null || echo "- -")
  fi
  echo "$s $result $reads $predicted"
  cleanup
}

printf '%-7s %9s %9s %7s %14s %14s %12s %11s\n' scenario "TPOT s" "TTFT s" tokens "disk@compute" "disk@wait" "predicted s" "disk share" | tee "$OUT/table.txt"
echo "# model $(basename "$MODEL") ($(( $(stat -c %s "$MODEL") >> 20 )) MiB), limits: head $HEAD_LIMIT_MIB MiB, $WORKERS workers x $LIMIT_MIB MiB, single $SINGLE_LIMIT_MIB MiB; disk ${DISK_MBPS} MB/s per process ($DISK_DEV); windows k1 $K1_WINDOWS, prp $PRP_WINDOWS; $TOKENS tokens at temperature $TEMPERATURE" | tee -a "$OUT/table.txt"
declare -A tpot
for s in "${SCENARIOS[@]}"; do
  run_scenario "$s" > "$OUT/$s.result" || { cleanup; echo "$s failed" > "$OUT/$s.result"; }
  line=$(cat "$OUT/$s.result")
  read -r name t ttft n rc rw pred ds _rest <<<"$line $(printf " -%.0s" 1 2 3 4 5 6 7)"
  tpot[$s]=$t
  printf '%-7s %9s %9s %7s %11s MiB %11s MiB %12s %11s\n' "$name" "$t" "$ttft" "$n" "$rc" "$rw" "$pred" "$ds" | tee -a "$OUT/table.txt"
done
if [ -n "${tpot[prp]:-}" ] && [ -n "${tpot[k1]:-}" ]; then
  python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'prp/k1 TPOT ratio: {a/b:.2f}')" "${tpot[prp]}" "${tpot[k1]}" 2>/dev/null | tee -a "$OUT/table.txt" || true
fi
