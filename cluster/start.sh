#!/usr/bin/env bash
# Run on the head node of a cluster started with `ray up` (through `ray exec`): serves in the background
# and returns once the router listens, so `ray exec` does not hold the terminal.
#   bash ~/pdserve/cluster/start.sh [--wait-nodes N] [pdserve serve arguments...]
# --wait-nodes N first waits (up to 300 s) until N nodes are alive and lists them with their roles.
# Then `pdserve serve --address auto ARGS` starts detached (nohup, its own session): log in
# ~/pdserve/logs/serve.log, pid in ~/pdserve/logs/serve.pid. Prints the "pdserve listening" line and
# exits 0, or prints the log's tail and exits 1 if serve exits or does not listen within 300 s.
# cluster/stop.sh stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
wait_nodes=0
if [ "${1:-}" = "--wait-nodes" ]; then
  wait_nodes=$2
  shift 2
fi
mkdir -p logs
if [ -f logs/serve.pid ] && kill -0 "$(cat logs/serve.pid)" 2>/dev/null; then
  echo "start.sh: already serving (pid $(cat logs/serve.pid)); cluster/stop.sh stops it" >&2
  exit 1
fi
if [ "$wait_nodes" -gt 0 ]; then
  python -m pdserve.placement --wait-nodes "$wait_nodes" --timeout 300
fi
nohup setsid pdserve serve --address auto "$@" >logs/serve.log 2>&1 </dev/null &
pid=$!
echo "$pid" >logs/serve.pid
for _ in $(seq 600); do
  if grep -m1 "pdserve listening" logs/serve.log; then
    echo "start.sh: serving in the background (pid $pid, log $PWD/logs/serve.log)"
    exit 0
  fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
echo "start.sh: pdserve serve did not come up; the end of $PWD/logs/serve.log:" >&2
tail -n 30 logs/serve.log >&2
kill "$pid" 2>/dev/null || true
rm -f logs/serve.pid
exit 1
