#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build hearth: cmake (llama.cpp and
# HiGHS build with it) and libclang (bindgen generates the llama.cpp bindings). Python is
# needed to fetch the default model; the `openai` package drives the client tests and
# `schemathesis` the API conformance test.
# Idempotent and quiet when everything is there.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
# bindgen loads libclang.so / libclang-N.so; libclang-cpp (often preinstalled) is not it.
{ ldconfig -p 2>/dev/null | grep -Eq 'libclang(-[0-9.]+)?\.so'; } || { ls /usr/lib/llvm-*/lib/ 2>/dev/null | grep -Eq '^libclang(-[0-9.]+)?\.so'; } || missing+=(libclang-dev)
# Where Docker is, its test (tests/docker.rs) makes a base image with debootstrap.
if command -v docker >/dev/null 2>&1 && ! command -v debootstrap >/dev/null 2>&1 && [ ! -x /usr/sbin/debootstrap ]; then missing+=(debootstrap); fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is missing; install Rust from https://rustup.rs" >&2
  exit 1
fi
# The client libraries the SDK tests drive hearth with (tests/openai_sdk.rs, tests/client_sdks.rs).
for package in openai anthropic ollama; do
  if ! python3 -c "import $package" >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check "$package" >&2 || echo "setup: could not install the $package package; its client tests will fail" >&2
  fi
done
# The agent CLIs tests/agent_clis.rs drives, Claude Code and Codex CLI: their binaries come
# inside these packages, pinned to the versions whose flags and config keys the test sets.
for package in claude-agent-sdk==0.2.190 openai-codex==0.163.0; do
  if ! python3 -c "import importlib.metadata as m; assert m.version('${package%%==*}') == '${package##*==}'" >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check "$package" >&2 || echo "setup: could not install $package; tests/agent_clis.rs will fail" >&2
  fi
done
# Schemathesis checks the live API against its OpenAPI document (tests/schemathesis.rs).
if ! command -v schemathesis >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check schemathesis >&2 || echo "setup: could not install schemathesis; the API conformance test will be skipped" >&2
fi
