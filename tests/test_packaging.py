"""One import root: the wheel installs `pdserve` and nothing else, and the client needs neither Ray nor torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    leftover = REPO / "build"
    had_build = leftover.exists()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    if not had_build:  # setuptools stages the wheel in <repo>/build
        shutil.rmtree(leftover, ignore_errors=True)
    [wheel] = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith((".dist-info", ".data"))} == {"pdserve"}
    parts = ("engine", "router", "prefill_node", "decode_node", "kv_transfer", "bench", "bench/sim", "cli", "explorer")
    for part in parts:
        assert f"pdserve/{part}/__init__.py" in names, part
    assert {"pdserve/proto/pdserve.proto", "pdserve/proto/pdserve_pb2.py", "pdserve/messages.py"} <= set(names)
    page = {f"pdserve/explorer/static/{f}" for f in ("index.html", "explorer.js", "explorer.css")}
    assert page <= set(names)  # the explorer's page ships in the package


def test_the_client_imports_without_ray_or_torch() -> None:
    code = (
        "import sys, pdserve, pdserve.router.client\n"
        "from pdserve import Client, SamplingParams\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'numpy'})\n"
        "sys.exit(f'imported {heavy}' if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert result.returncode == 0, result.stderr
