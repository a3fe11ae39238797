#!/usr/bin/env bash
# Fresh machine -> the main job: installs everything, starts a local Ray deployment on the embedded
# model, sends requests in every mode, runs a short A/B benchmark, stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
pdserve demo "$@"
