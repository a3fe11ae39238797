"""The device check's dry run: every check of scripts/gpu_check.sh on the CPU at toy sizes, without Ray and
the other packages the GPU machine lacks, writing its report; what the GPU run would do, minus the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MISSING_ON_THE_GPU_MACHINE = "ray,fastapi,uvicorn,grpc_health,grpc_reflection,openai"


def _dry_run(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
    return result, report


def test_the_dry_run_runs_every_check_without_ray_and_reports(tmp_path):
    result, report = _dry_run(tmp_path, "--forbid-imports", MISSING_ON_THE_GPU_MACHINE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [
        "environment", "ceilings", "parity", "quantized", "speed", "identity", "release", "nixl", "grpc"
    ]  # fmt: skip
    statuses = {name: c["status"] for name, c in checks.items()}
    assert statuses == {
        **dict.fromkeys(("environment", "ceilings", "parity", "quantized", "identity", "nixl", "grpc"), "PASS"),
        "speed": "INFO",
        "release": "INFO",
    }, {name: c["summary"] for name, c in checks.items()}
    speed = checks["speed"]["details"]
    assert set(speed["decode"]) == {"1", "16", "64"} and set(speed["prefill"]) == {"512", "2048"}
    for entry in [*speed["decode"].values(), *speed["prefill"].values()]:
        assert entry["wall_ms"] > 0 and entry["floor_ms"] > 0
    assert speed["decode"]["16"]["kernels_per_step"]["operators"] > 0
    for llama_or_qwen in checks["parity"]["details"].values():
        assert llama_or_qwen["max_abs_logit_error_engine_vs_fp32"] > 0 and len(llama_or_qwen["tokens_engine"]) == 8
    assert set(checks["identity"]["details"]) == {"alone", "batched", "chunks_of_64"}
    for kind in ("nixl", "grpc"):
        transfer = checks[kind]["details"]
        assert transfer["checksums_equal"] and transfer["blocks_outside_untouched"] and transfer["GBps"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| grpc | PASS |" in table and (tmp_path / "gpu_check.log").read_text().count("PASS") >= 7


def test_a_missing_package_skips_its_check_and_the_rest_still_run(tmp_path):
    only = ("--only", "environment", "quantized", "nixl")
    result, report = _dry_run(tmp_path, "--forbid-imports", f"{MISSING_ON_THE_GPU_MACHINE},gguf,nixl", *only)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    statuses = {c["name"]: (c["status"], c["summary"]) for c in report["checks"]}
    assert statuses["quantized"] == (
        "SKIP",
        "gguf is not installed: carry its wheel (docs/development.md, The device check)",
    )
    assert statuses["nixl"][0] == "SKIP" and statuses["environment"][0] == "PASS"
