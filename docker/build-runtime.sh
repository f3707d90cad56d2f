#!/usr/bin/env bash
# Packages an already-built `hearth` binary as an image with docker/Dockerfile.runtime,
# from a temporary context holding only the binary and the health check (the repository
# with its models and target/ never goes to the daemon).
#
#   docker/build-runtime.sh [--base IMAGE] [--tag TAG] [BINARY]
#
#   BINARY   default: ${CARGO_TARGET_DIR:-target}/release/hearth
#   --tag    default: hearth:latest
#   --base   default: debian:bookworm-slim (pulled); hearth-base:bookworm is the local one
#            docker/base/make-base.sh makes without a registry
#
# Prints the tag on success.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

die() { echo "build-runtime: $*" >&2; exit 1; }

base=debian:bookworm-slim
tag=hearth:latest
binary=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --tag) tag="${2:?--tag needs a tag}"; shift 2 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$binary" ] || die "one binary only"; binary="$1"; shift ;;
  esac
done
if [ -z "$binary" ]; then
  target="${CARGO_TARGET_DIR:-$root/target}"
  binary="$target/release/hearth"
fi
[ -f "$binary" ] || die "no hearth binary at $binary (cargo build --release -p hearth, or give its path)"
command -v docker >/dev/null 2>&1 || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the Docker daemon (is it running, and may $(id -un) use it?)"

ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
cp "$here/Dockerfile.runtime" "$here/healthcheck.sh" "$ctx/"
chmod 755 "$ctx/healthcheck.sh"
# The release profile keeps line tables for backtraces; the image need not carry them.
if command -v strip >/dev/null 2>&1; then
  strip --strip-debug -o "$ctx/hearth" "$binary"
else
  cp "$binary" "$ctx/hearth"
fi
chmod 755 "$ctx/hearth"

echo "build-runtime: building $tag on $base from $binary" >&2
docker build -f "$ctx/Dockerfile.runtime" --build-arg "BASE=$base" -t "$tag" "$ctx" >&2 || die "docker build failed (output above)"
echo "$tag"
