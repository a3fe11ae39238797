#!/usr/bin/env python
"""KV-transfer bandwidth between two Ray actors: NIXL vs gRPC vs the local memory-copy limit.

Moves ``--total-mib`` MiB as ``--block-kib`` KiB blocks, scattered (random source and destination
block ids) over pools of ``--pool-factor`` times that size, from a sender actor to a receiver
actor, ``--repeats`` times after ``--warmup`` rounds, and prints GB/s (1 GB = 1e9 bytes):

- ``done``: sender-side time from the first ``push()`` until every handle reports done;
- ``notified``: from the first ``push()`` until the receiver has seen the last notification
  (``time.perf_counter`` is CLOCK_MONOTONIC, comparable across local processes);
- ``memcpy``: the same scattered blocks copied pool-to-pool in this process with torch, the
  local limit (see :func:`memcpy_gbps`; the reference is the per-block ``copy_`` loop).

The data is checked (SHA-256 of the moved blocks on both sides) after each transport.
Usage: ``python benchmarks/kv_transfer_bench.py [--transports nixl,grpc] [--block-kib 256] ...``
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from typing import Any

import ray
import torch

from pdserve.kv_transfer.base import ChunkNotification
from pdserve.kv_transfer.nixl_transport import NixlConfig
from pdserve.kv_transfer.peer import TransferPeer
from pdserve.transport_config import GrpcConfig

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
    p.add_argument("--grpc-message-mib", type=float, default=2.0, help="gRPC payload bytes per message")
    p.add_argument("--poll-sleep-us", type=float, default=100.0, help="receiver sleep after an empty notification poll")
    args = p.parse_args(argv)
    if args.pool_factor < 1 or args.pushes < 1 or args.repeats < 1 or args.block_kib < 1:
        p.error("need --pool-factor >= 1, --pushes >= 1, --repeats >= 1, --block-kib >= 1")
    return args


def scattered_ids(num_moved: int, pool_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(pool_blocks), num_moved), rng.sample(range(pool_blocks), num_moved)


def memcpy_gbps(
    pool_blocks: int, block_bytes: int, src: list[int], dst: list[int], repeats: int
) -> dict[str, tuple[float, float]]:
    """Local copy of the same scattered blocks, pool to pool, in this process: (median, best) GB/s.

    ``per-block copy_`` (one ``dst[j].copy_(src[i])`` per block: a memcpy per block) is the
    reference; ``index_select+index_copy_`` is the one-call torch form, which is far slower on
    CPU (an element-wise kernel for index_copy_, plus a gather into a fresh buffer that
    page-faults); ``contiguous copy_`` copies the same byte count as one region (upper bound).
    """
    a = torch.randint(0, 256, (pool_blocks, block_bytes), dtype=torch.uint8)
    b = torch.zeros_like(a)
    s, d = torch.tensor(src), torch.tensor(dst)
    n = len(src)
    half = max(1, pool_blocks // 2)

    def per_block() -> None:
        for i, j in zip(src, dst, strict=True):
            b[j].copy_(a[i])

    def indexed() -> None:
        b.index_copy_(0, d, a.index_select(0, s))

    def contiguous() -> None:
        b[: min(n, half)].copy_(a[pool_blocks - min(n, half) :])

    out = {}
    for name, fn, nbytes in (
        ("per-block copy_", per_block, n * block_bytes),
        ("index_select+index_copy_", indexed, n * block_bytes),
        ("contiguous copy_", contiguous, min(n, half) * block_bytes),
    ):
        fn()  # first touch / warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = (nbytes / statistics.median(times) / GB, nbytes / min(times) / GB)
    b.zero_()
    per_block()
    assert torch.equal(b[d], a[s]), "memcpy reference copied the wrong bytes"
    return out


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
    Peer: Any = ray.remote(TransferPeer)
    shape = (block_bytes // 4,)  # float32 blocks; the transport only sees bytes
    receiver = Peer.remote(kind, pool_blocks, shape, "float32", config)
    sender = Peer.remote(kind, pool_blocks, shape, "float32", config)
    clean = False
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
            if len(notes) != args.pushes or {note.request_id for note, _ in notes} != {f"it{it}"}:
                raise RuntimeError(f"{kind}: expected {args.pushes} notifications for it{it}, got {notes}")
            if it >= args.warmup:
                nbytes = n * block_bytes
                done_gbps.append(nbytes / (max(times[1:]) - times[0]) / GB)
                notified_gbps.append(nbytes / (max(t for _, t in notes) - times[0]) / GB)
        ok = ray.get(sender.digest.remote(src), timeout=60) == ray.get(receiver.digest.remote(dst), timeout=60)
        if not ok:
            raise RuntimeError(f"{kind}: data mismatch after transfer")
        clean = True
        return {
            "done_median": statistics.median(done_gbps),
            "done_best": max(done_gbps),
            "notified_median": statistics.median(notified_gbps),
            "notified_best": max(notified_gbps),
        }
    finally:
        for actor in (sender, receiver):
            if clean:  # after a failure an actor may still be busy: just kill it
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

    # local limit first, while no Ray processes compete for the cores
    mem: dict[str, dict[str, tuple[float, float]]] = {}
    threads = torch.get_num_threads()
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        mem[f"{t} thread{'s' if t > 1 else ''}"] = memcpy_gbps(pool_blocks, block_bytes, src, dst, args.repeats)
    torch.set_num_threads(threads)
    reference = max(m["per-block copy_"][1] for m in mem.values())  # the limit: best of any run

    results: dict[str, dict[str, Any]] = {}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        for kind in kinds:
            results[kind] = run_transport(kind, args, pool_blocks, block_bytes, src, dst)
    finally:
        ray.shutdown()

    print(f"{'path':<46} {'GB/s median':>12} {'GB/s best':>10}")
    for kind, r in results.items():
        print(f"{kind + ' (sender done)':<46} {r['done_median']:>12.2f} {r['done_best']:>10.2f}")
        print(f"{kind + ' (receiver notified)':<46} {r['notified_median']:>12.2f} {r['notified_best']:>10.2f}")
    for label, m in mem.items():
        for name, (median, best) in m.items():
            print(f"{f'memcpy: {name}, {label}':<46} {median:>12.2f} {best:>10.2f}")
    print(f"memcpy reference (per-block copy_, best run of any thread count): {reference:.2f} GB/s")
    if "nixl" in results:
        ratio = results["nixl"]["notified_median"] / reference
        print(f"NIXL/memcpy ratio (NIXL notified median / memcpy reference): {ratio:.2f}  (target >= 0.50)")
    if "grpc" in results:
        print(f"gRPC notified median: {results['grpc']['notified_median']:.2f} GB/s  (target >= 0.5)")
    print(f"UCX_TLS in driver env: {os.environ.get('UCX_TLS')!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
