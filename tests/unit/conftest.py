"""The quick loop's rule: no unit test starts Ray (clusters belong in tests/e2e)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_ray_cluster() -> Iterator[None]:
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("a unit test started Ray: move it to tests/e2e (mark it `cluster`)")
