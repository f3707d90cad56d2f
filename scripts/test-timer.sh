#!/usr/bin/env bash
# cargo's test runner for scripts/test.sh: runs one test binary with libtest's per-test
# times and appends each finished test with its seconds to $HEARTH_TEST_TIMES, from which
# the run ends with its slowest tests. `--report-time` is an unstable libtest option;
# RUSTC_BOOTSTRAP lets a test binary built by stable Rust accept it when it starts (it is
# read at run time, so nothing is compiled differently).
set -uo pipefail
bin=$1
shift
times=${HEARTH_TEST_TIMES:-/dev/null}
name=$(basename "$bin")
name=${name%-*}
RUSTC_BOOTSTRAP=1 "$bin" "$@" -Z unstable-options --report-time 2>&1 |
  tee >(sed -nE "s/^test (.+) \.\.\. (ok|FAILED) <([0-9.]+)s>.*$/\3\t\2\t${name}::\1/p" >>"$times")
exit "${PIPESTATUS[0]}"
