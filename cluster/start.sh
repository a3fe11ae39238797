#!/usr/bin/env bash
# Run on the head node of a cluster started with `ray up`: joins it and serves.
# Extra arguments go to `pdserve serve` (e.g. --mode auto --prefill-workers 1 --decode-workers 1).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec pdserve serve --address auto --host 0.0.0.0 "$@"
