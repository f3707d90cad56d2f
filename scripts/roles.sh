# Sourced by the benchmark scripts, from the repository root: start hearth roles (serve,
# worker) in the background on loopback and stop them all at exit. HEARTH is the release
# `hearth-lab` binary (`hearth` with the settings benchmarks use), MODEL the default model
# (fetched if missing).
HEARTH="${CARGO_TARGET_DIR:-target}/release/hearth-lab"
MODEL="$(scripts/fetch-model.sh)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap cleanup EXIT

# Starts a hearth role (with $SPIN as GOMP_SPINCOUNT when set) and sets ADDR to the
# address it announces. Not called in $(...): the process must stay ours.
start() {
  local log; log="$(mktemp)"
  if [ -n "${SPIN:-}" ]; then
    GOMP_SPINCOUNT="$SPIN" "$HEARTH" "$@" --model "$MODEL" 2>"$log" &
  else
    "$HEARTH" "$@" --model "$MODEL" 2>"$log" &
  fi
  PIDS+=($!)
  for _ in $(seq 1 600); do
    local addr; addr="$(grep -oE 'listening on (http://)?[0-9.]+:[0-9]+' "$log" | grep -oE '[0-9.]+:[0-9]+' | head -1 || true)"
    if [ -n "$addr" ]; then ADDR="$addr"; return; fi
    if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "$0: hearth $* did not start:" >&2; cat "$log" >&2; exit 1
}
