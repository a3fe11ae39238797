"""KV block lifetimes across a prefill and a decode worker, in one process, with a transport that misbehaves.

The workers are the real ``PrefillWorker`` and ``DecodeWorker`` (their engines, loop threads and event
loops), wired to each other through stand-ins for Ray actor handles, and pushing through
``FakeTransport``: pushes that fail, hang, land late, land corrupt, or cannot be cancelled. After every
case: every block on both workers is free or cached, no job or reservation is left, no write landed in
blocks that were not held for it, and nothing waited past its bound.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.faults import FaultPlan
from pdserve.kv_transfer.base import ChunkNotification
from pdserve.kv_transfer.fake import FakeTransport, Fault
from pdserve.kv_transfer.grpc_transport import GrpcTransport
from pdserve.messages import TokenUpdate
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.transport_config import GrpcConfig

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, torch_threads=1, max_model_len=512
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(5).randrange(256) for _ in range(100)]  # 4 chunks of 32 tokens, 7 blocks of 16
ROUTER = "router-t"
KV_SECRET = "kv-secret-of-this-deployment"


class LocalActor:
    """Stands in for a Ray actor handle: ``actor.method.remote(...)`` runs the method on this event loop; what it
    raises arrives as Ray delivers it (a ``RayTaskError`` that is also an instance of the cause's type).

    ``dead``: calls raise ``ActorDiedError``; ``unavailable``: they raise ``ActorUnavailableError``;
    ``running`` cleared: the process hangs (SIGSTOP): calls and stream items wait until it is set again.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.dead = False
        self.unavailable = False
        self.running = asyncio.Event()
        self.running.set()
        self.calls: list[str] = []
        self.in_flight: Counter[str] = Counter()  # calls started and not returned, by method
        self.most_in_flight: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        actor = self

        class Method:
            @staticmethod
            def options(**_: Any) -> type:
                return Method

            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                if inspect.isasyncgenfunction(getattr(actor.obj, name)):  # a streaming call: awaitable items

                    async def items() -> AsyncIterator[asyncio.Future]:
                        async for item in getattr(actor.obj, name)(*args, **kwargs):
                            await actor.running.wait()
                            done = asyncio.get_running_loop().create_future()
                            done.set_result(item)
                            yield done

                    return items()

                async def call() -> Any:
                    actor.calls.append(name)
                    actor.in_flight[name] += 1
                    actor.most_in_flight[name] = max(actor.most_in_flight[name], actor.in_flight[name])
                    try:
                        await actor.running.wait()
                        if actor.dead:
                            raise ActorDiedError()
                        if actor.unavailable:
                            raise ActorUnavailableError("unavailable (test)", None)
                        try:
                            return await getattr(actor.obj, name)(*args, **kwargs)
                        except Exception as e:  # as Ray raises it: a RayTaskError that is also the cause's type
                            raise RayTaskError(name, f"{type(e).__name__}: {e}", e).as_instanceof_cause() from e
                    finally:
                        actor.in_flight[name] -= 1

                return asyncio.ensure_future(call())

        return Method


class Clock:
    """A worker's monotonic clock that a test can move forward (a deadline passes without waiting for it)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


class Pair:
    """A prefill and a decode worker joined by fake transports, with a stand-in router reading the events.
    Each worker has its own clock (``prefill_clock``, ``decode_clock``)."""

    def __init__(
        self,
        ttl_s: float = 6.0,
        push_timeout_s: float = 1.0,
        verify_kv: bool = True,
        stall_timeout_s: float = 30.0,
        transport: str = "fake",
    ) -> None:
        if transport == "grpc":  # a real gRPC KV service in this process, with a deployment's secret
            config = GrpcConfig(host="127.0.0.1", secret=KV_SECRET)
            self.sender, self.receiver = GrpcTransport(config), GrpcTransport(config)
        else:
            self.sender, self.receiver = FakeTransport(), FakeTransport()
        self.prefill_clock, self.decode_clock = Clock(), Clock()
        self.decode = DecodeWorker(
            "decode-t",
            ENGINE,
            self.receiver,
            reservation_ttl_s=ttl_s,
            verify_kv=verify_kv,
            engine_stall_timeout_s=stall_timeout_s,
            clock=self.decode_clock,
        )
        self.prefill = PrefillWorker(
            "prefill-t",
            ENGINE,
            self.sender,
            push_timeout_s=push_timeout_s,
            verify_kv=verify_kv,
            engine_stall_timeout_s=stall_timeout_s,
            clock=self.prefill_clock,
        )
        self.decode_actor, self.prefill_actor = LocalActor(self.decode), LocalActor(self.prefill)
        self.prefill.handle = self.prefill_actor
        self.updates: dict[str, list[TokenUpdate]] = defaultdict(list)
        self.finished: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def subscribe(self, router: Any = None) -> None:
        subscribed = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for item in self.decode.events(ROUTER, router):
                if not subscribed.done():
                    subscribed.set_result(None)
                for update in item.updates:
                    self.updates[update.request_id].append(update)
                    done = self.finished.get(update.request_id)
                    if update.finish_reason is not None and done is not None and not done.done():
                        done.set_result(update)

        self._reader = asyncio.create_task(read())
        await asyncio.wait_for(subscribed, 5)

    def router_dies(self) -> None:
        assert self._reader is not None
        self._reader.cancel()

    async def prefill_call(self, rid: str, prompt: list[int] = PROMPT, decode: Any = None) -> Any:
        decode = decode or self.decode_actor
        return await self.prefill_actor.prefill.remote(rid, prompt, GREEDY, decode, 5.0, ROUTER)

    async def decode_call(self, rid: str, first: Any) -> asyncio.Future:
        self.finished[rid] = asyncio.get_running_loop().create_future()
        await self.decode_actor.decode.remote(rid, first.first_token, first.first_token_time, ROUTER)
        return self.finished[rid]

    async def serve(self, rid: str, prompt: list[int] = PROMPT) -> tuple[list[int], TokenUpdate]:
        first = await self.prefill_call(rid, prompt)
        last = await asyncio.wait_for(await self.decode_call(rid, first), 10)
        return [first.first_token, *(t for u in self.updates[rid] for t in u.token_ids)], last

    async def router_abort(self, rid: str) -> None:
        """What the router does for a request that failed or was cancelled: prefill side first, then decode."""
        await asyncio.wait_for(self.prefill_actor.abort.remote(rid), 5)
        await asyncio.wait_for(self.decode_actor.abort.remote(rid), 5)

    async def blocks_in_use(self) -> tuple[int, int]:
        async def used(worker: Any) -> int:
            def count(engine: LLMEngine) -> int:
                engine.block_manager.check_integrity()
                blocks = engine.stats().blocks
                return blocks.total - blocks.free - blocks.cached

            return await worker.aengine.run(count)

        return await used(self.prefill), await used(self.decode)

    async def settled(self, timeout_s: float = 5.0) -> float:
        """Wait until nothing is held anywhere; returns how long that took. Fails on a stray write."""
        start = time.monotonic()
        while True:
            held = await self.blocks_in_use()
            jobs = dict(self.prefill._jobs)
            pending = dict(self.decode._pending) | dict(getattr(self.decode, "_releasing", {}))
            if held == (0, 0) and not jobs and not pending:
                break
            assert time.monotonic() - start < timeout_s, f"still held: blocks {held}, jobs {jobs}, pending {pending}"
            await asyncio.sleep(0.02)
        assert not getattr(self.receiver, "stray_writes", ()), (
            f"writes landed in blocks not held for them: {self.receiver.stray_writes}"  # type: ignore[attr-defined]
        )
        return time.monotonic() - start

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for worker in (self.prefill, self.decode):
            worker.aengine.close()
            worker.transport.close()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return LLMEngine(ENGINE).generate([PROMPT], GREEDY)[0].token_ids


def run(test: Callable[[Pair], Coroutine[Any, Any, None]], timeout_s: float = 30.0, **pair_kwargs: Any) -> None:
    async def main() -> None:
        pair = Pair(**pair_kwargs)
        try:
            await pair.subscribe()
            await asyncio.wait_for(test(pair), timeout_s)
        finally:
            pair.close()

    asyncio.run(main())


async def within(awaitable: Awaitable[Any], seconds: float) -> tuple[Any, float]:
    start = time.monotonic()
    result = await asyncio.wait_for(awaitable, seconds)
    return result, time.monotonic() - start


def test_a_clean_hand_off_decodes_the_expected_tokens_with_checked_kv(expected):
    async def case(p: Pair) -> None:
        tokens, last = await p.serve("ok")
        assert tokens == expected and last.error is None and last.finish_reason == "length"
        await p.settled()

    run(case)


def test_a_failed_push_fails_fast_and_the_abort_confirms_at_once(expected):
    async def case(p: Pair) -> None:
        p.sender.faults["bad"] = Fault("fail")
        with pytest.raises(RuntimeError, match="KV push failed"):
            await within(p.prefill_call("bad"), 3)
        _, took = await within(p.router_abort("bad"), 2)
        assert took < 1.0
        await p.settled(timeout_s=1.0)
        tokens, _ = await p.serve("after")  # the workers serve on
        assert tokens == expected
        await p.settled()

    run(case)


def test_a_hung_push_is_cancelled_at_its_timeout_and_the_job_torn_down():
    async def case(p: Pair) -> None:
        p.sender.faults["hung"] = Fault("hang")
        first = await p.prefill_call("hung")  # the first token goes back while the pushes are in flight
        last, took = await within(await p.decode_call("hung", first), 3)  # the decode worker hears at once
        assert last.error is not None and "longer than 1.0 s" in last.error and took < 2.0
        assert all(h.cancel_calls for h in p.sender.handles if h.notification.request_id == "hung")
        await p.router_abort("hung")
        await p.settled(timeout_s=1.0)

    run(case)


def expire(p: Pair) -> None:
    """The decode worker's reservation deadlines pass now (while the prefill worker's clock runs on)."""
    p.decode_clock.advance(p.decode.reservation_ttl_s + 0.1)


def test_an_uncancellable_push_keeps_the_blocks_past_the_deadline_until_it_is_over():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        first = await p.prefill_call("stuck")
        finished = await p.decode_call("stuck", first)
        expire(p)
        last = await asyncio.wait_for(finished, 2)
        assert last.error == "KV transfer deadline passed"  # the client hears at once ...
        p.prefill_clock.advance(1.1)  # ... and the prefill worker fails the push (1 s) but cannot cancel it
        job = p.prefill._jobs["stuck"]
        while (job.error is None and job.aborted is None) or (await p.blocks_in_use())[0]:
            await asyncio.sleep(0.01)
        prefill_held, decode_held = await p.blocks_in_use()
        assert decode_held > 0, "the deadline freed blocks that a one-sided write may still reach"
        assert (await p.decode.stats()).kv_blocks_quarantined == decode_held
        # the prefill worker's own blocks are back (a stale read lands only in quarantined blocks), the push tracked
        assert prefill_held == 0 and "stuck" in p.prefill._jobs
        assert not await p.prefill.abort("stuck", wait_s=0.2), "confirmed while the push may still land"
        for handle in p.sender.handles:
            handle.allow_cancel()
        await p.settled(timeout_s=2.0)

    run(case)


def test_a_push_that_lands_after_the_deadline_finds_its_blocks_still_held():
    async def case(p: Pair) -> None:
        # the last push lands 2 s after it started, long after the deadline; the transport cannot cancel it
        p.sender.fault_for = lambda n: Fault("late", delay_s=2.0, cancellable=False) if n.is_last else None
        first = await p.prefill_call("late")
        finished = await p.decode_call("late", first)
        expire(p)
        last = await asyncio.wait_for(finished, 2)
        assert last.error == "KV transfer deadline passed"
        await p.settled(timeout_s=4.0)
        assert p.receiver.writes == len(p.sender.handles)  # the late write did land, into blocks still held

    run(case)


def test_the_router_dying_after_the_first_token_frees_nothing_a_push_can_still_reach():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("late", delay_s=1.0, cancellable=False) if n.is_last else None
        first = await p.prefill_call("orphan")
        await p.decode_call("orphan", first)
        p.router_dies()  # its requests are orphaned while their last push is in flight
        await p.settled(timeout_s=5.0)

    run(case)


def test_reservation_expiry_with_a_push_in_flight_cancels_it_and_then_frees():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang") if n.is_last else None
        first = await p.prefill_call("expiring")
        finished = await p.decode_call("expiring", first)
        expire(p)
        last, took = await within(finished, 2)
        assert last.error == "KV transfer deadline passed" and took < 1.0
        _, freed = await within(p.settled(timeout_s=2.0), 3)
        assert freed < 0.5, "the deadline did not fence the prefill worker"
        assert all(h.cancel_calls for h in p.sender.handles if h.notification.is_last)

    run(case, push_timeout_s=3.0)


def test_a_corrupt_block_fails_the_request_clearly_with_verify_kv():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("corrupt") if n.chunk_index == 1 else None
        first = await p.prefill_call("corrupt")
        last = await asyncio.wait_for(await p.decode_call("corrupt", first), 5)
        assert last.error is not None and last.error.startswith("KV integrity check failed: block ")
        await p.settled()

    run(case)


def test_abort_while_queued_behind_a_prefill_that_waits_for_room_returns_at_once():
    async def case(p: Pair) -> None:
        hogs = [f"hog-{i}" for i in range(3)]
        for i, hog in enumerate(hogs):  # 60 of the decode worker's 64 blocks: the blocker cannot reserve its 7
            prompt = [random.Random(i).randrange(256) for _ in range(20 * 16)]
            assert await p.decode.reserve(hog, prompt, GREEDY) is not None
        blocker = asyncio.ensure_future(p.prefill_actor.prefill.remote("blocker", PROMPT, GREEDY, p.decode_actor, 5.0))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(p.prefill_call("queued"))
        await asyncio.sleep(0.1)
        _, took = await within(p.prefill_actor.abort.remote("queued"), 2)
        assert took < 0.5
        with pytest.raises(RuntimeError, match="aborted"):
            await queued
        _, took = await within(p.prefill_actor.abort.remote("blocker"), 2)  # aborted while reserving
        with pytest.raises(RuntimeError, match="aborted"):
            await blocker
        for hog in hogs:
            await p.decode.abort(hog, True)
        await p.settled()

    run(case)


def test_abort_mid_prefill_while_pushing_confirms_at_once():
    async def case(p: Pair) -> None:
        await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.2))
        p.sender.faults["mid"] = Fault("hang")
        call = asyncio.ensure_future(p.prefill_call("mid"))
        while not p.sender.handles:  # a chunk pushed (and hanging), the prompt not done
            await asyncio.sleep(0.01)
        assert not call.done()
        _, took = await within(p.router_abort("mid"), 2)
        assert took < 1.0
        with pytest.raises(RuntimeError, match="aborted"):
            await call
        await p.settled(timeout_s=1.0)

    run(case, push_timeout_s=3.0)


def test_abort_after_the_first_token_and_while_decoding_frees_everything():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("late", delay_s=0.5) if n.is_last else None
        first = await p.prefill_call("kv-in-flight")
        await p.router_abort("kv-in-flight")  # KV still on its way: the late push is cancelled
        await p.settled(timeout_s=2.0)
        p.sender.fault_for = None
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        first = await p.prefill_actor.prefill.remote("decoding", PROMPT, long, p.decode_actor, 5.0)
        finished = await p.decode_call("decoding", first)
        while not p.updates["decoding"]:
            await asyncio.sleep(0.01)
        await p.router_abort("decoding")
        last = await asyncio.wait_for(finished, 2)
        assert last.finish_reason == "abort"
        await p.settled()

    run(case)


def test_a_dead_prefill_worker_releases_the_reservation_and_an_unavailable_one_does_not():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        first = await p.prefill_call("gone")
        finished = await p.decode_call("gone", first)
        p.prefill_actor.unavailable = True  # maybe alive, maybe still pushing
        await p.decode_actor.abort.remote("gone")
        assert (await asyncio.wait_for(finished, 2)).finish_reason == "abort"
        await asyncio.sleep(0.5)
        _, decode_held = await p.blocks_in_use()
        assert decode_held > 0, "blocks freed on ActorUnavailableError"
        p.prefill_actor.unavailable, p.prefill_actor.dead = False, True  # Ray: the process is dead
        start = time.monotonic()
        while (await p.blocks_in_use())[1]:
            assert time.monotonic() - start < 3, "a dead prefill worker's reservation was not freed"
            await asyncio.sleep(0.02)
        p.prefill_actor.dead = False
        for handle in p.sender.handles:
            handle.allow_cancel()
        await p.prefill.abort("gone")
        await p.settled()

    run(case)


def test_a_step_that_samples_nothing_waits_for_the_device_before_its_kv_is_pushed(monkeypatch):
    import torch

    from pdserve.engine import model_runner

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    model_runner.synchronize(torch.device("cpu"))
    assert synced == []  # the CPU path is unchanged
    model_runner.synchronize(torch.device("cuda:0"))
    assert synced == [torch.device("cuda:0")]

    steps: list[torch.device] = []
    monkeypatch.setattr(model_runner, "synchronize", steps.append)
    engine = LLMEngine(ENGINE)
    engine.add_request(PROMPT, GREEDY, "chunked")
    engine.step()  # the first 32-token chunk of 100: nothing sampled, KV to push
    assert steps == [engine.device]


def test_the_router_starts_the_decode_before_the_client_reads_the_first_token(expected):
    from pdserve.engine.config import ModelConfig
    from pdserve.router.config import RouterConfig
    from pdserve.router.router import GenerateInput, ModelLimits, Router, WorkerHandle

    async def case(p: Pair) -> None:
        model = ModelConfig.load("tiny")
        router = Router(
            RouterConfig(default_mode="disaggregated"),
            [WorkerHandle("decode-t", "decode", p.decode_actor)],
            [WorkerHandle("prefill-t", "prefill", p.prefill_actor)],
            ModelLimits(model.vocab_size, ENGINE.max_model_len),
            None,
            ROUTER + "-2",
        )
        await router.start(5)
        try:
            stream = router.generate(GenerateInput(None, PROMPT, GREEDY, "disaggregated"))
            first = await stream.__anext__()
            await asyncio.sleep(0.5)  # a slow reader: the next event is not asked for yet
            assert "decode" in p.decode_actor.calls, "the decode waits for the client to read the first token"
            tokens = list(first.token_ids)
            async for event in stream:
                tokens += event.token_ids
            assert tokens == expected
        finally:
            await router.close()
        await p.settled()

    run(case)


def test_a_push_that_cannot_be_cancelled_ends_when_its_decode_worker_is_dead():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        await p.prefill_call("to-the-dead")
        p.decode_actor.dead = True  # its process is gone (Ray says ActorDiedError): its memory with it
        start = time.monotonic()
        while "to-the-dead" in p.prefill._jobs or (await p.blocks_in_use())[0]:
            assert time.monotonic() - start < 5, "the prefill worker holds its blocks for a dead receiver"
            await asyncio.sleep(0.05)
        assert time.monotonic() - start > 1.0  # not before the push timed out and would not cancel

    run(case)


def test_a_hung_decode_worker_fails_its_request_at_the_silence_timeout_and_runs_the_abort_when_it_resumes():
    from pdserve.engine.config import ModelConfig
    from pdserve.router.config import RouterConfig
    from pdserve.router.router import GenerateInput, ModelLimits, RequestError, Router, WorkerHandle

    async def case(p: Pair) -> None:
        router = Router(
            RouterConfig(default_mode="disaggregated", decode_silence_timeout_s=1.0),
            [WorkerHandle("decode-t", "decode", p.decode_actor)],
            [WorkerHandle("prefill-t", "prefill", p.prefill_actor)],
            ModelLimits(ModelConfig.load("tiny").vocab_size, ENGINE.max_model_len),
            None,
            ROUTER + "-2",
        )
        await router.start(5)
        try:
            stream = router.generate(GenerateInput(None, PROMPT, GREEDY, "disaggregated"))
            first = asyncio.ensure_future(stream.__anext__())
            while not p.decode._pending:  # reserved: its KV is on the way (one-sided writes land regardless)
                await asyncio.sleep(0.005)
            p.decode_actor.running.clear()
            hung = time.monotonic()
            await asyncio.wait_for(first, 5)  # the prefill worker's first token
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(stream.__anext__(), 5)
            assert err.value.code == "UNAVAILABLE" and "decode-t" in str(err.value), err.value
            assert 0.5 <= time.monotonic() - hung < 3.0  # its last heartbeat came up to 0.5 s before it hung
            assert not router.active and not router.policy.is_available("decode-t")
            p.decode_actor.running.set()  # it resumes: the queued decode, then the router's abort, run
            await p.settled()
            while not router.policy.is_available("decode-t"):
                await asyncio.sleep(0.05)
            events = [e async for e in router.generate(GenerateInput(None, PROMPT, GREEDY, "disaggregated"))]
            assert sum(len(e.token_ids) for e in events) == GREEDY.max_tokens  # served again, disaggregated
        finally:
            await router.close()
        await p.settled()

    run(case)


def test_an_idle_decode_worker_is_not_taken_for_a_hung_one(expected):
    from pdserve.engine.config import ModelConfig
    from pdserve.router.config import RouterConfig
    from pdserve.router.router import GenerateInput, ModelLimits, Router, WorkerHandle

    async def case(p: Pair) -> None:
        router = Router(
            RouterConfig(default_mode="disaggregated", decode_silence_timeout_s=1.0),
            [WorkerHandle("decode-t", "decode", p.decode_actor)],
            [WorkerHandle("prefill-t", "prefill", p.prefill_actor)],
            ModelLimits(ModelConfig.load("tiny").vocab_size, ENGINE.max_model_len),
            None,
            ROUTER + "-3",
        )
        await router.start(5)
        try:
            await asyncio.sleep(2.5)  # idle, with nothing to stream, for well past the silence timeout
            assert router.policy.is_available("decode-t") and not router._events.down("decode-t").is_set()
            events = [e async for e in router.generate(GenerateInput(None, PROMPT, GREEDY, "disaggregated"))]
            assert [t for e in events for t in e.token_ids] == expected
        finally:
            await router.close()
        await p.settled()

    run(case)


# ---- when a peer hangs, lies or goes away ----------------------------------------------------------------------


class ExtraDecode:
    """A second decode worker (its own fake receiver), subscribed for the pair's stand-in router."""

    def __init__(self, worker_id: str = "decode-u") -> None:
        self.worker = DecodeWorker(worker_id, ENGINE, FakeTransport(), reservation_ttl_s=6.0, verify_kv=True)
        self.actor = LocalActor(self.worker)
        self.updates: dict[str, list[TokenUpdate]] = defaultdict(list)
        self._reader: asyncio.Task | None = None

    async def subscribe(self) -> None:
        subscribed = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for item in self.worker.events(ROUTER):
                if not subscribed.done():
                    subscribed.set_result(None)
                for update in item.updates:
                    self.updates[update.request_id].append(update)

        self._reader = asyncio.create_task(read())
        await asyncio.wait_for(subscribed, 5)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.worker.aengine.close()
        self.worker.transport.close()


def random_prompt(seed: int, n: int) -> list[int]:
    return [random.Random(seed).randrange(256) for _ in range(n)]


def router_over(p: Pair, *, decodes: list[tuple[str, Any]] | None = None, **config: Any) -> Any:
    from pdserve.engine.config import ModelConfig
    from pdserve.router.policy import RouterConfig
    from pdserve.router.router import ModelLimits, Router, WorkerHandle

    decodes = decodes or [("decode-t", p.decode_actor)]
    return Router(
        RouterConfig(**{"default_mode": "disaggregated", "decode_silence_timeout_s": 1.0, **config}),
        [WorkerHandle(wid, "decode", actor) for wid, actor in decodes],
        [WorkerHandle("prefill-t", "prefill", p.prefill_actor)],
        ModelLimits(ModelConfig.load("tiny").vocab_size, ENGINE.max_model_len),
        None,
        ROUTER + "-r",
    )


async def serve_through(router: Any, prompt: list[int] = PROMPT, mode: str = "disaggregated", **kw: Any) -> list[int]:
    from pdserve.router.router import GenerateInput

    events = [e async for e in router.generate(GenerateInput(None, prompt, kw.pop("params", GREEDY), mode, **kw))]
    return [t for e in events for t in e.token_ids]


def test_a_cancel_that_reports_success_while_its_write_still_lands_is_caught_before_the_blocks_are_reused():
    """A transport whose cancel lies (as NIXL's release did) is modelled by the fake: the decode worker frees
    the blocks on the prefill worker's (wrong) confirmation, the write lands in free blocks, and --verify-kv
    finds them changed when the next reservation takes them."""

    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("late", delay_s=1.0, lands_after_cancel=True) if n.is_last else None
        first = await p.prefill_call("liar")
        finished = await p.decode_call("liar", first)
        expire(p)
        assert (await asyncio.wait_for(finished, 2)).error == "KV transfer deadline passed"
        await p.settled(timeout_s=2.0)  # freed on the lie, before the write lands
        late = next(h for h in p.sender.handles if h.notification.is_last)
        while late.landed_at is None:
            await asyncio.sleep(0.02)
        hogs = [(f"hog-{i}", random_prompt(40 + i, 30 * 16)) for i in range(2)]  # 60 blocks: every free one
        for rid, prompt in hogs:
            assert await p.decode.reserve(rid, prompt, GREEDY) is not None
        assert p.decode.num_late_writes >= 1, "a write into freed blocks went unnoticed"
        assert (await p.decode.stats()).kv_late_writes == p.decode.num_late_writes
        for rid, _ in hogs:
            await p.decode.abort(rid, True)

    run(case)


def test_a_hung_decode_worker_does_not_hold_up_prefills_for_another_and_their_aborts_return_at_once(monkeypatch):
    from pdserve.prefill_node import worker as prefill_module

    monkeypatch.setattr(prefill_module, "RESERVE_CALL_TIMEOUT_S", 1.5)
    other = ExtraDecode()

    async def case(p: Pair) -> None:
        await other.subscribe()
        p.decode_actor.running.clear()  # SIGSTOP: its reserve calls never answer
        stuck = asyncio.ensure_future(p.prefill_call("to-the-hung"))
        await asyncio.sleep(0.3)
        queued = asyncio.ensure_future(p.prefill_call("queued-for-the-hung"))
        first, took = await within(p.prefill_call("to-the-healthy", decode=other.actor), 3)
        assert took < 1.5, f"a prefill for a healthy decode worker waited {took:.1f} s behind a hung one"
        _, took = await within(p.prefill_actor.abort.remote("queued-for-the-hung"), 2)
        assert took < 0.5
        with pytest.raises(RuntimeError, match="aborted"):
            await queued
        with pytest.raises(prefill_module.DecodeUnavailable, match="did not answer a reservation"):
            await asyncio.wait_for(stuck, 3)
        await other.actor.decode.remote("to-the-healthy", first.first_token, first.first_token_time, ROUTER)
        p.decode_actor.running.set()  # it resumes: the reservation it made late is given back
        await p.settled()
        while other.worker._pending or not any(u.finish_reason for u in other.updates["to-the-healthy"]):
            await asyncio.sleep(0.02)

    try:
        run(case)
    finally:
        other.close()


def test_a_full_decode_worker_does_not_hold_up_prefills_for_another():
    other = ExtraDecode()

    async def case(p: Pair) -> None:
        await other.subscribe()
        hogs = [f"hog-{i}" for i in range(3)]  # 60 of the decode worker's 64 blocks: PROMPT's 7 do not fit
        for i, hog in enumerate(hogs):
            assert await p.decode.reserve(hog, random_prompt(i, 20 * 16), GREEDY) is not None
        waiting = asyncio.ensure_future(p.prefill_call("waits-for-room"))
        await asyncio.sleep(0.3)
        _, took = await within(p.prefill_call("for-the-other", decode=other.actor), 3)
        assert took < 1.5, f"a prefill for a decode worker with room waited {took:.1f} s behind a full one"
        assert not waiting.done()
        for hog in hogs:
            await p.decode.abort(hog, True)
        first = await asyncio.wait_for(waiting, 3)  # room again: it goes ahead
        last = await asyncio.wait_for(await p.decode_call("waits-for-room", first), 5)
        assert last.finish_reason == "length"
        await other.actor.abort.remote("for-the-other")
        await p.settled()

    try:
        run(case)
    finally:
        other.close()


def test_a_stalled_decode_engine_fails_its_streams_naming_it_and_takes_no_work_until_it_turns_again(expected):
    from pdserve.router.router import RequestError

    async def case(p: Pair) -> None:
        router = router_over(p)
        await router.start(5)
        try:
            long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            stream = serve_through(router, mode="colocated", params=long)
            streaming = asyncio.ensure_future(stream)
            while not p.decode._served:
                await asyncio.sleep(0.01)
            await p.decode.set_fault_plan(FaultPlan(engine_hang_s=4.0))  # its engine thread blocks; its process runs
            hung = time.monotonic()
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(streaming, 5)
            status_s = time.monotonic() - hung
            assert err.value.code == "UNAVAILABLE" and "decode worker decode-t is hung" in str(err.value), err.value
            assert status_s < 2.5, status_s
            assert not router.policy.is_available("decode-t")
            ok, status = await router.health()
            assert not ok and "decode-t" in status
            with pytest.raises(RequestError) as err:
                await serve_through(router, mode="colocated")
            assert err.value.code == "UNAVAILABLE"  # nothing is routed to it meanwhile
            while not router.policy.is_available("decode-t"):  # the hang ends: it serves again
                await asyncio.sleep(0.05)
            assert await serve_through(router, mode="colocated") == expected
        finally:
            await router.close()
        await p.settled()

    run(case, stall_timeout_s=1.0)


def test_a_stalled_prefill_engine_fails_its_prefills_naming_it_and_is_routed_to_again_once_it_turns(expected):
    from pdserve.router.router import RequestError

    async def case(p: Pair) -> None:
        router = router_over(p)
        await router.start(5)
        try:
            await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.1, engine_hang_s=4.0))
            hung = time.monotonic()
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(serve_through(router), 5)
            status_s = time.monotonic() - hung
            assert err.value.code == "UNAVAILABLE" and "prefill worker prefill-t is hung" in str(err.value), err.value
            assert status_s < 2.5, status_s
            assert not router.policy.is_available("prefill-t")
            ok, status = await router.health()
            assert ok and "prefill-t" in status  # serving (colocated), naming the hung worker
            await p.prefill.set_fault_plan(FaultPlan())
            while not router.policy.is_available("prefill-t"):
                await asyncio.sleep(0.05)
            assert await serve_through(router) == expected
        finally:
            await router.close()
        await p.settled(timeout_s=10)

    run(case, stall_timeout_s=1.0)


def test_a_hung_prefill_process_fails_its_prefills_at_the_silence_timeout():
    from pdserve.router.router import RequestError

    async def case(p: Pair) -> None:
        router = router_over(p)
        await router.start(5)
        try:
            await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.3))  # 10 chunks: the first token in ~3 s
            request = asyncio.ensure_future(serve_through(router, random_prompt(9, 300)))
            while not p.prefill._jobs:
                await asyncio.sleep(0.01)
            # SIGSTOP: it answers nothing, not even ready() (in this one process the prefill under way goes on)
            p.prefill_actor.running.clear()
            hung = time.monotonic()
            with pytest.raises(RequestError) as err:
                await asyncio.wait_for(request, 5)
            assert err.value.code == "UNAVAILABLE" and "prefill worker prefill-t is hung" in str(err.value), err.value
            assert time.monotonic() - hung < 2.5
            assert not router.policy.is_available("prefill-t")
            p.prefill_actor.running.set()
            while not router.policy.is_available("prefill-t"):
                await asyncio.sleep(0.05)
            await p.prefill.set_fault_plan(FaultPlan())
        finally:
            await router.close()
        await p.settled(timeout_s=10)

    run(case)


def test_a_kv_deadline_that_passes_before_the_first_token_reaches_the_router_at_once():
    from pdserve.router.router import RequestError

    async def case(p: Pair) -> None:
        router = router_over(p)
        await router.start(5)
        try:
            await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.5))  # 4 chunks: the first token in ~2 s
            request = asyncio.ensure_future(serve_through(router))
            while not p.decode._pending:
                await asyncio.sleep(0.01)
            expire(p)
            with pytest.raises(RequestError) as err:
                await within(request, 0.5)  # the first token is ~2 s away: the router hears from the decode side
            assert err.value.code == "UNAVAILABLE" and "KV transfer deadline passed" in str(err.value), err.value
            await p.prefill.set_fault_plan(FaultPlan())
        finally:
            await router.close()
        await p.settled(timeout_s=5)

    run(case)


def test_a_dead_routers_reservations_are_withdrawn_and_its_queued_prefills_dropped():
    async def case(p: Pair) -> None:
        await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.3))
        calls = [asyncio.ensure_future(p.prefill_call(f"orphan-{i}", random_prompt(i, 100))) for i in range(5)]
        while not p.decode._pending:
            await asyncio.sleep(0.01)
        p.router_dies()
        await p.settled(timeout_s=3.0)  # not at the reservations' deadline (6 s)
        for call in calls:
            with pytest.raises(Exception):  # noqa: B017 - aborted, or refused for a router that is gone
                await asyncio.wait_for(call, 2)
        await p.prefill.set_fault_plan(FaultPlan())

    run(case)


def test_every_abort_of_a_job_resolves_once_its_pushes_are_over():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        await p.prefill_call("twice")
        aborts = [asyncio.ensure_future(p.prefill.abort("twice", wait_s=10)) for _ in range(2)]
        await asyncio.sleep(0.3)
        assert not any(a.done() for a in aborts)  # the last push cannot be cancelled yet
        for handle in p.sender.handles:
            handle.allow_cancel()
        results, took = await within(asyncio.gather(*aborts), 2)
        assert results == [True, True] and took < 1.0
        await p.decode.abort("twice", True)
        await p.settled()

    run(case)


def test_repeated_fences_of_an_unconfirmed_push_do_not_pile_up_calls(monkeypatch):
    from pdserve.decode_node import worker as decode_module

    monkeypatch.setattr(decode_module, "FENCE_WAIT_S", 0.2)
    monkeypatch.setattr(decode_module, "FENCE_CALL_SLACK_S", 0.1)
    monkeypatch.setattr(decode_module, "FENCE_CALL_TIMEOUT_S", 0.2, raising=False)

    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        first = await p.prefill_call("fenced")
        finished = await p.decode_call("fenced", first)
        expire(p)
        await asyncio.wait_for(finished, 2)
        await asyncio.sleep(2.0)  # the fence asks again and again: each call answers (False) in 0.2 s
        assert p.prefill_actor.calls.count("abort") >= 3
        assert p.prefill_actor.most_in_flight["abort"] <= 1, p.prefill_actor.most_in_flight
        assert (await p.decode.stats()).kv_blocks_quarantined == 7  # PROMPT's 7 blocks, none cached
        for handle in p.sender.handles:
            handle.allow_cancel()
        await p.settled(timeout_s=3.0)
        assert (await p.decode.stats()).kv_blocks_quarantined == 0

    run(case)


# ---- a KV peer that holds the deployment's secret but lies -----------------------------------------------------


class RoguePeer:
    """Speaks the KV service's wire protocol with the deployment's secret (the generated stub, as any program
    could), sending whatever a test asks: what a buggy or compromised peer inside the deployment could do."""

    def __init__(self, target: Any, block_bytes: int, sender: str = "rogue") -> None:
        import grpc

        from pdserve.proto import kv_transfer_pb2_grpc as pb_grpc

        self.target, self.block_bytes, self.sender = target, block_bytes, sender
        self.channel = grpc.insecure_channel(target.address)
        self.stub = pb_grpc.KVTransferStub(self.channel)

    def push(self, request_id: str, blocks: dict[int, bytes], notice: ChunkNotification | None) -> Any:
        """One stream: the blocks (pool block -> bytes), then the notification (on a block-less message if the
        blocks are none). Returns the gRPC status code."""
        import grpc

        from pdserve.kv_transfer.grpc_transport import push_proof
        from pdserve.proto import kv_transfer_pb2 as pb

        header = {"target_id": self.target.target_id, "block_bytes": self.block_bytes}
        messages = [pb.BlockPayload(**header, dst_block_ids=[b], data=data) for b, data in blocks.items()]
        if not messages:
            messages = [pb.BlockPayload(**header)]
        if notice is not None:
            messages[-1].notification.CopyFrom(
                pb.ChunkNotice(
                    request_id=notice.request_id,
                    chunk_index=notice.chunk_index,
                    tokens_done=notice.tokens_done,
                    is_last=notice.is_last,
                )
            )
        proof = push_proof(KV_SECRET, self.target.target_id, request_id, self.sender)
        metadata = [
            ("x-pdserve-request-id", request_id),
            ("x-pdserve-kv-sender", self.sender),
            ("x-pdserve-kv-auth", proof),
        ]
        try:
            self.stub.PushBlocks(iter(messages), timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.channel.close()


async def push_from(rogue: RoguePeer, *args: Any) -> Any:
    return await asyncio.to_thread(rogue.push, *args)


def test_a_peer_with_the_secret_cannot_write_a_cached_prefix_forge_a_last_push_or_speak_for_another(expected):
    import grpc

    async def case(p: Pair) -> None:
        tokens, _ = await p.serve("first")  # its prompt's leading blocks are now in the decode worker's cache
        assert tokens == expected
        await p.settled()
        target = p.decode.target
        block_bytes = target.block_bytes
        rogue = RoguePeer(target, block_bytes)
        try:
            reservation = await p.decode.reserve("again", PROMPT, GREEDY, None, ROUTER, "rogue")
            assert reservation is not None and reservation.num_cached_tokens == 96  # 6 blocks shared
            cached, own = reservation.block_ids[0], reservation.block_ids[-1]
            before = await p.decode.aengine.run(lambda e: e.kv_cache[cached].clone())
            refused = (await p.decode.stats()).kv_pushes_refused
            last = ChunkNotification("again", 0, len(PROMPT), True)
            # a write into the reservation's shared prefix (other requests read those blocks)
            code = await push_from(rogue, "again", {cached: b"\xff" * block_bytes}, last)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            after = await p.decode.aengine.run(lambda e: e.kv_cache[cached].clone())
            assert after.equal(before), "a push changed a cached prefix block"
            # a block-less stream for a request that has no reservation here
            ghost = ChunkNotification("ghost", 0, 1, True)
            assert await push_from(rogue, "ghost", {}, ghost) == grpc.StatusCode.PERMISSION_DENIED
            # a notification for another request than the stream's
            assert await push_from(rogue, "again", {}, ghost) == grpc.StatusCode.PERMISSION_DENIED
            assert (await p.decode.stats()).kv_pushes_refused == refused + 3
            # "is_last" with none of its own block written: never admitted
            assert await push_from(rogue, "again", {}, last) == grpc.StatusCode.OK
            p.finished["again"] = asyncio.get_running_loop().create_future()
            await p.decode_actor.decode.remote("again", 1, time.time(), ROUTER)
            end = await asyncio.wait_for(p.finished["again"], 5)
            assert end.error is not None and end.error.startswith("KV incomplete"), end
            assert not p.updates["again"][:-1], "it decoded without its KV"
            # a reservation made for another sender: the rogue's notification does not count
            reservation = await p.decode.reserve("theirs", PROMPT, GREEDY, None, ROUTER, "prefill-x")
            assert reservation is not None
            own = reservation.block_ids[-1]
            mine = ChunkNotification("theirs", 0, len(PROMPT), True)
            code = await push_from(rogue, "theirs", {own: b"\x01" * block_bytes}, mine)
            assert code == grpc.StatusCode.PERMISSION_DENIED  # its blocks are for prefill-x's pushes only
            assert await push_from(rogue, "theirs", {}, mine) == grpc.StatusCode.PERMISSION_DENIED
            assert p.decode._pending["theirs"].pushes_seen == set(), "a push from another sender counted"
            await p.decode.abort("theirs", True)
        finally:
            rogue.close()
        await p.settled()

    run(case, transport="grpc")


def test_a_notification_from_another_sender_is_refused_and_the_real_one_completes_the_request(expected):
    async def case(p: Pair) -> None:
        stranger = FakeTransport()
        assert p.sender.layout is not None
        stranger.register_pool(p.sender._pool.clone(), p.sender.layout.compatibility)  # type: ignore[union-attr]
        p.sender.fault_for = lambda n: Fault("late", delay_s=0.5) if n.is_last else None
        first = await p.prefill_call("real")
        stranger.push(p.decode.target, [], [], ChunkNotification("real", 99, len(PROMPT), True))
        last = await asyncio.wait_for(await p.decode_call("real", first), 5)
        assert last.error is None and last.finish_reason == "length"
        assert [first.first_token, *(t for u in p.updates["real"] for t in u.token_ids)] == expected
        assert p.decode.num_notifications_refused == 1
        stranger.close()
        await p.settled()

    run(case)


class RouterStandIn:
    async def alive(self) -> bool:
        return True


def test_a_router_whose_process_died_has_its_stream_ended_and_its_reservations_withdrawn(monkeypatch):
    """Ray does not end a stream whose reader's process died: the decode worker asks the router itself."""
    from pdserve.decode_node import worker as decode_module

    monkeypatch.setattr(decode_module, "ROUTER_PROBE_S", 0.1)
    router = LocalActor(RouterStandIn())

    async def case(p: Pair) -> None:
        assert p._reader is not None
        p._reader.cancel()  # the pair's own subscription: replaced by one that names its router
        await asyncio.sleep(0.05)
        await p.subscribe(router)
        await p.prefill.set_fault_plan(FaultPlan(step_delay_s=0.3))
        calls = [asyncio.ensure_future(p.prefill_call(f"orphan-{i}", random_prompt(i, 100))) for i in range(3)]
        while not p.decode._pending:
            await asyncio.sleep(0.01)
        router.dead = True  # Ray now says the router's process died; the stream's reader task stays (a zombie)
        await p.settled(timeout_s=3.0)
        assert p._reader is not None and p._reader.done()  # the stream ended
        for call in calls:
            with pytest.raises(Exception):  # noqa: B017 - aborted, or refused for a router that is gone
                await asyncio.wait_for(call, 2)
        await p.prefill.set_fault_plan(FaultPlan())

    run(case)
