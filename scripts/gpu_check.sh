#!/usr/bin/env bash
# The device check in one command of under 8 minutes on one NVIDIA GPU, without Ray and without network:
# environment, bandwidth and bf16 ceilings, parity with transformers in bf16, an 8B-shaped model's decode and
# prefill against a roofline, bf16 token identity, and NIXL and gRPC between two processes on the GPU
# (scripts/gpu_check.py says what each check does). The report goes to $OUT (or a fresh temporary folder):
# gpu_check.md, gpu_check.json and this run's log. From the repository root:
#   bash scripts/gpu_check.sh            # on the GPU machine
#   bash scripts/gpu_check.sh --cpu      # the same checks on the CPU at toy sizes (a dry run)
# Wheels under .whl/ (NIXL, protobuf: docs/development.md) are installed first into /tmp/pdserve-site.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu-check.XXXXXX")}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdserve-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/pdserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONUNBUFFERED=1
timeout --kill-after=10 465 python3 scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
