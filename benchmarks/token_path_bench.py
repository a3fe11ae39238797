"""The token path: does serving cost more than the engine? Offline vs served throughput, side by side.

For each preset and number of concurrent streams, the same greedy requests run (1) through
``LLMEngine.generate`` in this process and (2) through a deployment (one decode worker, colocated, the
router(s) in their own processes, an ``AsyncClient`` here), each with one torch thread. Printed per row:
tokens/s both ways and their ratio, event-stream items per streamed token, and CPU ms per 1000 streamed
tokens (= µs per token) in the router process(es) — with the share the same process spends when idle
for as long (Ray's threads, health pollers), measured right after — the worker and this client process.
Then 1 vs 2 routers, and the floor: a bare ``grpc.aio`` server streaming one message per token.

``--intervals 1,2,4,8``: the router's CPU per token when each request asks for one message per k tokens
(the stream interval; the first token always goes out at once), tiny preset, 64 streams, one deployment,
beside the bare ``grpc.aio`` server streaming k tokens per message.

    python benchmarks/token_path_bench.py            # about 4 minutes on 2 cores
    python benchmarks/token_path_bench.py --quick    # tiny preset, 64 streams, 1 vs 2 routers
    python benchmarks/token_path_bench.py --intervals 1,2,4,8   # only the stream-interval table
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import time
from typing import NamedTuple

import grpc
import psutil
import ray

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.client import AsyncClient

PROMPT_TOKENS = 64
IDLE_S = 3.0
FLOOR_TOKENS = 128
OUTPUT_TOKENS = {"tiny": 128, "bench": 64}


class Row(NamedTuple):
    model: str
    streams: int
    routers: int
    offline_tok_s: float
    served_tok_s: float
    items_per_token: float
    router_cpu_ms_per_1k: float
    router_idle_ms_per_1k: float  # of which the router process spends idle (Ray's background threads, pollers)
    worker_cpu_ms_per_1k: float
    client_cpu_ms_per_1k: float


def engine_config(model: str, streams: int) -> EngineConfig:
    blocks = streams * -(-(PROMPT_TOKENS + OUTPUT_TOKENS[model] + 16) // 16) + 64
    return EngineConfig(
        model=model, device="cpu", torch_threads=1, max_num_seqs=max(streams, 16), num_kv_blocks=blocks, seed=0
    )


def prompts(streams: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(PROMPT_TOKENS)] for _ in range(streams)]


def offline_throughput(model: str, streams: int) -> float:
    engine = LLMEngine(engine_config(model, streams))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS[model], temperature=0.0, ignore_eos=True)
    engine.generate(prompts(4, seed=99), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts(streams), params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


async def _send_all(
    address: str, batch: list[list[int]], params: SamplingParams, channels: int, interval: int = 0
) -> int:
    return (await _send_counting(address, batch, params, channels, interval))[0]


async def _send_counting(
    address: str, batch: list[list[int]], params: SamplingParams, channels: int, interval: int = 0
) -> tuple[int, int]:
    """(tokens, messages) the streams received."""
    clients = [AsyncClient(address) for _ in range(channels)]

    async def one(client: AsyncClient, prompt: list[int]) -> tuple[int, int]:
        sizes = [len(c.token_ids) async for c in client.generate(prompt, params, "colocated", None, interval)]
        return sum(sizes), len(sizes)

    try:
        counts = await asyncio.gather(*[one(clients[i % channels], p) for i, p in enumerate(batch)])
    finally:
        for c in clients:
            await c.close()
    return sum(t for t, _ in counts), sum(m for _, m in counts)


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def served(model: str, streams: int, routers: int) -> tuple[float, float, float, float, float, float]:
    """Served tokens/s, items per token, and router (busy, idle share) / worker / client CPU ms per 1000 tokens."""
    config = DeploymentConfig(engine=engine_config(model, streams), num_routers=routers)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS[model], temperature=0.0, ignore_eos=True)
    channels = 8 if routers > 1 else 1  # SO_REUSEPORT spreads connections, not calls
    with Deployment(config) as d:
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        asyncio.run(_send_all(d.address, prompts(4, seed=99), warm, channels))
        worker_pid = d.worker_info[0]["pid"]
        before_routers, before_worker = d.router_usage(), _cpu_s(worker_pid)
        before_client = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        tokens = asyncio.run(_send_all(d.address, prompts(streams), params, channels))
        elapsed = time.perf_counter() - t0
        after_client = resource.getrusage(resource.RUSAGE_SELF)
        after_routers, after_worker = d.router_usage(), _cpu_s(worker_pid)
        time.sleep(IDLE_S)  # the routers' CPU while no request runs: the fixed cost of the process
        idle_routers = d.router_usage()
    per_1k = 1000.0 / tokens * 1000.0  # seconds -> ms per 1000 tokens
    router_cpu = sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(after_routers, before_routers, strict=True))
    items = sum(a["stream_items"] - b["stream_items"] for a, b in zip(after_routers, before_routers, strict=True))
    client_cpu = (after_client.ru_utime + after_client.ru_stime) - (before_client.ru_utime + before_client.ru_stime)
    idle_rate = sum(i["cpu_s"] - a["cpu_s"] for i, a in zip(idle_routers, after_routers, strict=True)) / IDLE_S
    return (
        tokens / elapsed,
        items / tokens,
        router_cpu * per_1k,
        min(router_cpu, idle_rate * elapsed) * per_1k,
        (after_worker - before_worker) * per_1k,
        client_cpu * per_1k,
    )


class _BareStreamer(pb_grpc.PDServeServicer):
    """A gRPC servicer that streams ``FLOOR_TOKENS`` tokens per call, ``stream_interval`` per message (default
    1), and does nothing else."""

    async def Generate(self, request: pb.GenerateRequest, context: object):
        k = request.stream_interval or 1
        for i in range(0, FLOOR_TOKENS, k):
            await asyncio.sleep(0)
            n = min(k, FLOOR_TOKENS - i)
            yield pb.GenerateResponse(token_ids=list(range(i, i + n)), text="a" * n)


def _serve_bare(port_queue: multiprocessing.Queue) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_PDServeServicer_to_server(_BareStreamer(), server)
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_floor(streams: int = 64, interval: int = 1) -> float:
    """Server CPU µs per token of a bare ``grpc.aio`` server streaming ``interval`` tokens per message to
    ``streams`` concurrent calls (1: per message too): the floor under any router that sends as many."""
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = ctx.Queue()
    server = ctx.Process(target=_serve_bare, args=(ports,), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"

        async def run(n: int) -> int:
            async with AsyncClient(address) as client:

                async def one() -> int:
                    chunks = client.generate([1], SamplingParams(), None, None, interval)
                    return sum([len(c.token_ids) async for c in chunks])

                return sum(await asyncio.gather(*[one() for _ in range(n)]))

        asyncio.run(run(4))  # warm-up
        before = _cpu_s(server.pid)  # type: ignore[arg-type]
        tokens = asyncio.run(run(streams))
        return (_cpu_s(server.pid) - before) / tokens * 1e6  # type: ignore[arg-type]
    finally:
        server.terminate()
        server.join(10)


class IntervalRow(NamedTuple):
    interval: int
    served_tok_s: float
    messages_per_token: float
    router_cpu_us_per_token: float
    router_idle_us_per_token: float  # of which the router process spends idle
    floor_us_per_token: float  # a bare grpc.aio server sending as many tokens per message


def stream_intervals(intervals: list[int], model: str = "tiny", streams: int = 64) -> list[IntervalRow]:
    """Router CPU per token at each stream interval, all on one deployment (one router, colocated)."""
    config = DeploymentConfig(engine=engine_config(model, streams))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS[model], temperature=0.0, ignore_eos=True)
    measured = []
    with Deployment(config) as d:
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        asyncio.run(_send_all(d.address, prompts(4, seed=99), warm, 1))
        for k in intervals:
            before = d.router_usage()
            t0 = time.perf_counter()
            tokens, messages = asyncio.run(_send_counting(d.address, prompts(streams), params, 1, k))
            elapsed = time.perf_counter() - t0
            after = d.router_usage()
            time.sleep(IDLE_S)
            idle = d.router_usage()
            cpu = sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before, strict=True))
            idle_rate = sum(i["cpu_s"] - a["cpu_s"] for i, a in zip(idle, after, strict=True)) / IDLE_S
            measured.append((k, tokens / elapsed, messages / tokens, cpu / tokens * 1e6,
                             min(cpu, idle_rate * elapsed) / tokens * 1e6))  # fmt: skip
    return [IntervalRow(*m, floor_us_per_token=min(grpc_floor(streams, m[0]) for _ in range(3))) for m in measured]


def print_interval_rows(rows: list[IntervalRow]) -> None:
    print(
        f"{'interval':>8} {'served tok/s':>12} {'msgs/token':>10} {'router us/token':>15} {'(idle)':>7} "
        f"{'beyond idle':>11} {'grpc.aio floor us/token':>23}"
    )
    for r in rows:
        busy = r.router_cpu_us_per_token - r.router_idle_us_per_token
        print(
            f"{r.interval:>8} {r.served_tok_s:>12.0f} {r.messages_per_token:>10.3f} {r.router_cpu_us_per_token:>15.1f} "
            f"{r.router_idle_us_per_token:>7.1f} {busy:>11.1f} {r.floor_us_per_token:>23.1f}",
            flush=True,
        )


def measure(model: str, streams: int, routers: int = 1) -> Row:
    offline = offline_throughput(model, streams)
    tok_s, items, router_ms, idle_ms, worker_ms, client_ms = served(model, streams, routers)
    return Row(model, streams, routers, offline, tok_s, items, router_ms, idle_ms, worker_ms, client_ms)


def print_rows(rows: list[Row]) -> None:
    print(
        f"{'model':>6} {'streams':>7} {'routers':>7} {'offline tok/s':>13} {'served tok/s':>12} {'ratio':>6} "
        f"{'items/token':>11} {'router ms/1k':>12} {'(idle)':>7} {'worker ms/1k':>12} {'client ms/1k':>12}"
    )
    for r in rows:
        print(
            f"{r.model:>6} {r.streams:>7} {r.routers:>7} {r.offline_tok_s:>13.0f} {r.served_tok_s:>12.0f} "
            f"{r.served_tok_s / r.offline_tok_s:>6.2f} {r.items_per_token:>11.3f} {r.router_cpu_ms_per_1k:>12.1f} "
            f"{r.router_idle_ms_per_1k:>7.1f} "
            f"{r.worker_cpu_ms_per_1k:>12.1f} {r.client_cpu_ms_per_1k:>12.1f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset at 64 streams only, then 1 vs 2 routers")
    p.add_argument(
        "--intervals",
        default=None,
        help="comma-separated stream intervals (e.g. 1,2,4,8): only the router-CPU-per-token table at each",
    )
    args = p.parse_args(argv)
    if args.intervals:
        intervals = [int(k) for k in args.intervals.split(",")]
        if any(k < 1 for k in intervals):
            p.error("--intervals: each must be >= 1")
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            interval_rows = stream_intervals(intervals)
        finally:
            ray.shutdown()
        print_interval_rows(interval_rows)
        return 0
    grid = [("tiny", 64)] if args.quick else [(m, n) for m in ("tiny", "bench") for n in (16, 64, 256)]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        rows = [measure(model, streams) for model, streams in grid]
        rows.append(measure("tiny", 64, routers=2))
    finally:
        ray.shutdown()
    print_rows(rows)
    targets = {r.model: r for r in rows if r.streams == 64 and r.routers == 1}
    tiny, bench = targets.get("tiny"), targets.get("bench")
    print()
    if tiny is not None:
        print(f"tiny @64 served/offline {tiny.served_tok_s / tiny.offline_tok_s:.2f} (target >= 0.85)")
        print(f"tiny @64 stream items per token {tiny.items_per_token:.3f} (target <= 0.05)")
        busy = tiny.router_cpu_ms_per_1k - tiny.router_idle_ms_per_1k
        print(
            f"tiny @64 router CPU {tiny.router_cpu_ms_per_1k:.1f} us per token, {busy:.1f} beyond the idle process "
            "(target <= 50)"
        )
    if bench is not None:
        print(f"bench @64 served/offline {bench.served_tok_s / bench.offline_tok_s:.2f} (target >= 0.95)")
    floors = [grpc_floor(64) for _ in range(3)]
    print(
        f"bare grpc.aio server, 64 streams: {min(floors):.1f}-{max(floors):.1f} us of server CPU per message "
        "(3 runs): the floor under a router that sends each token as its own message"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
