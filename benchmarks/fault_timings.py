"""How long each fault of ``tests/e2e/test_faults.py`` takes to reach its clear outcome (the tests only bound it).

One fresh deployment per fault, configured as in those tests (``tiny`` preset, gRPC KV transport unless
the row names one, ``verify_kv`` on, one prefill and one decode worker unless said otherwise, reservation
TTL 4 s, push timeout 1 s); each row times the fault from the moment it is caused to the client's outcome,
then to every KV block free or cached on the workers that answer (through ``Stats``), then to the
deployment serving with that worker again.

    python benchmarks/fault_timings.py                 # every fault, about 8 minutes on 2 cores
    python benchmarks/fault_timings.py --only push     # the faults whose name contains "push"

The hung decode worker (SIGSTOP, then SIGCONT once the client has its answer and the prefill worker its
blocks) runs a 3000-token prompt with a push timeout of 3 s and a reservation TTL of 30 s; its "freed"
column is the prefill worker's blocks (the stopped process holds its own until it resumes). With NIXL it runs
twice: over shared memory (writes into the stopped process still complete) and with UCX over TCP (they hang:
at the push timeout the prefill worker gives its blocks back and keeps tracking the write, which ends when the
process resumes; its decode worker keeps the destination blocks in quarantine until then).

Hangs of another kind: a decode worker stopped before its reservation is asked for, a prefill worker stopped
mid-prefill (SIGSTOP; status at the router's silence timeout, 5 s), and an engine thread that blocks for 8 s in
a worker whose process runs on (``engine_stall_timeout_s`` 2 s). The last row kills the router process while
five prefills queue on a slowed prefill worker, and times the blocks back through the workers themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

import grpc
import ray

from pdserve.bench.drain import wait_drained
from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.faults import NO_FAULTS, FaultPlan
from pdserve.kv_transfer.nixl_transport import NixlConfig
from pdserve.router.client import AsyncClient

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=400, max_num_batched_tokens=32, torch_threads=1, max_model_len=1024
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(3).randrange(256) for _ in range(300)]
TTL_S = 4.0


class Timing(NamedTuple):
    fault: str
    outcome: str  # what the client got
    outcome_s: float  # fault -> that outcome
    freed_s: float  # fault -> every block free or cached on the workers that answer, nothing active
    serving_s: float | None  # fault -> the worker serves again (None: not applicable)


def deployment(**overrides) -> Deployment:
    config = dict(
        engine=ENGINE,
        mode="disaggregated",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,
        kv_host="127.0.0.1",
        reservation_ttl_s=TTL_S,
        push_timeout_s=1.0,
    )
    return Deployment(DeploymentConfig(**{**config, **overrides})).start()


async def stream(client: AsyncClient, params: SamplingParams, first: asyncio.Event | None = None) -> tuple[str, list]:
    tokens: list[int] = []
    try:
        async for chunk in client.generate(PROMPT, params):
            tokens += chunk.token_ids
            if first is not None:
                first.set()
    except grpc.aio.AioRpcError as e:
        return e.code().name, tokens
    return "completed", tokens


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached in {timeout_s} s")
        await asyncio.sleep(0.05)


async def freed_after(address: str, since: float) -> float:
    drain = await wait_drained(address, timeout_s=60, ignore_unavailable=True)
    if not drain.clean:
        raise AssertionError(drain.describe())
    return time.monotonic() - since


LONG_PROMPT = [random.Random(11).randrange(256) for _ in range(900)]
HUNG_ENGINE = dataclasses.replace(ENGINE, num_kv_blocks=600, max_num_batched_tokens=128, max_model_len=3200)
HUNG_PROMPT = [random.Random(17).randrange(256) for _ in range(3000)]
HUNG = {"engine": HUNG_ENGINE, "push_timeout_s": 3.0, "reservation_ttl_s": 30.0}


async def decode_killed_mid_push(d: Deployment, expected: list[int]) -> Timing:
    """A 900-token prompt is being prefilled (slowed to 200 ms a chunk) and pushed when its decode worker dies."""
    async with AsyncClient(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        task = asyncio.create_task(stream_prompt(client, LONG_PROMPT, GREEDY))
        await until(lambda: _any_stats(client, lambda w: w.role == "prefill" and w.num_steps >= 3))
        killed = time.monotonic()
        ray.kill(d.decode_workers[0].actor, no_restart=False)
        outcome, _ = await task
        outcome_s = time.monotonic() - killed
        freed_s = await freed_after(d.address, killed)
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(NO_FAULTS))
        await until(lambda: _health_is(client, "serving"))
        for mode in ("disaggregated", "colocated"):
            done, tokens = await stream_prompt(client, PROMPT, GREEDY, mode)
            assert done == "completed" and tokens == expected, (mode, done)
        serving_s = time.monotonic() - killed
    return Timing(f"decode worker killed mid-push ({d.config.transport})", outcome, outcome_s, freed_s, serving_s)


async def decode_hung_mid_push(d: Deployment, expected: list[int], label: str) -> Timing:
    """The decode worker's process is stopped (SIGSTOP) while a 3000-token prompt (slowed to 200 ms more a
    chunk) is prefilled and pushed; it is resumed once the client has its outcome and the prefill worker its
    blocks."""
    [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "decode-0"]
    async with AsyncClient(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        task = asyncio.create_task(stream_prompt(client, HUNG_PROMPT, GREEDY, "disaggregated"))
        await until(lambda: _any_stats(client, lambda w: w.role == "prefill" and w.num_steps >= 3))

        async def prefill_blocks_back() -> float:
            def back(w: Any) -> bool:
                return w.state == "serving" and w.blocks_free + w.blocks_cached == w.blocks_total

            await until(lambda: _all_stats(client, "prefill", back), 60)
            return time.monotonic()

        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            freed = asyncio.create_task(prefill_blocks_back())
            outcome, _ = await asyncio.wait_for(task, 60)
            outcome_s = time.monotonic() - stopped
            freed_s = await freed - stopped
        finally:
            os.kill(pid, signal.SIGCONT)
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(NO_FAULTS))
        await until(lambda: _health_is(client, "serving"))
        for mode in ("disaggregated", "colocated"):
            done, tokens = await stream_prompt(client, PROMPT, GREEDY, mode)
            assert done == "completed" and tokens == expected, (mode, done)
        serving_s = time.monotonic() - stopped
    await freed_after(d.address, stopped)  # nothing left on either worker once it resumed
    return Timing(f"decode worker hung mid-push ({label})", outcome, outcome_s, freed_s, serving_s)


def _hung_measure(expected: list[int], label: str) -> Callable[[Deployment], Coroutine[Any, Any, Timing]]:
    return lambda d: decode_hung_mid_push(d, expected, label)


async def stream_prompt(
    client: AsyncClient, prompt: list[int], params: SamplingParams, mode: str | None = None
) -> tuple[str, list]:
    tokens: list[int] = []
    try:
        async for chunk in client.generate(prompt, params, mode=mode):
            tokens += chunk.token_ids
    except grpc.aio.AioRpcError as e:
        return e.code().name, tokens
    return "completed", tokens


async def prefill_killed(d: Deployment, expected: list[int]) -> Timing:
    async with AsyncClient(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        task = asyncio.create_task(stream(client, GREEDY))
        await until(lambda: _any_stats(client, lambda w: w.role == "prefill" and w.num_steps >= 2))
        killed = time.monotonic()
        ray.kill(d.prefill_workers[0].actor, no_restart=False)
        outcome, tokens = await task
        outcome_s = time.monotonic() - killed
        assert tokens == expected, "the local prefill must give the same tokens"
        freed_s = await freed_after(d.address, killed)

        async def disaggregated_again() -> bool:
            chunks = [c async for c in client.generate(PROMPT, GREEDY)]
            meta = chunks[-1].metadata
            return meta is not None and meta.prefill_worker == "prefill-0"

        await until(disaggregated_again)
        serving_s = time.monotonic() - killed
    fault = f"prefill worker killed mid-push ({d.config.transport})"
    return Timing(fault, f"{outcome} (local prefill)", outcome_s, freed_s, serving_s)


async def mid_stream(d: Deployment, fault: str, cause: Callable[[AsyncClient], Awaitable[None]]) -> Timing:
    """A long stream is running when ``cause`` strikes; its decode worker must come back afterwards."""
    async with AsyncClient(d.address) as client:
        first = asyncio.Event()
        task = asyncio.create_task(stream(client, LONG, first))
        await first.wait()
        struck = time.monotonic()
        await cause(client)
        outcome, _ = await task
        outcome_s = time.monotonic() - struck
        freed_s = await freed_after(d.address, struck)
        await until(lambda: _health_is(client, "serving"))
    return Timing(fault, outcome, outcome_s, freed_s, time.monotonic() - struck)


async def decode_killed(d: Deployment) -> Timing:
    async def kill_its_worker(client: AsyncClient) -> None:
        [victim] = [w.worker_id for w in await client.stats() if w.num_running > 0]
        ray.kill(next(w.actor for w in d.decode_workers if w.worker_id == victim), no_restart=False)

    return await mid_stream(d, "decode worker killed mid-stream", kill_its_worker)


async def decode_hung_mid_stream(d: Deployment) -> Timing:
    """A long stream's decode worker is stopped (SIGSTOP), and resumed once the client has its outcome."""
    async with AsyncClient(d.address) as client:
        first = asyncio.Event()
        task = asyncio.create_task(stream(client, LONG, first))
        await first.wait()
        [victim] = [w.worker_id for w in await client.stats() if w.num_running > 0]
        [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == victim]
        os.kill(pid, signal.SIGSTOP)
        struck = time.monotonic()
        try:
            outcome, _ = await asyncio.wait_for(task, 60)
            outcome_s = time.monotonic() - struck
        finally:
            os.kill(pid, signal.SIGCONT)
        freed_s = await freed_after(d.address, struck)
        await until(lambda: _health_is(client, "serving"))
    return Timing("decode worker hung mid-stream", outcome, outcome_s, freed_s, time.monotonic() - struck)


async def engine_crashed(d: Deployment) -> Timing:
    async def crash(client: AsyncClient) -> None:
        ray.get(d.decode_workers[0].actor.set_fault_plan.remote(FaultPlan(crash_step=True)))

    return await mid_stream(d, "engine loop crash", crash)


async def kv_stalled(d: Deployment) -> Timing:
    async with AsyncClient(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(stall_pushes=True)))
        sent = time.monotonic()
        outcome, _ = await stream(client, GREEDY)
        outcome_s = time.monotonic() - sent
    return Timing(
        f"KV stops arriving (TTL {TTL_S:.0f} s)", outcome, outcome_s, await freed_after(d.address, sent), None
    )


async def client_deadline(d: Deployment) -> Timing:
    async with AsyncClient(d.address, timeout_s=1.0) as client:
        sent = time.monotonic()
        outcome, _ = await stream(client, SamplingParams(max_tokens=700, temperature=0.0, ignore_eos=True))
        outcome_s = time.monotonic() - sent
    return Timing("client deadline (1 s)", outcome, outcome_s, await freed_after(d.address, sent), None)


STALL_S = 2.0  # engine_stall_timeout_s of the stall rows
STALLED = {"engine_stall_timeout_s": STALL_S}


async def decode_engine_stalled(d: Deployment, expected: list[int]) -> Timing:
    """A long stream's decode worker: its engine thread blocks for 8 s (a device hang) while its process runs."""
    async with AsyncClient(d.address) as client:
        first = asyncio.Event()
        task = asyncio.create_task(stream(client, LONG, first))
        await first.wait()
        [victim] = [w.worker_id for w in await client.stats() if w.num_running > 0]
        actor = next(w.actor for w in d.decode_workers if w.worker_id == victim)
        ray.get(actor.set_fault_plan.remote(FaultPlan(engine_hang_s=8.0)))
        struck = time.monotonic()
        outcome, _ = await asyncio.wait_for(task, 60)
        outcome_s = time.monotonic() - struck
        freed_s = await freed_after(d.address, struck)  # the stalled worker's blocks: once its engine turns again
        await until(lambda: _health_is(client, "serving"))
        done, tokens = await stream_prompt(client, PROMPT, GREEDY)
        assert done == "completed" and tokens == expected, done
    return Timing(
        f"decode engine stalled (stall timeout {STALL_S:g} s)", outcome, outcome_s, freed_s, time.monotonic() - struck
    )


async def prefill_engine_stalled(d: Deployment, expected: list[int]) -> Timing:
    """A 900-token prompt is being prefilled when the prefill worker's engine thread blocks for 8 s."""
    async with AsyncClient(d.address) as client:
        prefill = d.prefill_workers[0].actor
        ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        task = asyncio.create_task(stream_prompt(client, LONG_PROMPT, GREEDY))
        await until(lambda: _any_stats(client, lambda w: w.role == "prefill" and w.num_steps >= 3))
        ray.get(prefill.set_fault_plan.remote(FaultPlan(engine_hang_s=8.0)))
        struck = time.monotonic()
        outcome, _ = await asyncio.wait_for(task, 60)
        outcome_s = time.monotonic() - struck
        freed_s = await freed_after(d.address, struck)
        await until(lambda: _disaggregated_again(client, expected))
    return Timing(
        f"prefill engine stalled (stall timeout {STALL_S:g} s)", outcome, outcome_s, freed_s, time.monotonic() - struck
    )


async def prefill_hung(d: Deployment, expected: list[int]) -> Timing:
    """The prefill worker's process is stopped (SIGSTOP) mid-prefill, and resumed once the client has its outcome."""
    [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "prefill-0"]
    async with AsyncClient(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        task = asyncio.create_task(stream_prompt(client, LONG_PROMPT, GREEDY))
        await until(lambda: _any_stats(client, lambda w: w.role == "prefill" and w.num_steps >= 3))
        os.kill(pid, signal.SIGSTOP)
        struck = time.monotonic()
        try:
            outcome, _ = await asyncio.wait_for(task, 60)
            outcome_s = time.monotonic() - struck
        finally:
            os.kill(pid, signal.SIGCONT)
        freed_s = await freed_after(d.address, struck)
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(NO_FAULTS))
        await until(lambda: _disaggregated_again(client, expected))
    return Timing("prefill worker hung mid-prefill", outcome, outcome_s, freed_s, time.monotonic() - struck)


async def decode_hung_before_reservation(d: Deployment, expected: list[int]) -> Timing:
    """The only decode worker's process is stopped (SIGSTOP) before a disaggregated request arrives: the prefill
    worker's reservation call gets no answer. Resumed once the client has its outcome."""
    [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "decode-0"]
    async with AsyncClient(d.address) as client:
        os.kill(pid, signal.SIGSTOP)
        struck = time.monotonic()
        try:
            outcome, _ = await asyncio.wait_for(stream_prompt(client, PROMPT, GREEDY, "disaggregated"), 90)
            outcome_s = time.monotonic() - struck
        finally:
            os.kill(pid, signal.SIGCONT)
        freed_s = await freed_after(d.address, struck)
        await until(lambda: _health_is(client, "serving"))
        done, tokens = await stream_prompt(client, PROMPT, GREEDY, "disaggregated")
        assert done == "completed" and tokens == expected, done
    return Timing("decode worker hung before its reservation", outcome, outcome_s, freed_s, time.monotonic() - struck)


def router_killed_with_queued_prefills() -> Timing:
    """Five disaggregated requests queue on a slowed prefill worker when the router process dies: its
    reservations are withdrawn and its queued prefills dropped (blocks timed through the workers themselves)."""
    d = deployment(detached_workers=False)
    try:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.3)))

        async def send() -> float:
            async with AsyncClient(d.address, timeout_s=60) as client:
                prompts = [[random.Random(i).randrange(256) for _ in range(300)] for i in range(5)]
                tasks = [asyncio.create_task(stream_prompt(client, p, GREEDY)) for p in prompts]
                await until(lambda: _any_stats(client, lambda w: w.role == "decode" and w.num_remote_pending > 0))
                for router in d.routers:
                    ray.kill(router)
                killed = time.monotonic()
                await asyncio.gather(*tasks)
            return killed

        killed = asyncio.run(send())
        deadline = killed + 60
        while not all(
            w.blocks_free + w.blocks_cached == w.blocks_total and w.num_running + w.num_waiting == 0 for w in d.stats()
        ):
            assert time.monotonic() < deadline, d.stats()
            time.sleep(0.05)
        freed_s = time.monotonic() - killed
    finally:
        d.routers = []
        d.stop()
    return Timing("router killed, 5 prefills queued", "UNAVAILABLE (connection)", 0.0, freed_s, None)


async def _disaggregated_again(client: AsyncClient, expected: list[int]) -> bool:
    """A disaggregated request is prefilled by prefill-0 again (not locally, for want of a prefill worker)."""
    chunks = [c async for c in client.generate(PROMPT, GREEDY, mode="disaggregated")]
    meta = chunks[-1].metadata
    assert [t for c in chunks for t in c.token_ids] == expected
    return meta is not None and meta.prefill_worker == "prefill-0"


def router_restart(expected: list[int]) -> Timing:
    """The first router process dies; a second deployment's router finds the named workers and serves."""
    first = deployment(detached_workers=True)
    for router in first.routers:
        ray.kill(router)
    restarted = time.monotonic()
    second = deployment(detached_workers=True)
    try:

        async def serve() -> Timing:
            async with AsyncClient(second.address) as client:
                outcome, tokens = await stream(client, GREEDY)
            assert tokens == expected
            served_s = time.monotonic() - restarted
            freed_s = await freed_after(second.address, restarted)
            return Timing(
                "router restart (detached workers)", f"{outcome} by the same workers", served_s, freed_s, served_s
            )

        return asyncio.run(serve())
    finally:
        second.stop()


async def _any_stats(client: AsyncClient, predicate: Callable) -> bool:
    return any(predicate(w) for w in await client.stats())


async def _all_stats(client: AsyncClient, role: str, predicate: Callable) -> bool:
    workers = [w for w in await client.stats() if w.role == role]
    return bool(workers) and all(predicate(w) for w in workers)


async def _health_is(client: AsyncClient, status: str) -> bool:
    health = await client.health()
    return health.ok and health.status == status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", default="", help="run only the faults whose name contains this (several: separated by commas)"
    )
    args = parser.parse_args()
    expected = LLMEngine(ENGINE).generate([PROMPT], GREEDY)[0].token_ids
    hung = LLMEngine(HUNG_ENGINE).generate([PROMPT], GREEDY)[0].token_ids
    hung_transports: dict[str, dict[str, Any]] = {
        "grpc": {"transport": "grpc"},
        "nixl": {"transport": "nixl"},  # shared memory: writes into the stopped process still complete
        "nixl, UCX over TCP": {"transport": "nixl", "transport_config": NixlConfig(ucx_tls="tcp")},  # they hang
    }
    colocated = {"mode": "colocated", "num_prefill_workers": 0}
    scenarios: list[tuple[str, dict, Callable[[Deployment], Coroutine[Any, Any, Timing]]]] = [
        *[
            (f"prefill worker killed mid-push ({t})", {"transport": t}, lambda d: prefill_killed(d, expected))
            for t in ("grpc", "nixl")
        ],
        *[
            (f"decode worker killed mid-push ({t})", {"transport": t}, lambda d: decode_killed_mid_push(d, expected))
            for t in ("grpc", "nixl")
        ],
        *[
            (f"decode worker hung mid-push ({label})", {**HUNG, **over}, _hung_measure(hung, label))
            for label, over in hung_transports.items()
        ],
        ("decode worker hung before its reservation", {}, lambda d: decode_hung_before_reservation(d, expected)),
        # a reservation deadline past the silence timeout: the router's probe notices the hang, not the deadline
        ("prefill worker hung mid-prefill", {"reservation_ttl_s": 30.0}, lambda d: prefill_hung(d, expected)),
        ("prefill engine stalled", STALLED, lambda d: prefill_engine_stalled(d, expected)),
        (
            "decode engine stalled",
            {**colocated, **STALLED, "num_decode_workers": 2},
            lambda d: decode_engine_stalled(d, expected),
        ),
        ("decode worker killed mid-stream", {**colocated, "num_decode_workers": 2}, decode_killed),
        ("decode worker hung mid-stream", {**colocated, "num_decode_workers": 2}, decode_hung_mid_stream),
        ("engine loop crash", colocated, engine_crashed),
        ("KV stops arriving", {}, kv_stalled),
        ("client deadline", {}, client_deadline),
    ]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows: list[Timing] = []
        only = args.only.split(",")
        for name, overrides, measure in scenarios:
            if not any(o in name for o in only):
                continue
            d = deployment(**overrides)
            try:
                rows.append(asyncio.run(measure(d)))
            finally:
                d.stop()
        if any(o in "router restart (detached workers)" for o in only):
            rows.append(router_restart(expected))
        if any(o in "router killed, 5 prefills queued" for o in only):
            rows.append(router_killed_with_queued_prefills())
    finally:
        ray.shutdown()
    print(f"{'fault':<42} {'client outcome':<32} {'outcome s':>9} {'freed s':>7} {'serving s':>9}")
    for r in rows:
        serving = "-" if r.serving_s is None else f"{r.serving_s:.2f}"
        print(f"{r.fault:<42} {r.outcome:<32} {r.outcome_s:>9.2f} {r.freed_s:>7.2f} {serving:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
