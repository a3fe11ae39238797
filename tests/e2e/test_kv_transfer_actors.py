"""Both KV transports between two Ray actors: blocks pushed from one process land byte for byte in the other's pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.kv_transfer import (
    ChunkNotification,
)
from pdserve.kv_transfer.base import pool_bytes_view
from pdserve.kv_transfer.peer import TransferPeer
from pdserve.transport_config import GrpcConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ["nixl", "grpc"]
# [num_blocks, layers, K/V, block_size, kv_heads, head_dim]: block-major like the engine's pool.
BLOCK_SHAPE = (2, 2, 4, 2, 8)
NUM_BLOCKS = 32


@pytest.mark.cluster
@pytest.mark.parametrize("kind", KINDS)
def test_push_between_two_ray_actors(ray_cluster: None, kind: str) -> None:
    import ray

    Peer = ray.remote(num_cpus=0)(TransferPeer)
    # bfloat16 with random bytes: compare as bytes (NaN != NaN as floats)
    config = GrpcConfig(host="127.0.0.1") if kind == "grpc" else None  # tests stay on loopback
    receiver = Peer.remote(kind, NUM_BLOCKS, BLOCK_SHAPE, "bfloat16", config)
    sender = Peer.remote(kind, NUM_BLOCKS + 8, BLOCK_SHAPE, "bfloat16", config)
    try:
        ray.get(sender.fill_random.remote(1234), timeout=60)
        target = ray.get(receiver.describe.remote(), timeout=60)
        assert target.kind == kind and target.num_blocks == NUM_BLOCKS
        pushes = [
            ([3, 17, 5, 39], [20, 1, 9, 31], ChunkNotification("req-A", 0, 64, False)),
            ([0, 36], [30, 12], ChunkNotification("req-A", 1, 96, False)),
            ([8], [4], ChunkNotification("req-A", 2, 101, True)),
        ]
        notes_ref = receiver.collect_notifications.remote(len(pushes), 30.0)
        times = ray.get(sender.push_all.remote(target, pushes, 30.0), timeout=60)
        assert len(times) == len(pushes) + 1
        notes = ray.get(notes_ref, timeout=60)
        got = sorted((n for n, _ in notes), key=lambda n: n.chunk_index)
        assert got == [p[2] for p in pushes]

        src_pool = pool_bytes_view(ray.get(sender.pool_copy.remote(), timeout=60))
        dst_pool = pool_bytes_view(ray.get(receiver.pool_copy.remote(), timeout=60))
        moved = {d: s for src, dst, _ in pushes for s, d in zip(src, dst, strict=True)}
        for d, s in moved.items():
            assert torch.equal(dst_pool[d], src_pool[s]), f"block {s} -> {d} differs"
        untouched = [i for i in range(NUM_BLOCKS) if i not in moved]
        assert not dst_pool[untouched].any(), "blocks outside the pushes were written"
        assert src_pool.any()  # the comparison above was not between zeros
    finally:
        for actor in (sender, receiver):
            try:
                ray.get(actor.close.remote(), timeout=30)
            finally:
                ray.kill(actor)
