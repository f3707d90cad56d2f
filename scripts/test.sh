#!/usr/bin/env bash
# Runs every test of the workspace, installing missing build prerequisites first.
# One profile (release) and the whole workspace at once: building a single member, or a
# second profile, would compile llama.cpp again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
exec cargo test --release --workspace --no-fail-fast "$@"
