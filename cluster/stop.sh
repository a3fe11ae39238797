#!/usr/bin/env bash
# Run on the head node (through `ray exec`): stops the `pdserve serve` that cluster/start.sh started.
# SIGTERM lets it stop its workers and leave the cluster; after 60 s it is killed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f logs/serve.pid ]; then
  echo "stop.sh: nothing to stop (no logs/serve.pid)"
  exit 0
fi
pid=$(cat logs/serve.pid)
if kill -TERM "$pid" 2>/dev/null; then
  for _ in $(seq 120); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "stop.sh: pid $pid still running after 60 s; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
fi
rm -f logs/serve.pid
echo "stop.sh: stopped (pid $pid)"
