#!/bin/bash
# x86-64 CPU variants of the hearth image: one build of llama.cpp's CPU kernels per
# instruction-set level, the best one picked when the container starts. A
# plain build compiles llama.cpp for AVX2/FMA/F16C (ggml's default with GGML_NATIVE off),
# which dies with SIGILL on the older desktops homes still run (no AVX2 before Intel's
# 2013 and AMD's 2015 CPUs) and leaves AVX-512 unused where a CPU has it. ggml's own
# answer (GGML_BACKEND_DL with every variant as a loadable module) needs its CPU backend
# reached through the backend registry only, where hearth calls the CPU backend's
# functions directly; so the image carries whole builds instead, and this picks one.
# It runs as the image's entrypoint and execs hearth with argv[0] `hearth`, so the process
# looks as it did with one build (the health check finds it by that name).
#
#   cpu-variant.sh env NAME     GGML_* assignments that build variant NAME (for `env`)
#   cpu-variant.sh pick [DIR]   the best variant this CPU runs of those built in DIR
#                               (files hearth-NAME; default /usr/local/lib/hearth)
#   cpu-variant.sh exec [ARGS]  runs the picked build with ARGS (the image's entrypoint)
#
# Variants, named as ggml names its own: sse42 (any x86-64 since 2008), sandybridge (AVX,
# 2011), haswell (AVX2, FMA, F16C, BMI2: 2013/2015), skylakex (AVX-512 F/CD/VL/DQ/BW).
# HEARTH_CPUINFO (default /proc/cpuinfo) and HEARTH_VARIANTS_DIR are for tests.
set -eu

ALL="skylakex haswell sandybridge sse42"
dir="${HEARTH_VARIANTS_DIR:-/usr/local/lib/hearth}"

flags() {
  # The first processor's flags; every core of a home machine has the same.
  sed -n 's/^flags[[:space:]]*:[[:space:]]*//p' "${HEARTH_CPUINFO:-/proc/cpuinfo}" | head -n 1
}

# Whether the CPU has every instruction set variant $1 is compiled for.
runs() {
  case "$1" in
    skylakex) need="avx512f avx512cd avx512vl avx512dq avx512bw avx2 fma f16c bmi2 avx sse4_2" ;;
    haswell) need="avx2 fma f16c bmi2 avx sse4_2" ;;
    sandybridge) need="avx sse4_2" ;;
    sse42) need="sse4_2" ;;
    *) return 1 ;;
  esac
  have=" $(flags) "
  for f in $need; do
    case "$have" in *" $f "*) ;; *) return 1 ;; esac
  done
}

pick() {
  for v in $ALL; do
    if [ -x "$1/hearth-$v" ] && runs "$v"; then
      echo "$v"
      return 0
    fi
  done
  return 1
}

case "${1:-}" in
  env)
    # Explicit ONs and OFFs: unset ones default to AVX2 in ggml's CMake.
    case "${2:-}" in
      sse42) echo "GGML_SSE42=ON GGML_AVX=OFF GGML_AVX2=OFF GGML_FMA=OFF GGML_F16C=OFF GGML_BMI2=OFF GGML_AVX512=OFF" ;;
      sandybridge) echo "GGML_SSE42=ON GGML_AVX=ON GGML_AVX2=OFF GGML_FMA=OFF GGML_F16C=OFF GGML_BMI2=OFF GGML_AVX512=OFF" ;;
      haswell) echo "GGML_SSE42=ON GGML_AVX=ON GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON GGML_BMI2=ON GGML_AVX512=OFF" ;;
      skylakex) echo "GGML_SSE42=ON GGML_AVX=ON GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON GGML_BMI2=ON GGML_AVX512=ON" ;;
      *) echo "cpu-variant: unknown variant '${2:-}' (one of: $ALL)" >&2; exit 2 ;;
    esac
    ;;
  pick)
    pick "${2:-$dir}" || { echo "cpu-variant: no build in ${2:-$dir} runs on this CPU (flags: $(flags))" >&2; exit 1; }
    ;;
  exec)
    shift
    # A single build (a GPU image, or a non-x86 one) is used as it is.
    if [ -x "$dir/hearth" ]; then
      exec -a hearth "$dir/hearth" "$@"
    fi
    v=$(pick "$dir") || { echo "hearth: none of this image's CPU builds runs on this CPU (it lacks SSE4.2?); flags: $(flags)" >&2; exit 1; }
    exec -a hearth "$dir/hearth-$v" "$@"
    ;;
  *)
    echo "usage: cpu-variant.sh env NAME | pick [DIR] | exec [ARGS...]" >&2
    exit 2
    ;;
esac
