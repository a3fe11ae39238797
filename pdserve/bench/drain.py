"""Is a deployment idle, and how fast do its Health and Stats answer while it works: ``wait_drained`` polls the
``Stats`` RPC until no worker holds a block or a request (between benchmark runs, at the end of a soak or a
test), ``Probe`` times ``Health`` and ``Stats`` beside a load."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from pdserve.messages import WorkerStats
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.client import AsyncClient
from pdserve.router.wire import GRPC_OPTIONS, worker_stats_from_proto


class Drain(NamedTuple):
    """What ``Stats`` showed when a drained deployment was checked."""

    clean: bool  # every worker serving, no block in use, nothing running/waiting/reserved, no active request
    blocks_in_use: int  # summed over the workers that answered
    active_requests: int  # in the router
    waited_s: float
    workers: list[WorkerStats]

    def describe(self) -> str:
        busy = [
            f"{w.worker_id}: state={w.state} used={w.blocks_used} running={w.num_running} "
            f"waiting={w.num_waiting} remote_pending={w.num_remote_pending}"
            for w in self.workers
            if not _idle(w)
        ]
        return f"router active requests {self.active_requests}; " + ("; ".join(busy) or "workers idle")


def _idle(w: WorkerStats) -> bool:
    return (
        w.state == "serving"
        and w.blocks_used == 0
        and w.blocks_free + w.blocks_cached == w.blocks_total
        and w.num_running == w.num_waiting == w.num_remote_pending == 0
    )


async def wait_drained(
    address: str, timeout_s: float = 30.0, interval_s: float = 0.1, ignore_unavailable: bool = False
) -> Drain:
    """Poll the ``Stats`` RPC until nothing holds a block or a slot anywhere, or ``timeout_s`` passes.

    ``ignore_unavailable``: judge only the workers that answer (a dead worker's blocks died with it).
    """
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.PDServeStub(channel)
        while True:
            resp = await stub.Stats(pb.StatsRequest(), timeout=30)
            workers = [worker_stats_from_proto(w) for w in resp.workers]
            judged = [w for w in workers if w.state == "serving" or not ignore_unavailable]
            clean = resp.num_active_requests == 0 and all(_idle(w) for w in judged)
            waited = time.monotonic() - started
            if clean or waited > timeout_s:
                in_use = sum(w.blocks_total - w.blocks_free - w.blocks_cached for w in workers if w.state == "serving")
                return Drain(clean, in_use, resp.num_active_requests, waited, workers)
            await asyncio.sleep(interval_s)


@dataclass
class Probe:
    """Latencies of ``Health`` and ``Stats``, called one after the other while something else runs."""

    health_s: list[float] = field(default_factory=list)
    stats_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)  # Health's status, "NOT OK: ..." when not ok

    async def run(self, address: str, stop: asyncio.Event, interval_s: float) -> None:
        async with AsyncClient(address, timeout_s=30) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                health = await client.health()
                t1 = time.monotonic()
                await client.stats()
                self.health_s.append(t1 - t0)
                self.stats_s.append(time.monotonic() - t1)
                self.statuses[health.status if health.ok else f"NOT OK: {health.status}"] += 1
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except TimeoutError:
                    pass
