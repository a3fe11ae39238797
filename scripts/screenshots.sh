#!/usr/bin/env bash
# Refreshes the explorer screenshots that the docs show (docs/explorer/*.png) by running the browser
# tests that take them (headless Chromium; about 2 minutes on a 2-core machine). Ordinary test runs
# write them under results/explorer/ and leave the tracked images alone.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
PDSERVE_SCREENSHOTS="$PWD/docs/explorer" python -m pytest -q tests/e2e/test_explorer.py -k in_the_browser "$@"
git status --short docs/explorer
