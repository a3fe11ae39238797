#!/usr/bin/env bash
# Fresh machine -> full test suite: installs everything, then runs pytest (fails when a test fails).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python proto/generate.py --check
python -m pytest -q "$@"
