#!/usr/bin/env bash
# Fresh machine -> the whole test suite: installs everything, lints, type-checks, then runs pytest.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --quick    leaves out the tests that start Ray clusters (marked cluster / ray_up)
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then args+=(-m "not cluster and not ray_up"); else args+=("$arg"); fi
done
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
python proto/generate.py --check
python -m pytest -q ${args[@]+"${args[@]}"}
