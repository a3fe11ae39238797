"""One import root: the wheel installs `pdserve` and nothing else, and the client needs neither Ray nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    leftover = REPO / "build"
    had_build = leftover.exists()
    built = subprocess.run(
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
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    ours = [line for line in built.stderr.splitlines() if "Warning" in line and "Location 'file:" not in line]
    assert ours == [], "the packaging config makes setuptools warn:\n" + "\n".join(ours)
    if not had_build:  # setuptools stages the wheel in <repo>/build
        shutil.rmtree(leftover, ignore_errors=True)
    [wheel] = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith((".dist-info", ".data"))} == {"pdserve"}
    parts = ("engine", "router", "prefill_node", "decode_node", "kv_transfer", "bench", "workload", "sim", "cli")
    for part in (*parts, "explorer"):
        assert f"pdserve/{part}/__init__.py" in names, part
    lab_scripts = {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    assert lab_scripts and not [n for n in names if Path(n).stem in lab_scripts], "a lab script is in the wheel"
    assert {"pdserve/proto/pdserve.proto", "pdserve/proto/pdserve_pb2.py", "pdserve/messages.py"} <= set(names)
    page = {f"pdserve/explorer/static/{f}" for f in ("index.html", "explorer.js", "explorer.css")}
    assert page <= set(names)  # the explorer's page ships in the package


def heavy_modules_after(imports: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of the ``heavy`` top-level modules a fresh Python process has loaded after running ``imports``."""
    loaded = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r})"
    code = f"import json, sys\n{imports}\nprint(json.dumps({loaded}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_client_imports_without_ray_or_torch() -> None:
    imports = "import pdserve, pdserve.router.client\nfrom pdserve import Client, SamplingParams"
    assert heavy_modules_after(imports, ("torch", "ray", "numpy")) == []


def test_the_processes_that_hold_worker_handles_load_no_torch() -> None:
    # Ray loads an actor's class wherever a handle to it is deserialised: the router, and `pdserve serve`
    # that builds the deployment, load both worker classes, and torch would cost each ~0.2 GB of memory.
    imports = (
        "import pdserve.cli.main, pdserve.deployment, pdserve.router.process\n"
        "from pdserve.decode_node.worker import DecodeWorker\n"
        "from pdserve.prefill_node.worker import PrefillWorker\n"
        "from pdserve.transport_config import GrpcConfig\n"
        "GrpcConfig(secret='s')"
    )
    assert heavy_modules_after(imports, ("torch",)) == []
    assert heavy_modules_after("import pdserve.engine.llm_engine", ("torch",)) == ["torch"]  # the check sees it


PARTS = ("engine", "kv_transfer", "prefill_node", "decode_node", "router", "proto", "sim")


def test_every_part_is_a_folder_of_the_package_and_the_top_level_names_link_to_it() -> None:
    for part in PARTS:
        folder = REPO / "pdserve" / part
        assert folder.is_dir() and not folder.is_symlink(), part
        link = REPO / part
        assert link.is_symlink() and link.resolve() == folder.resolve(), part
    edits = [
        str(path.relative_to(REPO))
        for path in (REPO / "pdserve").rglob("*.py")
        if "__path__" in path.read_text() and path.name != "generate.py"
    ]
    assert edits == [], f"__path__ edited in {edits}"


def test_the_repository_root_on_sys_path_shadows_nothing() -> None:
    """``python -c`` from the root puts the root first on ``sys.path``, as pytest and a static editable install do."""
    code = (
        "import importlib, sys\n"
        "import proto  # proto-plus's (Ray depends on it), not our proto/ folder\n"
        "assert hasattr(proto, 'Message') and 'pdserve_pb2' not in dir(proto), proto\n"
        f"for part in {PARTS!r}:\n"
        "    try:\n"
        "        importlib.import_module(part if part != 'proto' else 'proto.pdserve_pb2')\n"
        "    except ImportError:\n"
        "        continue\n"
        "    sys.exit(f'{part} imported as a second copy of pdserve.{part}')\n"
        "import pdserve.engine.config as config\n"
        "assert sys.modules['pdserve.engine.config'] is config\n"
        "assert 'engine.config' not in sys.modules and 'pdserve.pdserve' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout


def test_a_script_beside_a_clone_named_pdserve_imports_the_package(tmp_path: Path) -> None:
    (tmp_path / "pdserve").symlink_to(REPO)  # the folder a `git clone .../pdserve` makes
    code = "import pdserve; from pdserve import Client; print(pdserve.__file__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == (REPO / "pdserve" / "__init__.py").resolve()
