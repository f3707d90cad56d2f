#!/usr/bin/env bash
# Makes hearth's runtime base image without any container registry: a minimal Debian
# bookworm root filesystem (debootstrap --variant=minbase, from the Debian mirror) with
# the libraries the `hearth` binary links against, then `docker import`. For machines
# whose Docker cannot pull images; docker/Dockerfile.runtime builds on it
# (BASE=hearth-base:bookworm).
#
#   docker/base/make-base.sh [TAG]          (default: hearth-base:bookworm)
#
# Idempotent: an image with TAG made from the same recipe is kept as it is. The root
# filesystem is cached as a tarball in $HEARTH_DOCKER_CACHE (default
# ~/.cache/hearth-docker), so a removed image is imported again in seconds, without root
# and without the network. Debootstrap (only when the tarball is missing) needs root, the
# `debootstrap` package and the mirror ($HEARTH_DEBIAN_MIRROR, default
# http://deb.debian.org/debian). Prints the tag on success; exits with 2 when a
# prerequisite is missing (Docker, or root and debootstrap for the first run), 1 on
# other failures.
#
# What goes in: `ldd hearth` on a CPU build lists libgomp.so.1 (llama.cpp's OpenMP),
# libstdc++.so.6, libgcc_s.so.1 and libc's libraries (libc6, in minbase already).
# No curl: the images' HEALTHCHECK (docker/healthcheck.sh) speaks HTTP with bash's
# /dev/tcp, and bash is in minbase; curl would bring libcurl4 and 15 more packages
# (TLS, LDAP, SSH, Kerberos: measured +11 MB, and most of the security updates such an
# image would get) for one GET.
# No ca-certificates: hearth opens no TLS connection.
set -euo pipefail

TAG="${1:-hearth-base:bookworm}"
SUITE=bookworm
PACKAGES=(libgomp1 libstdc++6 libgcc-s1 libc6)
MIRROR="${HEARTH_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${HEARTH_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
CACHE="${HEARTH_DOCKER_CACHE:-$HOME/.cache/hearth-docker}"
# Bump when what goes into the root filesystem changes: images and tarballs of another
# recipe are made again.
RECIPE_VERSION=1

die() { echo "make-base: $*" >&2; exit 1; }
missing() { echo "make-base: $*" >&2; exit 2; }
say() { echo "make-base: $*" >&2; }

command -v docker >/dev/null 2>&1 || missing "docker is not installed"
docker info >/dev/null 2>&1 || missing "cannot talk to the Docker daemon (is it running, and may $(id -un) use it?)"

arch="$(dpkg --print-architecture 2>/dev/null || true)"
if [ -z "$arch" ]; then
  case "$(uname -m)" in
    x86_64) arch=amd64 ;;
    aarch64) arch=arm64 ;;
    *) die "unsupported machine $(uname -m)" ;;
  esac
fi
recipe="$(printf '%s\n' "$RECIPE_VERSION" "$SUITE" "$arch" "${PACKAGES[@]}" | sha256sum | cut -c1-12)"
label="org.hearth.base-recipe"

existing="$(docker image inspect --format "{{ index .Config.Labels \"$label\" }}" "$TAG" 2>/dev/null || true)"
if [ "$existing" = "$recipe" ]; then
  say "$TAG is there already"
  echo "$TAG"
  exit 0
fi

mkdir -p "$CACHE"
tarball="$CACHE/hearth-base-$SUITE-$arch-$recipe.tar"
# Two runs at once (two test binaries, two terminals) would debootstrap twice.
exec 9>"$CACHE/.make-base.lock"
flock 9

work=""
cleanup() {
  [ -n "$work" ] && [ -d "$work" ] || return 0
  # debootstrap mounts /proc and /sys inside the target while it runs and a failed run can
  # leave them mounted: unmount them (deepest first) before deleting anything.
  awk -v w="$work/" 'index($2, w) == 1 { print $2 }' /proc/self/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

if [ ! -f "$tarball" ]; then
  [ "$(id -u)" -eq 0 ] || missing "the base root filesystem is not cached yet ($tarball) and debootstrap needs root: run this script as root (sudo $0)"
  command -v debootstrap >/dev/null 2>&1 || missing "debootstrap is not installed (apt-get install debootstrap)"
  work="$(mktemp -d "$CACHE/.work.XXXXXX")"
  rootfs="$work/rootfs"
  say "debootstrap $SUITE ($arch, minbase + ${PACKAGES[*]}) from $MIRROR (a few minutes, once)"
  include="$(IFS=,; echo "${PACKAGES[*]}")"
  debootstrap --variant=minbase --arch="$arch" --include="$include" "$SUITE" "$rootfs" "$MIRROR" > "$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2
    [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -20 "$rootfs/debootstrap/debootstrap.log" >&2
    die "debootstrap failed (log above)"
  }

  # debootstrap takes packages from the release suite only: security fixes since the last
  # point release come from the security and updates suites.
  cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  say "applying $SUITE-updates and $SUITE-security"
  {
    chroot "$rootfs" apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get -y -q -o Dpkg::Options::=--force-confold upgrade
  } > "$work/upgrade.log" 2>&1 || { tail -20 "$work/upgrade.log" >&2; die "the security upgrade in the new root filesystem failed (log above)"; }

  # Later `apt-get install`s in images built on this one stay as small (what
  # debian:bookworm-slim does) and leave no package lists behind.
  cat > "$rootfs/etc/dpkg/dpkg.cfg.d/hearth-minimal" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  cat > "$rootfs/etc/apt/apt.conf.d/hearth-minimal" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOF

  # Docker provides /dev, /proc, /sys, resolv.conf, hosts and hostname at run time.
  find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/usr/share/lintian \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old \
    "$rootfs"/debootstrap "$rootfs"/dev/* "$rootfs"/tmp/* "$rootfs"/var/tmp/*
  find "$rootfs/var/log" -type f -delete
  : > "$rootfs/etc/resolv.conf"
  : > "$rootfs/etc/hostname"
  : > "$rootfs/etc/machine-id"

  tar --numeric-owner --xattrs -C "$rootfs" -cf "$work/rootfs.tar" .
  mv "$work/rootfs.tar" "$tarball"
  say "cached the root filesystem in $tarball ($(( $(stat -c %s "$tarball") >> 20 )) MiB)"
fi

old="$(docker image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)"
say "importing $tarball as $TAG"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  --change "LABEL $label=$recipe" \
  --message "hearth base: debootstrap --variant=minbase $SUITE + ${PACKAGES[*]}" \
  "$tarball" "$TAG" >/dev/null
# An image of an older recipe lost its tag to the new one: remove it unless still in use.
[ -z "$old" ] || docker image rm "$old" >/dev/null 2>&1 || true
echo "$TAG"
