"""The generated protobuf modules in proto/ match the .proto files (``proto/generate.py --check``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"


def _check(proto_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(proto_dir / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=proto_dir.parent,
    )


def test_generated_modules_are_current() -> None:
    result = _check(PROTO_DIR)
    assert result.returncode == 0, f"run `python proto/generate.py`:\n{result.stdout}{result.stderr}"


def test_every_proto_has_its_modules() -> None:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, "no .proto files"
    for p in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert (PROTO_DIR / (p.stem + suffix)).is_file(), f"missing {p.stem + suffix}"


@pytest.fixture
def proto_copy(tmp_path: Path) -> Path:
    """A copy of proto/ (sources, generated modules, the script) to break on purpose."""
    dst = tmp_path / PROTO_DIR.name  # the folder name is the import package name
    shutil.copytree(PROTO_DIR, dst, ignore=shutil.ignore_patterns("__pycache__"))
    assert _check(dst).returncode == 0
    return dst


def test_check_fails_on_an_edited_module(proto_copy: Path) -> None:
    module = proto_copy / "kv_transfer_pb2_grpc.py"
    module.write_text(module.read_text().replace("from pdserve.proto import", "import", 1))
    result = _check(proto_copy)
    assert result.returncode != 0 and "kv_transfer_pb2_grpc.py: stale" in result.stderr


def test_check_fails_when_the_proto_changed(proto_copy: Path) -> None:
    proto = proto_copy / "kv_transfer.proto"
    text = proto.read_text()
    proto.write_text(text.replace("message PushAck {", "message PushAck {\n  uint32 extra = 99;", 1))
    result = _check(proto_copy)
    assert result.returncode != 0 and "kv_transfer_pb2.py: stale" in result.stderr


def test_check_fails_on_missing_and_orphaned_modules(proto_copy: Path) -> None:
    (proto_copy / "kv_transfer_pb2.pyi").unlink()
    (proto_copy / "gone_pb2.py").write_text("# left over\n")
    result = _check(proto_copy)
    assert result.returncode != 0
    assert "kv_transfer_pb2.pyi: missing" in result.stderr
    assert "gone_pb2.py: no matching .proto" in result.stderr
