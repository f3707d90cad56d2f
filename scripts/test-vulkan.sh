#!/usr/bin/env bash
# The GPU path on a real Vulkan device without a GPU: builds hearth with the
# `vulkan` feature and runs the accelerator tests on Mesa's lavapipe, which ggml-vulkan
# lists only when GGML_VK_VISIBLE_DEVICES names it. The tests fail, rather than skip,
# when no accelerator is seen. The build shares the CPU build's target directory: cargo
# keeps both feature sets' artifacts apart, so only llama.cpp (with its Vulkan backend)
# and hearth's own crates compile again, not the ~250 dependencies and HiGHS (a directory
# of its own cost CI a full second build: 27 minutes of its 90 on a cold machine). The
# `hearth` binary in target/release is the last build's; cargo puts the CPU one back on
# the next CPU build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
include=$(scripts/vulkan-setup.sh)
if [ -n "$include" ]; then
  export CPLUS_INCLUDE_PATH="$include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/hearth-target}"
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
export HEARTH_REQUIRE_ACCELERATOR=1
# One test at a time: several tests opening the Vulkan device at once in one process
# crashed (SIGSEGV) on lavapipe; hearth itself opens it from one thread.
export RUST_TEST_THREADS=1
exec cargo test --release -p hearth-engine -p hearth-system-tests --features hearth/vulkan --no-fail-fast --test accelerator --test gpu "$@"
