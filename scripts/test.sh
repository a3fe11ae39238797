#!/usr/bin/env bash
# Fresh machine -> the test suite: installs everything, lints, type-checks, then runs pytest.
#   bash scripts/test.sh               tests/unit and tests/e2e (what CI runs)
#   bash scripts/test.sh --quick       tests/unit without the tests marked slow: no Ray, no server
#                                      processes (the quick loop; the full run has the slow ones)
#   bash scripts/test.sh --benchmarks  also the lab scripts' own tests (benchmarks/tests)
# Other arguments go to pytest (paths replace the default folders).
set -euo pipefail
cd "$(dirname "$0")/.."
folders=(tests/unit tests/e2e)
select=()
args=()
for arg in "$@"; do
  case "$arg" in
    --quick) folders=(tests/unit); select=(-m "not slow") ;;
    --benchmarks) folders+=(benchmarks/tests) ;;
    *) args+=("$arg") ;;
  esac
done
for arg in ${args[@]+"${args[@]}"}; do  # a path given: run that instead of the folders
  case "$arg" in -*) ;; *) if [ -e "${arg%%::*}" ]; then folders=(); fi ;; esac
done
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
python proto/generate.py --check
python -m pytest -q ${select[@]+"${select[@]}"} ${folders[@]+"${folders[@]}"} ${args[@]+"${args[@]}"}
