#!/bin/bash
# The HEALTHCHECK of the hearth images (installed as /usr/local/bin/hearth-healthcheck),
# in bash alone: the images carry no curl (docker/base/make-base.sh says why).
#
#   hearth-healthcheck serve    GET /health of `hearth serve` on 127.0.0.1:$HEARTH_PORT (8080)
#   hearth-healthcheck worker   a TCP connect to the port of $HEARTH_LISTEN (9090): a worker's
#                               port speaks authenticated HTTP/2 only and has no /health
#   hearth-healthcheck          whichever of the two this container runs
#
# Healthy means the process serves. /health answers 200 for `degraded` too (a worker of
# the ring is lost): the head re-forms the ring by itself when the worker returns, and a
# restarted head would not bring it back. The answer (status and reason) is printed, so
# `docker inspect` shows it under .State.Health.Log.
set -u

role="${1:-}"
if [ -z "$role" ]; then
  # The role from the running hearth's arguments (PID 1 is hearth itself, or an init
  # such as compose's `init: true` with hearth as its child).
  role=serve
  for cmdline in /proc/[0-9]*/cmdline; do
    args=()
    while IFS= read -r -d '' a; do args+=("$a"); done < "$cmdline" 2>/dev/null
    if [ "${#args[@]}" -ge 2 ] && [ "${args[0]##*/}" = hearth ]; then
      role="${args[1]}"
      break
    fi
  done
fi

case "$role" in
  worker)
    port="${HEARTH_LISTEN:-127.0.0.1:9090}"
    port="${port##*:}"
    if ! { exec 3<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null; then
      echo "nothing listens on port $port"
      exit 1
    fi
    echo "port $port accepts connections"
    ;;
  *)
    port="${HEARTH_PORT:-8080}"
    if ! { exec 3<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null; then
      echo "nothing listens on port $port"
      exit 1
    fi
    printf 'GET /health HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n\r\n' "$port" >&3
    if ! IFS=' ' read -r -t 5 _ code _ <&3; then
      echo "GET /health on port $port did not answer"
      exit 1
    fi
    body=""
    IFS= read -r -t 5 -d '' body <&3
    body="${body##*$'\r\n\r\n'}"
    echo "GET /health: $code $body"
    [ "$code" = 200 ] || exit 1
    ;;
esac
exit 0
