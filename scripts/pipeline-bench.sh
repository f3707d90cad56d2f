#!/usr/bin/env bash
# Pipelined micro-batches side by side (docs/benchmarks.md, "Every device busy"): three
# emulated devices on one machine — a head and two workers, each in a cpu cgroup of its own
# with CORES cores (scripts/cpu-device.sh) and one thread — run
#   single       one emulated device alone (hearth serve, the whole model): what the ring
#                of three is measured against
#   hearth-1     the ring with one micro-batch at a time (--micro-batches 1: prima.cpp's way,
#                and hearth's before pipelining); hearth-N: N in flight
#   hearth       the ring with micro-batches in flight (--micro-batches auto)
#   llama-rpc    llama.cpp's distributed mode: llama-server --rpc with two ggml-rpc-server
#                processes (scripts/llama-upstream.sh), the same layers on each device
# and measure, with scripts/load.py against each server's OpenAI API:
#   TPOT of one stream, aggregate tokens/s of STREAMS concurrent streams, and the time to
#   the first token of a PROMPT-token prompt of real text.
# It prints one row per setup and the ratios against hearth-1 and llama-rpc.
#
#   scripts/pipeline-bench.sh [SETUP...]          (default: hearth-1 hearth llama-rpc)
# Ratios are printed for every pair of hearth, hearth-1, llama-rpc and single that ran.
#
# Settings (environment): MODEL (default: the default model), LAYERS (the model's layer
# count; default 30), WINDOWS (head,worker,worker layers; default a third each; `auto`: the
# scheduler's plan), CORES (0.6; `none`: no cgroup,
# the three processes share the machine's cores as co-located ring members do), THREADS
# (per process, 1), STREAMS (8), PROMPT (2000), TOKENS (128 per stream), REPS (3), MEASURES
# (any of "tpot streams ttft"; default all three), HEARTH (the release binary), HEAD_ARGS
# (more arguments for the ring's head, e.g. `--prompt-chunk 128`). Needs root
# (cgroups) and a release build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
HEARTH="${HEARTH:-${CARGO_TARGET_DIR:-$root/target}/release/hearth-lab}"
MODEL="${MODEL:-$(scripts/fetch-model.sh)}"
LAYERS="${LAYERS:-30}"
CORES="${CORES:-0.6}"
THREADS="${THREADS:-1}"
STREAMS="${STREAMS:-8}"
PROMPT="${PROMPT:-2000}"
TOKENS="${TOKENS:-128}"
REPS="${REPS:-3}"
MEASURES="${MEASURES:-tpot streams ttft}"
HEAD_ARGS="${HEAD_ARGS:-}"
SETUPS=("$@")
[ ${#SETUPS[@]} -gt 0 ] || SETUPS=(hearth-1 hearth llama-rpc)
# Windows of a third of the layers each (the head's first, as the ring's head runs them).
# WINDOWS=auto: hearth's scheduler plans them from the profiles measured under the quotas
# (the plan the user gets); llama-rpc then gets the same layers per device, read from the
# first hearth setup's GET /admin/plan (so list a hearth setup before it).
W=$(( LAYERS / 3 ))
WINDOWS="${WINDOWS:-$(( LAYERS - 2 * W )),$W,$W}"
if [ "$WINDOWS" = auto ]; then
  W0=$(( LAYERS - 2 * W )) W1=$W W2=$W
else
  IFS=, read -r W0 W1 W2 <<<"$WINDOWS"
fi
# A context for a long prompt plus its answer per stream: load.py cuts the text at about
# 4.2 characters a token, and some passages tokenize denser (the tokens column says how
# many the prompts had; every setup gets the same prompts).
CTX=$(( 2 * PROMPT + TOKENS + 512 ))
# Profiles measured under this run's quotas, not taken from an earlier unthrottled run.
export XDG_CACHE_HOME="$(mktemp -d)"
PIDS=()
NAMES=()
LOGS="$(mktemp -d)"
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
  NAMES=()
  for n in head w1 w2; do scripts/cpu-device.sh --remove "$n"; done
}
trap 'cleanup; rm -rf "$XDG_CACHE_HOME"' EXIT

# device NAME LOGFILE COMMAND...: starts COMMAND as an emulated device.
device() {
  local name="$1" log="$2"
  shift 2
  if [ "$CORES" = none ]; then
    "$@" >"$log" 2>&1 &
  else
    scripts/cpu-device.sh "$name" "$CORES" "$@" >"$log" 2>&1 &
  fi
  PIDS+=($!)
  NAMES+=("$name")
}

# cpu_snapshot: the machine's busy and total CPU time (/proc/stat), and each device's
# process CPU time (/proc/PID/stat) and its cgroup's throttled time, as one line of JSON.
cpu_snapshot() {
  curl -s -H "Authorization: Bearer bench" "http://$ADDR/metrics" > "$LOGS/metrics" 2>/dev/null || true
  python3 - "$LOGS/metrics" "${NAMES[@]}" -- "${PIDS[@]}" <<'PY'
import json, os, re, sys
metrics = sys.argv[1]
args = sys.argv[2:]
cut = args.index("--")
names, pids = args[:cut], args[cut + 1:]
hz = os.sysconf("SC_CLK_TCK")
f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
# user nice system idle iowait irq softirq steal: idle and iowait are not busy.
out = {"t": os.times().elapsed, "busy": (sum(f[:8]) - f[3] - f[4]) / hz, "cores": os.cpu_count(), "devices": {}}
for n, p in zip(names, pids):
    try:
        st = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        cpu = (int(st[11]) + int(st[12])) / hz
    except OSError:
        continue
    throttled = 0.0
    try:
        for line in open(f"/sys/fs/cgroup/cpu/hearth-device-{n}/cpu.stat"):
            k, v = line.split()
            if k == "throttled_time":
                throttled = int(v) / 1e9
    except OSError:
        pass
    out["devices"][n] = {"cpu": cpu, "throttled": throttled}
# What the ring's members reported computing (ggml), per frame: the rest of a member's CPU
# time is its frames, threads waking and the head's batching, sampling and HTTP.
out["compute"] = {}
for line in open(metrics, errors="replace"):
    m = re.match(r'hearth_device_compute_seconds_(sum|count)\{device="([^"]+)"\} ([0-9.e+-]+)', line)
    if m:
        out["compute"].setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
print(json.dumps(out))
PY
}

# cpu_report BEFORE AFTER: where the machine's cores went between two snapshots: every
# device's cores (and how long its quota stopped it), and the rest (the load client, the
# kernel's loopback, anything else), so a ring that cannot reach its devices' quotas shows
# whether the machine itself ran out.
cpu_report() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
wall = b["t"] - a["t"]
busy = (b["busy"] - a["busy"]) / wall
parts, own = [], 0.0
for n, d in b["devices"].items():
    if n not in a["devices"]:
        continue
    c = (d["cpu"] - a["devices"][n]["cpu"]) / wall
    own += c
    parts.append("%s %.2f (stopped by its quota %.0f%% of the time)" % (n, c, 100 * (d["throttled"] - a["devices"][n]["throttled"]) / wall))
print("    cpu over the streams: the machine %.2f of %d cores busy; %s; everything else %.2f" % (busy, b["cores"], ", ".join(parts), busy - own))
ggml = []
for n, c in b.get("compute", {}).items():
    c0 = a.get("compute", {}).get(n, {})
    frames = c.get("count", 0) - c0.get("count", 0)
    if frames > 0:
        ggml.append("%s %.2f cores in %d windows (%.2f ms each)" % (n, (c["sum"] - c0.get("sum", 0)) / wall, frames, 1e3 * (c["sum"] - c0.get("sum", 0)) / frames))
if ggml:
    print("    ggml compute reported: " + ", ".join(ggml))
PY
}

# wait_for LOGFILE PATTERN: prints the first address the log announces.
wait_for() {
  for _ in $(seq 1 1200); do
    local addr; addr="$(grep -oE "$2" "$1" | grep -oE '[0-9.]+:[0-9]+' | head -1 || true)"
    if [ -n "$addr" ]; then echo "$addr"; return; fi
    sleep 0.1
  done
  echo "$0: no address in $1:" >&2; tail -20 "$1" >&2; exit 1
}

wait_http() {
  for _ in $(seq 1 1200); do
    if curl -sf "http://$1/health" >/dev/null 2>&1; then return; fi
    sleep 0.25
  done
  echo "$0: $1 never became healthy" >&2; exit 1
}

start_hearth() {
  local mb="$1" w1 w2
  device w1 "$LOGS/w1.log" "$HEARTH" worker --listen 127.0.0.1:0 --threads "$THREADS" --model "$MODEL"
  w1="$(wait_for "$LOGS/w1.log" 'listening on [0-9.]+:[0-9]+')"
  device w2 "$LOGS/w2.log" "$HEARTH" worker --listen 127.0.0.1:0 --threads "$THREADS" --model "$MODEL"
  w2="$(wait_for "$LOGS/w2.log" 'listening on [0-9.]+:[0-9]+')"
  device head "$LOGS/head.log" "$HEARTH" serve --port 0 --threads "$THREADS" --parallel "$STREAMS" --ctx-size "$CTX" \
    --workers "$w1,$w2" ${PINNED[@]+"${PINNED[@]}"} --micro-batches "$mb" --admin-key bench --model "$MODEL" $HEAD_ARGS
  ADDR="$(wait_for "$LOGS/head.log" 'listening on http://[0-9.]+:[0-9]+')"
  wait_http "$ADDR"
  if [ "$WINDOWS" = auto ]; then
    # Layers per member in ring order (a member's windows of every round together); a
    # member the plan left out gets none.
    read -r W0 W1 W2 < <(curl -s -H "Authorization: Bearer bench" "http://$ADDR/admin/plan" | python3 -c '
import json, sys
v = json.load(sys.stdin)
n = [sum(e - s for s, e in m["layers"]) for m in v["members"]] + [0, 0]
print(*n[:3])')
    echo "    plan: windows $W0,$W1,$W2 per member, $(curl -s -H "Authorization: Bearer bench" "http://$ADDR/admin/plan" | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["rounds"], "round(s),", [m["window"] for m in v["members"]], "dropped", v["dropped"])')"
  fi
}
PINNED=()
[ "$WINDOWS" = auto ] || PINNED=(--windows "$WINDOWS")

start_single() {
  device head "$LOGS/head.log" "$HEARTH" serve --port 0 --threads "$THREADS" --parallel "$STREAMS" --ctx-size "$CTX" \
    --admin-key bench --model "$MODEL"
  ADDR="$(wait_for "$LOGS/head.log" 'listening on http://[0-9.]+:[0-9]+')"
  wait_http "$ADDR"
}

start_llama_rpc() {
  local bin; bin="$(scripts/llama-upstream.sh)"
  local p1=18311 p2=18312 port=18310
  device w1 "$LOGS/w1.log" "$bin/ggml-rpc-server" -H 127.0.0.1 -p "$p1" -t "$THREADS"
  device w2 "$LOGS/w2.log" "$bin/ggml-rpc-server" -H 127.0.0.1 -p "$p2" -t "$THREADS"
  sleep 1
  # llama.cpp puts the last -ngl layers (the output layer counted) on the devices, split by
  # -ts: the head's CPU keeps the first third, each RPC server a third; the output layer is
  # sent back to the head's CPU, where hearth's head runs it. Its context is shared by the
  # slots: one sequence's worth each.
  # Layer i of the W1+W2+1 offloaded goes to the first device whose cumulative split
  # exceeds i/(W1+W2+1): a first split between (W1-1)/(W1+W2+1) and W1/(W1+W2+1) gives
  # the first server W1 layers and the second the rest.
  local split; split="$(python3 -c "a, b = $W1, $W2; s = (a - 0.5) / (a + b + 1); print(f'{s:.4f},{1 - s:.4f}')")"
  device head "$LOGS/head.log" "$bin/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$port" \
    --rpc "127.0.0.1:$p1,127.0.0.1:$p2" -ngl $(( W1 + W2 + 1 )) -ts "$split" -ot 'output\.weight=CPU,token_embd\.weight=CPU' \
    -t "$THREADS" -tb "$THREADS" -np "$STREAMS" -c $(( CTX * STREAMS )) --no-warmup
  ADDR="127.0.0.1:$port"
  wait_http "$ADDR"
}

printf '%-10s %12s %14s %14s %12s %8s\n' setup "TPOT ms" "${STREAMS} streams t/s" "decoding t/s" "TTFT ${PROMPT} s" tokens
declare -A TPOT AGG TTFT
for s in "${SETUPS[@]}"; do
  case "$s" in
    single) start_single ;;
    hearth) start_hearth auto ;;
    hearth-[0-9]*) start_hearth "${s#hearth-}" ;;
    llama-rpc) start_llama_rpc ;;
    *) echo "$0: unknown setup $s" >&2; exit 2 ;;
  esac
  tpot=nan agg=nan steady=nan ttft=nan count=-
  case " $MEASURES " in *" tpot "*) tpot="$(scripts/load.py "http://$ADDR" tpot --max-tokens "$TOKENS" --reps "$REPS")" ;; esac
  cpu=""
  case " $MEASURES " in *" streams "*)
    before="$(cpu_snapshot)"
    read -r agg steady < <(scripts/load.py "http://$ADDR" streams "$STREAMS" --max-tokens "$TOKENS" --reps 1 --steady)
    cpu="$(cpu_report "$before" "$(cpu_snapshot)")" ;;
  esac
  case " $MEASURES " in *" ttft "*) read -r ttft count < <(scripts/load.py "http://$ADDR" ttft "$PROMPT" --reps "$REPS") ;; esac
  TPOT[$s]="$tpot"; AGG[$s]="$agg"; TTFT[$s]="$ttft"
  printf '%-10s %12s %14s %14s %12s %8s\n' "$s" "$(python3 -c "print(f'{float(\"$tpot\") * 1000:.2f}')")" "$agg" "$steady" "$ttft" "$count"
  [ -z "$cpu" ] || echo "$cpu"
  if [ "$s" != llama-rpc ] && [ "$s" != single ]; then
    # What the scheduler predicted for this plan (GET /admin/plan's forecast).
    curl -s -H "Authorization: Bearer bench" "http://$ADDR/admin/plan" | STREAMS="$STREAMS" PROMPT="$PROMPT" python3 -c '
import json, os, sys
v = json.load(sys.stdin)
f = v.get("forecast") or {}
m = v["micro_batches"]
way = "pipelined" if m > 1 else "one_at_a_time"
parts = ["%d micro-batches" % m, "TPOT %.2f ms" % v["predicted_tpot_ms"]]
# The plan is judged at the full context; the TPOT measured here ran at a short one: the
# cost model at the context the steps had (with the hop they measured) is the figure to
# compare the measured TPOT with.
if v.get("predicted_tpot_ms_at_measured_context"):
    parts.append("TPOT %.2f ms at the measured context of %.0f tokens (measured %.2f ms)" % (v["predicted_tpot_ms_at_measured_context"], v["measured_context"], v["measured_tpot_ms"]))
for x in f.get("streams", []):
    if x["streams"] == int(os.environ["STREAMS"]):
        parts.append("%d streams %.2f t/s at %d tokens of context" % (x["streams"], x[way + "_tokens_per_s"], f.get("context", 0)))
for x in f.get("prompts", []):
    if x["tokens"] == int(os.environ["PROMPT"]):
        parts.append("TTFT %.2f s" % x[way + "_ttft_s"] + (" (chunks of %d)" % x["chunk"] if m > 1 else ""))
print("    predicted: " + ", ".join(parts))'
  fi
  cleanup
done
# Ratios: TPOT and TTFT as a fraction of the other's (lower is better), throughput as a multiple.
ratio() { python3 -c "a, b = $1, $2; print(f'{a / b:.2f}x')"; }
# Each measure that both setups ran (nan: not measured).
for pair in "hearth hearth-1" "hearth llama-rpc" "hearth-1 llama-rpc" "hearth single" "llama-rpc single"; do
  set -- $pair
  if [ -n "${TPOT[$1]:-}" ] && [ -n "${TPOT[$2]:-}" ]; then
    line="$1 vs $2:"
    [ "${TPOT[$1]}" = nan ] || line="$line TPOT $(ratio "${TPOT[$1]}" "${TPOT[$2]}"),"
    [ "${AGG[$1]}" = nan ] || line="$line ${STREAMS} streams $(ratio "${AGG[$1]}" "${AGG[$2]}"),"
    [ "${TTFT[$1]}" = nan ] || line="$line TTFT $(ratio "${TTFT[$1]}" "${TTFT[$2]}")"
    echo "${line%,}"
  fi
done
