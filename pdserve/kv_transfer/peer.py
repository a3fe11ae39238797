"""A KV pool plus a transport in one object: the body of a Ray actor for tests and benchmarks.

Nothing here imports Ray; wrap it with ``ray.remote(TransferPeer)``. It lets a test or a
benchmark play sender and receiver in two real processes without defining actor classes in
modules that Ray workers cannot import.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import torch

from pdserve.kv_transfer import make_transport
from pdserve.kv_transfer.base import ChunkNotification, TransferTarget, pool_bytes_view
from pdserve.kv_transfer.nixl_transport import NixlConfig
from pdserve.transport_config import GrpcConfig

Push = tuple[Sequence[int], Sequence[int], ChunkNotification]


class TransferPeer:
    """Owns a zero-filled block-major pool of ``(num_blocks, *block_shape)`` and a transport."""

    def __init__(
        self,
        kind: str,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: str = "float32",
        config: NixlConfig | GrpcConfig | None = None,
    ) -> None:
        self.pool = torch.zeros((num_blocks, *block_shape), dtype=getattr(torch, dtype))
        self.transport = make_transport(kind, config)
        self.transport.register_pool(self.pool)

    def describe(self) -> TransferTarget:
        return self.transport.describe()

    def fill_random(self, seed: int) -> None:
        """Fill the pool with reproducible random bytes (any dtype)."""
        gen = torch.Generator().manual_seed(seed)
        view = pool_bytes_view(self.pool)
        view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))

    def pool_copy(self) -> torch.Tensor:
        return self.pool.clone()

    def digest(self, block_ids: Sequence[int]) -> str:
        """SHA-256 over the bytes of ``block_ids``, in that order."""
        view = pool_bytes_view(self.pool)
        h = hashlib.sha256()
        for i in block_ids:
            h.update(view[i].numpy().tobytes())
        return h.hexdigest()

    def push_all(self, target: TransferTarget, pushes: Sequence[Push], timeout_s: float = 30.0) -> list[float]:
        """Start every push, then wait for each in turn. Returns ``[start, done_0, done_1, ...]``
        (``time.perf_counter()`` values: CLOCK_MONOTONIC, comparable across local processes;
        ``done_k`` is when waiting on push k returned, so it is an upper bound).
        """
        start = time.perf_counter()
        handles = [self.transport.push(target, src, dst, notif) for src, dst, notif in pushes]
        deadline = start + timeout_s
        times = [start]
        for h in handles:
            h.wait(max(0.0, deadline - time.perf_counter()))
            times.append(time.perf_counter())
        return times

    def collect_notifications(
        self, count: int, timeout_s: float = 30.0, poll_sleep_s: float = 100e-6
    ) -> list[tuple[ChunkNotification, float]]:
        """Poll until ``count`` notifications arrived or ``timeout_s`` passed; returns what
        arrived with the ``perf_counter()`` time each was seen (may be fewer than ``count``).
        Sleeps ``poll_sleep_s`` after an empty poll: a busy loop would hold the GIL and starve
        the gRPC server threads that write the data.
        """
        out: list[tuple[ChunkNotification, float]] = []
        deadline = time.perf_counter() + timeout_s
        while len(out) < count and time.perf_counter() < deadline:
            got = self.transport.poll_notifications()
            now = time.perf_counter()
            out.extend((n, now) for n in got)
            if not got and poll_sleep_s:
                time.sleep(poll_sleep_s)
        return out

    def close(self) -> None:
        self.transport.close()
