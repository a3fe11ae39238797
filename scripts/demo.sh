#!/usr/bin/env bash
# Fresh machine -> the main job: installs everything, starts a local Ray deployment of SmolLM2-135M-Instruct,
# puts a few questions to it in every mode, runs a short A/B benchmark (tiny preset), stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
pdserve demo "$@"
