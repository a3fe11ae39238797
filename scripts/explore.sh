#!/usr/bin/env bash
# Fresh machine -> the explorer: installs everything, starts a local deployment (1 prefill + 1 decode
# worker, auto mode, the tiny preset) with the explorer page on http://127.0.0.1:8088/ until Ctrl-C.
# Extra arguments go to `pdserve serve` (e.g. --model smollm2, --explorer-port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec pdserve serve --mode auto --prefill-workers 1 --decode-workers 1 --explorer-port 8088 "$@"
