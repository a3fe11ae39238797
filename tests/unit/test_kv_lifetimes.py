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
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.kv_transfer.fake import FakeTransport, Fault
from pdserve.messages import TokenUpdate
from pdserve.prefill_node.worker import PrefillWorker

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, torch_threads=1, max_model_len=512
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(5).randrange(256) for _ in range(100)]  # 4 chunks of 32 tokens, 7 blocks of 16
ROUTER = "router-t"


class LocalActor:
    """Stands in for a Ray actor handle: ``actor.method.remote(...)`` runs the method on this event loop.

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
                    await actor.running.wait()
                    if actor.dead:
                        raise ActorDiedError()
                    if actor.unavailable:
                        raise ActorUnavailableError("unavailable (test)", None)
                    return await getattr(actor.obj, name)(*args, **kwargs)

                return asyncio.ensure_future(call())

        return Method


class Pair:
    """A prefill and a decode worker joined by fake transports, with a stand-in router reading the events."""

    def __init__(self, ttl_s: float = 6.0, push_timeout_s: float = 1.0, verify_kv: bool = True) -> None:
        self.sender, self.receiver = FakeTransport(), FakeTransport()
        self.decode = DecodeWorker("decode-t", ENGINE, self.receiver, reservation_ttl_s=ttl_s, verify_kv=verify_kv)
        self.prefill = PrefillWorker(
            "prefill-t", ENGINE, self.sender, push_timeout_s=push_timeout_s, verify_kv=verify_kv
        )
        self.decode_actor, self.prefill_actor = LocalActor(self.decode), LocalActor(self.prefill)
        self.prefill.handle = self.prefill_actor
        self.updates: dict[str, list[TokenUpdate]] = defaultdict(list)
        self.finished: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def subscribe(self) -> None:
        subscribed = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for item in self.decode.events(ROUTER):
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

    async def prefill_call(self, rid: str, prompt: list[int] = PROMPT) -> Any:
        return await self.prefill_actor.prefill.remote(rid, prompt, GREEDY, self.decode_actor, 5.0)

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
        assert not self.receiver.stray_writes, (
            f"writes landed in blocks not held for them: {self.receiver.stray_writes}"
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


def expire_soon(p: Pair, rid: str, in_s: float = 0.3) -> None:
    """Bring the reservation's deadline forward (a decode worker whose deadline passes while a push is out)."""
    p.decode._pending[rid].deadline = time.monotonic() + in_s


def test_an_uncancellable_push_keeps_the_blocks_past_the_deadline_until_it_is_over():
    async def case(p: Pair) -> None:
        p.sender.fault_for = lambda n: Fault("hang", cancellable=False) if n.is_last else None
        first = await p.prefill_call("stuck")
        finished = await p.decode_call("stuck", first)
        expire_soon(p, "stuck")
        last = await asyncio.wait_for(finished, 2)
        assert last.error == "KV transfer deadline passed"  # the client hears at once ...
        await asyncio.sleep(1.5)  # ... and the prefill worker has failed the push (1 s) but cannot cancel it
        prefill_held, decode_held = await p.blocks_in_use()
        assert decode_held > 0, "the deadline freed blocks that a one-sided write may still reach"
        assert prefill_held > 0 and "stuck" in p.prefill._jobs
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
        expire_soon(p, "late")
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
        expire_soon(p, "expiring")
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
        await p.prefill.inject_fault("slow_steps")  # 200 ms per step
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
