#!/usr/bin/env bash
# Runs every test of the workspace, installing missing build prerequisites first, then the
# GPU path on Mesa's lavapipe (a real Vulkan device that runs on the CPU; scripts/test-vulkan.sh,
# the same target directory with the `vulkan` feature). One profile (release) and the whole workspace at once:
# building a single member, or a second profile, would compile llama.cpp again.
# HEARTH_SKIP_VULKAN=1 leaves the Vulkan tests out; HEARTH_REQUIRE_VULKAN=1 (CI) fails where
# they cannot run instead of skipping them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
status=0
# Where the time goes, in CI's log too (CI has 90 minutes for all of it).
phase() { echo "test: $1 at $((SECONDS / 60)) min $((SECONDS % 60)) s" >&2; }
phase "build"
cargo test --release --workspace --no-run "$@" || status=$?
phase "CPU tests"
# Every test's seconds (scripts/test-timer.sh runs each test binary): the slowest are
# listed at the end, so a run shows where its time goes.
export HEARTH_TEST_TIMES="${HEARTH_TEST_TIMES:-$(mktemp -t hearth-test-times.XXXXXX)}"
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/test-timer.sh"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$PWD/scripts/test-timer.sh"
cargo test --release --workspace --no-fail-fast "$@" || status=$?
phase "Vulkan build and tests"
if [ "${HEARTH_SKIP_VULKAN:-0}" = 1 ]; then
  echo "test: Vulkan tests skipped (HEARTH_SKIP_VULKAN=1)" >&2
elif command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  scripts/test-vulkan.sh || status=$?
elif [ "${HEARTH_REQUIRE_VULKAN:-0}" = 1 ]; then
  echo "test: the Vulkan tests need Debian/Ubuntu packages (apt) and cannot run here" >&2
  status=1
else
  echo "test: Vulkan tests skipped: they install Debian/Ubuntu packages (apt)" >&2
fi
phase "done"
if [ -s "$HEARTH_TEST_TIMES" ]; then
  echo "test: the 15 slowest of $(wc -l <"$HEARTH_TEST_TIMES") tests (seconds, result, binary::test):" >&2
  # sed reads all of sort's output: `head` would close the pipe early, sort would die of
  # SIGPIPE, and pipefail would turn a green run into exit 141.
  sort -t$'\t' -k1,1 -rn "$HEARTH_TEST_TIMES" | sed -n '1,15s/^/  /p' >&2 || true
fi
exit "$status"
