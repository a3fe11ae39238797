#!/usr/bin/env python
"""Regenerate the Python modules of every ``.proto`` file in ``proto/``.

For each ``proto/<name>.proto`` this writes ``<name>_pb2.py``, ``<name>_pb2_grpc.py`` and
``<name>_pb2.pyi`` next to it, using ``grpc_tools.protoc``. protoc emits flat imports between
generated modules (``import kv_transfer_pb2 as kv__transfer__pb2``), which only work with
``proto/`` itself on ``sys.path``; they are rewritten to package imports
(``from pdserve.proto import kv_transfer_pb2 as kv__transfer__pb2``) so that the modules import as
``from pdserve.proto import x_pb2`` from the repository root or an installed package.

Usage::

    python proto/generate.py           # regenerate in place
    python proto/generate.py --check   # regenerate into a temp dir and compare; exit 1 if stale

``--check`` fails when a generated module differs from what the ``.proto`` files produce, when
one is missing, or when a ``*_pb2*`` module has no ``.proto`` left behind it.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "pdserve.proto"  # generated modules are imported as `from pdserve.proto import x_pb2`
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
_FLAT_IMPORT = re.compile(r"^import (?P<mod>\w+_pb2)(?P<alias> as \w+)?$", re.MULTILINE)


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """All ``.proto`` files directly in ``proto_dir``, sorted by name."""
    return sorted(proto_dir.glob("*.proto"))


def expected_outputs(protos: list[Path]) -> list[str]:
    """File names that generating ``protos`` must produce."""
    return sorted(p.stem + suffix for p in protos for suffix in SUFFIXES)


def _fix_imports(text: str, local_modules: set[str]) -> str:
    """Turn flat imports of sibling generated modules into ``from <package> import ...``."""

    def repl(m: re.Match[str]) -> str:
        if m.group("mod") not in local_modules:
            return m.group(0)
        return f"from {PACKAGE} import {m.group('mod')}{m.group('alias') or ''}"

    return _FLAT_IMPORT.sub(repl, text)


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on every ``.proto`` in ``proto_dir``, writing the fixed modules into ``out_dir``.

    Returns the written files. Raises ``RuntimeError`` if protoc fails or a module is missing.
    """
    import importlib.resources

    from grpc_tools import protoc

    protos = proto_files(proto_dir)
    if not protos:
        raise RuntimeError(f"no .proto files in {proto_dir}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="pdserve-protoc-") as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *[p.name for p in protos],
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        local_modules = {p.stem + "_pb2" for p in protos}
        written: list[Path] = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in expected_outputs(protos):
            src = Path(raw) / name
            if not src.is_file():
                raise RuntimeError(f"protoc did not produce {name}")
            dst = out_dir / name
            dst.write_text(_fix_imports(src.read_text(), local_modules))
            written.append(dst)
    return written


def check(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Compare the committed modules in ``proto_dir`` with a fresh generation.

    Returns a list of problems (empty when everything is current).
    """
    problems: list[str] = []
    protos = proto_files(proto_dir)
    expected = set(expected_outputs(protos))
    with tempfile.TemporaryDirectory(prefix="pdserve-proto-check-") as tmp:
        generate(Path(tmp), proto_dir)
        for name in sorted(expected):
            fresh = (Path(tmp) / name).read_text()
            committed_path = proto_dir / name
            if not committed_path.is_file():
                problems.append(f"{name}: missing (run python proto/generate.py)")
                continue
            committed = committed_path.read_text()
            if committed != fresh:
                diff = "".join(
                    list(
                        difflib.unified_diff(
                            committed.splitlines(keepends=True),
                            fresh.splitlines(keepends=True),
                            f"committed/{name}",
                            f"generated/{name}",
                            n=1,
                        )
                    )[:40]
                )
                problems.append(f"{name}: stale (run python proto/generate.py)\n{diff}")
    for suffix in SUFFIXES:
        for path in sorted(proto_dir.glob("*" + suffix)):
            if path.name not in expected:
                problems.append(f"{path.name}: no matching .proto (delete it or restore the .proto)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if any generated module is missing, stale or orphaned",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print(f"{len(problems)} generated module(s) out of date in {PROTO_DIR}", file=sys.stderr)
            return 1
        print(f"generated modules in {PROTO_DIR} are current")
        return 0
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
