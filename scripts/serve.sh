#!/usr/bin/env bash
# Builds hearth and starts the server; with no --model it serves the default model,
# fetching it into ./models on first use. Extra arguments go to `hearth serve`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
cargo build --release --workspace
exec "${CARGO_TARGET_DIR:-target}/release/hearth" serve "$@"
