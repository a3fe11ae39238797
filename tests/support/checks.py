"""The checks end-to-end tests share: waiting for a condition with a bound, and the check every end-to-end test
ends with (no request left on a worker, no KV block leaked)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """``predicate()``'s first truthy value, polled every ``interval_s``; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def assert_no_leaks(deployment: Any, timeout_s: float = 15.0, *, integrity: bool = True, **client_options: Any) -> None:
    """Every serving worker ends with no request left and all its KV blocks free or cached.

    Reads the router's Stats RPC (so a worker that died and was replaced counts by its successor), waiting up
    to ``timeout_s`` for the last frees; with ``integrity``, each worker then checks its own block accounting
    (``Deployment.check_integrity``). ``client_options`` go to the ``Client`` (an ``auth_token``, say).
    """
    from pdserve.router.client import Client

    with Client(deployment.address, **client_options) as client:
        last: list[Any] = []

        def idle() -> bool:
            last[:] = [w for w in client.stats() if w.state == "serving"]
            return bool(last) and all(
                w.num_running + w.num_waiting == 0 and w.blocks_free + w.blocks_cached == w.blocks_total for w in last
            )

        try:
            wait_until(idle, timeout_s, "every worker to be idle with its KV blocks free")
        except AssertionError as e:
            raise AssertionError(f"{e}: {last}") from None
    if integrity:
        deployment.check_integrity()
