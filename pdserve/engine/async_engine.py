"""An engine for asyncio code: commands awaited, and one event stream per subscriber (a router).

The engine runs in an ``EngineLoop`` thread; the node (a Ray actor) lives on an asyncio event loop.
``AsyncEngine`` is the bridge: ``await run(fn)`` applies a command between steps, and after each step
the node ``publish``es the step's ``TokenUpdate``s in one call. Each update goes to the subscriber that
``claim``ed its request; ``events(subscriber_id)`` yields a subscriber's updates one batch per step
(several steps in one batch when the reader lags). The cost of the path is per step, not per token.
No Ray and no gRPC in here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import Request
from pdserve.messages import TokenUpdate, WorkerRequestStats, WorkerStats

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput

T = TypeVar("T")
EVENT_HEARTBEAT_S = 0.5  # an idle event stream yields [] this often: its reader tells a hung worker from a quiet one
DEFAULT_ENGINE_STALL_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


class EngineStalled(RuntimeError):
    """The worker's engine loop has not turned for its stall timeout: stuck in a step (a device or collective
    hang), a hook or a command. Its requests fail with this; it takes no new ones until the loop turns again."""


class NotSubscribed(RuntimeError):
    """A request was claimed for a subscriber (a router) whose event stream is not open here: gone, or not
    reconnected yet after this worker restarted. Nobody would read the request's tokens."""


def second_token_time(request: Request) -> float:
    """Unix time this worker sampled the request's output token #2 (0 if it has not)."""
    tokens = request.times.tokens
    return tokens[1] if len(tokens) > 1 else 0.0


def worker_request_stats(request: Request, **extra: Any) -> WorkerRequestStats:
    """Queue and prefill times of a request that this worker prefilled, plus ``extra`` fields."""
    t = request.times
    scheduled = t.first_scheduled if t.first_scheduled is not None else t.arrival
    first = t.first_token if t.first_token is not None else scheduled
    return WorkerRequestStats(
        queue_s=max(0.0, scheduled - t.arrival),
        prefill_s=max(0.0, first - scheduled),
        num_cached_tokens=request.num_cached_tokens,
        second_token_time=second_token_time(request),
        **extra,
    )


def exit_process_soon(worker_id: str, delay_s: float = 0.5) -> None:
    """After an engine crash: leave the process shortly (failed requests' messages go out first) so that
    Ray starts a fresh worker in its place."""
    log.error("%s: engine loop crashed; exiting so that the worker is replaced", worker_id)
    threading.Timer(delay_s, os._exit, args=(1,)).start()


class _Subscriber:
    __slots__ = ("closed", "pending", "wake")

    def __init__(self) -> None:
        self.pending: list[TokenUpdate] = []
        self.wake = asyncio.Event()
        self.closed = False


class AsyncEngine:
    """Binds to the event loop of its first ``run``/``events`` call (a Ray async actor's loop).

    ``on_orphans(request_ids)`` is called on the event loop when a subscriber goes away while it still
    owns requests: the node must stop them, nobody will read their tokens.

    Liveness: a watchdog on the event loop reads the engine loop's own turn stamps; once the loop has not
    turned for ``stall_timeout_s`` (a step that never ends), ``stalled()`` says so and ``on_stall(why)`` runs
    (once per stall, on the event loop) so that the node fails its requests; the node refuses new work while
    ``stalled()`` says anything. It clears by itself when the loop turns again.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        on_tick: Callable[[LLMEngine], None] | None = None,
        on_orphans: Callable[[list[str]], None] | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
        on_stall: Callable[[str], None] | None = None,
    ) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s!r}")
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self._stalled: str | None = None
        self._watchdog: asyncio.Task | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._subscribers: dict[str, _Subscriber] = {}
        self._owners: dict[str, str] = {}  # request id -> subscriber id (event-loop side only)
        self._on_orphans = on_orphans
        self.num_items = 0  # event-stream items yielded, all subscribers together
        self.loop = EngineLoop(engine, on_step=on_step, on_tick=on_tick, on_crash=on_crash)

    def _bind(self) -> asyncio.AbstractEventLoop:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()
            self._watchdog = self._aio.create_task(self._watch_liveness())
        return self._aio

    def stalled(self) -> str | None:
        """Why this worker counts as hung (its engine loop has not turned for ``stall_timeout_s``), or None."""
        stuck_s = self.loop.stalled_for()
        if stuck_s < self.stall_timeout_s:
            return None
        return f"its engine has not stepped for {stuck_s:.1f} s (engine_stall_timeout_s={self.stall_timeout_s:g})"

    async def _watch_liveness(self) -> None:
        interval = min(0.25, self.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            why = self.stalled()
            if why is not None and self._stalled is None:
                log.error("engine loop stalled: %s", why)
                if self._on_stall is not None:
                    self._on_stall(why)
            elif why is None and self._stalled is not None:
                log.warning("engine loop turns again after a stall")
            self._stalled = why

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Apply ``fn(engine)`` on the loop thread between steps and return its result."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Queue ``fn(engine)`` for the loop thread without waiting: commands apply in the order they were
        submitted, between steps. Returns the future of its result."""
        return asyncio.wrap_future(self.loop.call(fn), loop=self._bind())

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Thread-safe: run ``fn()`` on the event loop (e.g. from the loop thread, to start a task)."""
        self._bind_loop().call_soon_threadsafe(fn)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        if self._aio is None:
            raise RuntimeError("AsyncEngine.call_soon before any run() or events(): no event loop yet")
        return self._aio

    # ---- request ownership (event loop) ----------------------------------------------------------
    def claim(self, request_id: str, subscriber_id: str) -> None:
        """Route ``request_id``'s updates to ``subscriber_id``. ValueError when the id is taken; ``NotSubscribed``
        when the subscriber is unknown."""
        self._bind()
        if subscriber_id not in self._subscribers:
            raise NotSubscribed(f"router {subscriber_id!r} is not subscribed to this worker's events")
        if request_id in self._owners:
            raise ValueError(f"request_id {request_id!r} is already in use on this worker")
        self._owners[request_id] = subscriber_id

    def unclaim(self, request_id: str) -> None:
        self._owners.pop(request_id, None)

    def owns(self, request_id: str) -> bool:
        return request_id in self._owners

    def owner(self, request_id: str) -> str | None:
        """The subscriber that ``request_id``'s updates go to, or None."""
        return self._owners.get(request_id)

    # ---- the event stream --------------------------------------------------------------------------
    def publish(self, updates: list[TokenUpdate]) -> None:
        """Thread-safe: hand one step's updates to their subscribers (one event-loop callback per call)."""
        if updates and self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, updates)

    def fail_all(self, error: str) -> None:
        """Thread-safe: end every claimed request with ``error`` (the engine cannot finish them)."""
        if self._aio is not None:
            self._aio.call_soon_threadsafe(
                lambda: self._dispatch([TokenUpdate(rid, [], "abort", error=error) for rid in self._owners])
            )

    def _dispatch(self, updates: list[TokenUpdate]) -> None:
        owners, subscribers = self._owners, self._subscribers
        for update in updates:
            owner = owners.get(update.request_id)
            if owner is None:
                continue  # nobody reads it (aborted, or its router went away)
            if update.finish_reason is not None:
                del owners[update.request_id]
            sub = subscribers.get(owner)
            if sub is not None:
                sub.pending.append(update)
                sub.wake.set()

    def unsubscribe(self, subscriber_id: str) -> None:
        """Event loop: end ``subscriber_id``'s event stream (its reader is gone); its requests go to ``on_orphans``."""
        sub = self._subscribers.get(subscriber_id)
        if sub is not None:
            sub.closed = True
            sub.wake.set()

    async def events(self, subscriber_id: str) -> AsyncIterator[list[TokenUpdate]]:
        """Yield ``[]`` once subscribed, then each batch of the subscriber's updates as steps produce them,
        and ``[]`` after every ``EVENT_HEARTBEAT_S`` without one (so a reader notices a process that hangs).

        A second subscription under the same id replaces the first (a router reconnecting). When the
        reader goes away, the requests it owned are handed to ``on_orphans``.
        """
        self._bind()
        old = self._subscribers.get(subscriber_id)
        if old is not None:
            old.closed = True
            old.wake.set()
        sub = self._subscribers[subscriber_id] = _Subscriber()
        try:
            yield []
            while True:
                if not sub.wake.is_set():
                    try:
                        await asyncio.wait_for(sub.wake.wait(), EVENT_HEARTBEAT_S)
                    except TimeoutError:
                        yield []  # a heartbeat
                        continue
                sub.wake.clear()
                if sub.closed:
                    return
                batch, sub.pending = sub.pending, []
                if batch:
                    self.num_items += 1
                    yield batch
        finally:
            if self._subscribers.get(subscriber_id) is sub:
                del self._subscribers[subscriber_id]
                orphans = [rid for rid, owner in self._owners.items() if owner == subscriber_id]
                for rid in orphans:
                    del self._owners[rid]
                if orphans and self._on_orphans is not None:
                    self._on_orphans(orphans)

    # ---- introspection -------------------------------------------------------------------------
    def describe(self, worker_id: str, role: str, transport: str, node: str) -> dict[str, Any]:
        """A worker's ``ready()`` answer; raises while the engine loop is dead (the process is being replaced) or
        stalled (``EngineStalled``)."""
        if not self.loop.alive:
            raise RuntimeError(f"{worker_id}: engine loop stopped: {self.loop.error!r}")
        stalled = self.stalled()
        if stalled is not None:
            raise EngineStalled(f"{role} worker {worker_id} is hung: {stalled}")
        engine = self.engine
        return {
            "worker_id": worker_id,
            "role": role,
            "node": node,
            "num_blocks": engine.block_manager.num_blocks,
            "block_size": engine.config.block_size,
            "device": str(engine.device),
            "transport": transport,
            "pid": os.getpid(),
        }

    async def stats(
        self, worker_id: str, role: str, remote_pending: int, kv_bytes: int, steps_since: float | None = None
    ) -> WorkerStats:
        def collect(engine: LLMEngine) -> WorkerStats:
            s = engine.stats()
            steps = (
                tuple(st for st in engine.step_history if st.started >= steps_since) if steps_since is not None else ()
            )
            admissions = (
                tuple(a for a in engine.admission_trace if a.time >= steps_since) if steps_since is not None else ()
            )
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
                admissions=admissions,
            )

        return await self.run(collect)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.loop.stop()
