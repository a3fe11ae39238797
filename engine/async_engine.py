"""An engine for asyncio code: commands awaited, token events streamed per request.

The engine runs in an ``EngineLoop`` thread; the node (a Ray actor) lives on an asyncio event loop.
``AsyncEngine`` is the bridge: ``await run(fn)`` applies a command between steps, and the loop thread
``emit``s events into per-request queues that ``stream`` drains. No Ray and no gRPC in here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple, TypeVar

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine, RequestOutput, StepStats
from pdserve.engine.request import Request

T = TypeVar("T")


class TokenEvent(NamedTuple):
    """What a worker streams for one request: new tokens, and on the last event the outcome."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    metadata: dict[str, Any] | None = None
    error: str | None = None  # set when the request failed on the worker (then finished is True)


class WorkerStats(NamedTuple):
    worker_id: str
    role: str
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_used: int
    num_running: int
    num_waiting: int
    num_remote_pending: int
    tokens_in_flight: int
    num_steps: int
    kv_bytes_moved: int
    steps: list[StepStats]
    node: str = ""  # filled by the worker actor: the Ray node it runs on
    device: str = ""


def request_timings(request: Request) -> dict[str, Any]:
    """Queue and prefill times of a request as this worker saw them."""
    t = request.times
    scheduled = t.first_scheduled if t.first_scheduled is not None else t.arrival
    first = t.first_token if t.first_token is not None else scheduled
    return {
        "queue_s": max(0.0, scheduled - t.arrival),
        "prefill_s": max(0.0, first - scheduled),
        "first_token_time": first,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_cached_tokens": request.num_cached_tokens,
    }


class AsyncEngine:
    """Binds to the event loop of its first ``run``/``open_stream`` (a Ray async actor's loop)."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        on_tick: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._aio: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.loop = EngineLoop(engine, on_step=on_step, on_tick=on_tick)

    def _bind(self) -> asyncio.AbstractEventLoop:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()
        return self._aio

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Apply ``fn(engine)`` on the loop thread between steps and return its result."""
        return await asyncio.wrap_future(self.loop.call(fn), loop=self._bind())

    # ---- per-request streams (open on the event loop; emit from the loop thread) ----------------
    def open_stream(self, request_id: str) -> None:
        self._bind()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} already has a stream on this worker")
        self._queues[request_id] = asyncio.Queue()

    def close_stream(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def emit(self, request_id: str, event: TokenEvent) -> None:
        """Thread-safe: queue an event for the request's stream (dropped when nobody listens)."""
        queue = self._queues.get(request_id)
        if queue is not None and self._aio is not None:
            self._aio.call_soon_threadsafe(queue.put_nowait, event)

    async def stream(self, request_id: str, timeout_s: float | None = None) -> AsyncIterator[list[TokenEvent]]:
        """Yield batches of events until the finished one; closes the stream whatever happens.

        ``timeout_s`` bounds the wait for each next event (a stuck request ends with an error event).
        """
        queue = self._queues[request_id]
        try:
            while True:
                try:
                    first = await asyncio.wait_for(queue.get(), timeout_s)
                except asyncio.TimeoutError:
                    yield [TokenEvent([], "", True, "abort", error=f"no progress for {timeout_s} s")]
                    return
                batch = [first]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
                if any(e.finished for e in batch):
                    return
        finally:
            self._queues.pop(request_id, None)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._queues

    # ---- introspection -------------------------------------------------------------------------
    async def stats(
        self, worker_id: str, role: str, remote_pending: int, kv_bytes: int, steps_since: float | None = None
    ) -> WorkerStats:
        def collect(engine: LLMEngine) -> WorkerStats:
            s = engine.stats()
            steps = [st for st in engine.step_history if st.started >= steps_since] if steps_since is not None else []
            return WorkerStats(
                worker_id,
                role,
                s.blocks.total,
                s.blocks.free,
                s.blocks.cached,
                s.blocks.used,
                s.num_running,
                s.num_waiting,
                remote_pending or s.num_remote_pending,
                s.tokens_in_flight,
                self.loop.num_steps,
                kv_bytes,
                steps,
            )

        return await self.run(collect)

    def close(self) -> None:
        self.loop.stop()
