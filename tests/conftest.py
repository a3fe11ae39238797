"""What the tests share: a local Ray cluster per test module. Helpers live in ``tests/support`` (imported as
``support.<module>``: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance (loopback, 2 CPUs, no dashboard) for one test module; shut down after it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
