#!/usr/bin/env python
"""KV-transfer bandwidth between two Ray actors: NIXL vs gRPC vs the local memory-copy limit.

Moves ``--total-mib`` MiB as ``--block-kib`` KiB blocks, scattered (random source and destination
block ids) over pools of ``--pool-factor`` times that size, from a sender actor to a receiver
actor, ``--repeats`` times after ``--warmup`` rounds, and prints GB/s (1 GB = 1e9 bytes):

- ``done``: sender-side time from the first ``push()`` until every handle reports done;
- ``notified``: from the first ``push()`` until the receiver has seen the last notification
  (``time.perf_counter`` is CLOCK_MONOTONIC, comparable across local processes);
- ``memcpy``: the same scattered blocks copied pool-to-pool in this process with torch
  (``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))``), the local limit.

The data is checked (SHA-256 of the moved blocks on both sides) after each transport.
Usage: ``python bench/kv_transfer_bench.py [--transports nixl,grpc] [--block-kib 256] ...``
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from kv_transfer.base import ChunkNotification  # noqa: E402
from kv_transfer.grpc_transport import GrpcConfig  # noqa: E402
from kv_transfer.nixl_transport import NixlConfig  # noqa: E402
from kv_transfer.peer import TransferPeer  # noqa: E402

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="nixl,grpc", help="comma list of nixl, grpc")
    p.add_argument("--total-mib", type=int, default=64, help="MiB moved per round")
    p.add_argument("--block-kib", type=int, default=256, help="KiB per KV block")
    p.add_argument("--pool-factor", type=float, default=2.0, help="pool size / moved size (>= 1)")
    p.add_argument("--pushes", type=int, default=1, help="pushes per round (blocks split evenly)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nixl-prog-thread", action="store_true", help="enable NIXL's progress thread")
    p.add_argument("--ucx-error-mode", default="none", choices=["none", "peer"])
    p.add_argument("--ucx-tls", default=None, help="set UCX_TLS for the NIXL actors (non-empty)")
    p.add_argument("--grpc-message-mib", type=float, default=4.0, help="gRPC payload bytes per message")
    p.add_argument(
        "--poll-sleep-us", type=float, default=100.0, help="receiver sleep after an empty notification poll"
    )
    args = p.parse_args(argv)
    if args.pool_factor < 1 or args.pushes < 1 or args.repeats < 1 or args.block_kib < 1:
        p.error("need --pool-factor >= 1, --pushes >= 1, --repeats >= 1, --block-kib >= 1")
    return args


def scattered_ids(num_moved: int, pool_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(pool_blocks), num_moved), rng.sample(range(pool_blocks), num_moved)


def memcpy_gbps(pool_blocks: int, block_bytes: int, src: list[int], dst: list[int], repeats: int) -> float:
    a = torch.randint(0, 256, (pool_blocks, block_bytes), dtype=torch.uint8)
    b = torch.zeros_like(a)
    s, d = torch.tensor(src), torch.tensor(dst)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        b.index_copy_(0, d, a.index_select(0, s))
        times.append(time.perf_counter() - t0)
    assert torch.equal(b[d], a[s])
    return len(src) * block_bytes / statistics.median(times[1:]) / GB


def run_transport(
    kind: str, args: argparse.Namespace, pool_blocks: int, block_bytes: int, src: list[int], dst: list[int]
) -> dict[str, Any]:
    config: NixlConfig | GrpcConfig
    if kind == "nixl":
        config = NixlConfig(
            enable_prog_thread=args.nixl_prog_thread,
            ucx_error_handling_mode=args.ucx_error_mode,
            ucx_tls=args.ucx_tls,
        )
    else:
        config = GrpcConfig(message_bytes=int(args.grpc_message_mib * (1 << 20)))
    Peer = ray.remote(TransferPeer)
    shape = (block_bytes // 4,)  # float32 blocks; the transport only sees bytes
    receiver = Peer.remote(kind, pool_blocks, shape, "float32", config)
    sender = Peer.remote(kind, pool_blocks, shape, "float32", config)
    try:
        ray.get(sender.fill_random.remote(args.seed + 1), timeout=60)
        target = ray.get(receiver.describe.remote(), timeout=60)
        n = len(src)
        bounds = [round(k * n / args.pushes) for k in range(args.pushes + 1)]
        done_gbps, notified_gbps = [], []
        for it in range(args.warmup + args.repeats):
            pushes = [
                (src[lo:hi], dst[lo:hi], ChunkNotification(f"it{it}", k, hi, k == args.pushes - 1))
                for k, (lo, hi) in enumerate(itertools.pairwise(bounds))
            ]
            notes_ref = receiver.collect_notifications.remote(args.pushes, 60.0, args.poll_sleep_us * 1e-6)
            times = ray.get(sender.push_all.remote(target, pushes, 60.0), timeout=90)
            notes = ray.get(notes_ref, timeout=90)
            if len(notes) != args.pushes or {n.request_id for n, _ in notes} != {f"it{it}"}:
                raise RuntimeError(f"{kind}: expected {args.pushes} notifications for it{it}, got {notes}")
            if it >= args.warmup:
                nbytes = n * block_bytes
                done_gbps.append(nbytes / (max(times[1:]) - times[0]) / GB)
                notified_gbps.append(nbytes / (max(t for _, t in notes) - times[0]) / GB)
        ok = ray.get(sender.digest.remote(src), timeout=60) == ray.get(
            receiver.digest.remote(dst), timeout=60
        )
        if not ok:
            raise RuntimeError(f"{kind}: data mismatch after transfer")
        return {
            "done_median": statistics.median(done_gbps),
            "done_best": max(done_gbps),
            "notified_median": statistics.median(notified_gbps),
            "notified_best": max(notified_gbps),
        }
    finally:
        for actor in (sender, receiver):
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception as e:  # report, keep tearing down
                print(f"  close failed: {e}", file=sys.stderr)
            ray.kill(actor)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = [k.strip() for k in args.transports.split(",") if k.strip()]
    for k in kinds:
        if k not in ("nixl", "grpc"):
            raise SystemExit(f"unknown transport {k!r}")
    block_bytes = args.block_kib * 1024
    num_moved = max(1, args.total_mib * (1 << 20) // block_bytes)
    pool_blocks = max(num_moved, int(num_moved * args.pool_factor))
    src, dst = scattered_ids(num_moved, pool_blocks, args.seed)
    moved_mib = num_moved * block_bytes / (1 << 20)
    print(
        f"moving {moved_mib:.0f} MiB = {num_moved} blocks x {args.block_kib} KiB, scattered over pools of "
        f"{pool_blocks} blocks ({pool_blocks * block_bytes / (1 << 20):.0f} MiB); "
        f"{args.pushes} push(es)/round, "
        f"{args.repeats} rounds after {args.warmup} warm-up; torch threads here: {torch.get_num_threads()}"
    )

    results: dict[str, dict[str, Any]] = {}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    try:
        for kind in kinds:
            results[kind] = run_transport(kind, args, pool_blocks, block_bytes, src, dst)
    finally:
        ray.shutdown()

    mem = memcpy_gbps(pool_blocks, block_bytes, src, dst, args.repeats)
    mem_1t = None
    if torch.get_num_threads() > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        mem_1t = memcpy_gbps(pool_blocks, block_bytes, src, dst, args.repeats)
        torch.set_num_threads(threads)

    print(f"{'path':<34} {'GB/s median':>12} {'GB/s best':>10}")
    for kind, r in results.items():
        print(f"{kind + ' (sender done)':<34} {r['done_median']:>12.2f} {r['done_best']:>10.2f}")
        print(
            f"{kind + ' (receiver notified)':<34} {r['notified_median']:>12.2f} {r['notified_best']:>10.2f}"
        )
    print(f"{f'memcpy (torch, {torch.get_num_threads()} threads)':<34} {mem:>12.2f}")
    if mem_1t is not None:
        print(f"{'memcpy (torch, 1 thread)':<34} {mem_1t:>12.2f}")
    if "nixl" in results:
        ratio = results["nixl"]["notified_median"] / mem
        print(f"NIXL/memcpy ratio (notified median / memcpy): {ratio:.2f}  (target >= 0.50)")
    if "grpc" in results:
        print(f"gRPC notified median: {results['grpc']['notified_median']:.2f} GB/s  (target >= 0.5)")
    print(f"UCX_TLS in driver env: {os.environ.get('UCX_TLS')!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
