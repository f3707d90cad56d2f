#!/usr/bin/env bash
# What a Vulkan build of hearth needs on Debian/Ubuntu, and a Vulkan device to test it on
# without a GPU: the Vulkan loader and headers, glslc and the SPIR-V headers (ggml's
# shaders are compiled at build time), and Mesa's lavapipe (`mesa-vulkan-drivers`), a
# conformant Vulkan device that runs on the CPU.
# The pinned ggml uses VK_EXT_layer_settings, whose C++ bindings arrived in Vulkan headers
# 1.3.261; where the system's are older (Debian 12 has 1.3.239) the headers of Debian 13's
# libvulkan-dev are unpacked into a cache folder (headers only: nothing is installed from
# it). Prints the folder to put on CPLUS_INCLUDE_PATH, or nothing when the system's do.
# Idempotent and quiet when everything is there.
set -euo pipefail

missing=()
for pkg in mesa-vulkan-drivers libvulkan-dev glslc spirv-headers; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "vulkan-setup: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Asks the compiler, so headers wherever it looks for them count.
if echo '#include <vulkan/vulkan.hpp>' | c++ -std=c++17 -E -x c++ - 2>/dev/null | grep -q "LayerSettingEXT"; then
  exit 0
fi
cache="${XDG_CACHE_HOME:-$HOME/.cache}/hearth-vulkan-headers"
if ! grep -qs "LayerSettingEXT" "$cache/include/vulkan/vulkan_structs.hpp"; then
  echo "vulkan-setup: the system's Vulkan headers are too old for ggml; unpacking Debian 13's into $cache" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/parts"
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\n' > "$work/parts/trixie.sources"
  apt_opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts" -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq >/dev/null
  (cd "$work" && apt-get "${apt_opts[@]}" download libvulkan-dev >/dev/null 2>&1)
  dpkg-deb -x "$work"/libvulkan-dev_*.deb "$work/root"
  # The package's own layout puts its headers under usr/include.
  headers=$(find "$work/root" -type f -name vulkan.hpp -printf '%h\n' -quit)
  rm -rf "$cache"
  mkdir -p "$cache/include"
  cp -a "$(dirname "$headers")/." "$cache/include/"
fi
echo "$cache/include"
