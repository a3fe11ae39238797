"""What the end-to-end tests check after their requests: nothing left running and no KV block leaked."""

from __future__ import annotations

import time

from pdserve.deployment import Deployment


def assert_idle(deployment: Deployment, timeout_s: float = 15.0) -> None:
    """No request left on any worker and every KV block free or cached (waits up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = deployment.stats()
        if all(w.num_running + w.num_waiting == 0 and w.blocks_used == 0 for w in stats):
            return
        assert time.monotonic() < deadline, f"workers still busy: {stats}"
        time.sleep(0.05)
