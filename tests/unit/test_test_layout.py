"""The test folders run in one pytest session (rootdir imports, no packages): a test file's name must be unique
across them, or collection stops with an import-file mismatch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_FOLDERS = ("tests/unit", "tests/e2e", "benchmarks/tests")


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for folder in TEST_FOLDERS for p in (REPO / folder).glob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
