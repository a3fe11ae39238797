"""How tokens get from the decode workers' event streams to the requests waiting for them (``Router``'s half).

``InFlight`` is a request the router serves: the updates delivered to it queue up until its client stream
takes them (``next_updates``). ``WorkerEvents`` runs a reader task per decode worker that demultiplexes
the worker's stream into the requests by their key, and keeps the routing policy's view of which workers
are available: a decode worker whose stream drops, or stays silent past ``decode_silence_timeout_s`` (an idle
worker sends a heartbeat twice a second, so silence means its process hangs), or whose heartbeats say that its
engine loop has stalled (``engine_stall_timeout_s``), is unavailable (its requests fail) until it streams
again with a turning engine. Prefill workers have no stream: each is asked ``ready()`` every
``PREFILL_PROBE_S``; one that does not answer for ``decode_silence_timeout_s``, or answers that its engine
stalled, is unavailable (its prefills in flight fail) until it answers again. One more task fails a stream
that went idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.async_engine import EngineStalled
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.messages import TokenUpdate
from pdserve.router.config import RouterConfig
from pdserve.router.policy import Route, RoutingPolicy

if TYPE_CHECKING:
    from pdserve.router.router import WorkerHandle

log = logging.getLogger("pdserve.router.router")  # the router's records, under its logger as before the split
PREFILL_PROBE_S = 0.5  # how often the router asks each prefill worker whether it is alive


@dataclass
class InFlight:
    """A request the router is serving: where it went, what came back, what the client has been sent."""

    request_id: str  # the client's id
    key: str  # the id the workers know it by: unique per router and incarnation, so ids can be reused
    route: Route  # as routed (the policy's bookkeeping uses it)
    served: Route  # as served (differs after a fallback to local prefill)
    received: float
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer | None
    prefill: Any = None  # the prefill worker's PrefillResult
    num_cached_tokens: int = 0  # on the decode worker, as its reservation found it
    fallback: str = ""
    ttft_s: float | None = None
    num_output_tokens: int = 0
    prefill_pending: bool = False
    aborted: bool = False
    queued: bool = True  # counted in the router's queue until its first token
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once no worker holds it any more
    pending: list[TokenUpdate] = field(default_factory=list)  # delivered, not yet streamed
    waiter: asyncio.Future | None = None  # set while the client stream waits for updates
    last_update: float = field(default_factory=time.monotonic)
    last_event: float = 0.0  # unix time of the last event with tokens
    stopped: bool = False  # its consumer had what it wanted (``Router.stopped``): an early end is a finish
    owner: str = ""  # who sent it (``GenerateInput.owner``)

    def deliver(self, update: TokenUpdate) -> None:
        self.pending.append(update)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_updates(self) -> list[TokenUpdate]:
        """Everything delivered since the last call (waits for at least one update)."""
        if not self.pending:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        updates, self.pending = self.pending, []
        self.last_update = time.monotonic()
        return updates


class WorkerEvents:
    """The reader tasks of one router: ``start`` subscribes to every decode worker, ``close`` stops them.

    ``active`` and ``by_key`` are the router's requests by client id and by worker key (shared, not copied).
    """

    def __init__(
        self,
        router_id: str,
        config: RouterConfig,
        policy: RoutingPolicy,
        workers: dict[str, WorkerHandle],
        active: dict[str, InFlight],
        by_key: dict[str, InFlight],
        owner: Any = None,
    ) -> None:
        self.router_id = router_id
        self.config = config
        self.policy = policy
        self.workers = workers
        self.active = active
        self._by_key = by_key
        self._owner = owner  # the Router: its ``handle`` (when it runs in an actor) goes with each subscription
        self.num_items = 0  # event-stream items with updates received from the workers
        self._tasks: list[asyncio.Task] = []
        self._last_heard: dict[str, float] = {}  # decode worker -> monotonic time of its stream's last item
        self._down: dict[str, asyncio.Event] = {}  # decode worker -> set while it counts as down

    def down(self, worker_id: str) -> asyncio.Event:
        """Set while the decode worker ``worker_id`` counts as down (its stream dropped or went silent)."""
        return self._down.setdefault(worker_id, asyncio.Event())

    async def start(self, decode_workers: list[WorkerHandle], timeout_s: float) -> None:
        """Subscribe to every decode worker's event stream; returns once all of them confirmed."""
        loop = asyncio.get_running_loop()
        subscribed = [loop.create_future() for _ in decode_workers]
        for worker, confirmed in zip(decode_workers, subscribed, strict=True):
            self._tasks.append(asyncio.create_task(self._read(worker, confirmed)))
        self._tasks.append(asyncio.create_task(self._watch_idle_streams()))
        self._tasks.append(asyncio.create_task(self._watch_silent_workers([w.worker_id for w in decode_workers])))
        for worker_id in self.policy.prefill:
            self._tasks.append(asyncio.create_task(self._probe_prefill_worker(self.workers[worker_id])))
        await asyncio.wait_for(asyncio.gather(*subscribed), timeout_s)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _read(self, worker: WorkerHandle, subscribed: asyncio.Future) -> None:
        """Demultiplex one worker's stream into the requests; while it is down, route nothing to it."""
        delay = 0.1
        while True:
            try:
                handle = getattr(self._owner, "handle", None)
                stream = worker.actor.events.options(num_returns="streaming").remote(self.router_id, handle)
                async for ref in stream:
                    item = await ref
                    self._last_heard[worker.worker_id] = time.monotonic()
                    if not subscribed.done():
                        subscribed.set_result(None)
                    if item.stalled:
                        self._fail_worker(worker.worker_id, f"is hung: {item.stalled}")
                    elif not self.policy.is_available(worker.worker_id):
                        log.info("%s: worker %s is back", self.router_id, worker.worker_id)
                        self.policy.set_available(worker.worker_id, True)
                        self.down(worker.worker_id).clear()
                    delay = 0.1
                    if not item.updates:
                        continue  # a heartbeat, or the subscription's confirmation
                    self.num_items += 1
                    by_key = self._by_key
                    for update in item.updates:
                        request = by_key.get(update.request_id)
                        if request is not None:
                            request.deliver(update)
                reason = "ended its event stream"
            except Exception as e:  # the worker died or restarts: its requests cannot finish
                reason = f"dropped its event stream ({type(e).__name__})"
            self._fail_worker(worker.worker_id, reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _fail_worker(self, worker_id: str, reason: str) -> None:
        """The decode worker counts as down until its stream delivers again: route nothing to it, fail its requests."""
        if self.policy.is_available(worker_id):
            log.warning("%s: worker %s %s; failing its requests", self.router_id, worker_id, reason)
        self.policy.set_available(worker_id, False)
        self.down(worker_id).set()
        for request in list(self.active.values()):
            if request.served.decode_worker == worker_id:
                error = f"decode worker {worker_id} {reason}"
                request.deliver(TokenUpdate(request.key, [], "abort", error=error))

    async def _watch_silent_workers(self, worker_ids: list[str]) -> None:
        """Fail a decode worker whose subscribed stream has been silent for ``decode_silence_timeout_s``: its
        process hangs (stopped, swapping, deadlocked) and neither its tokens nor its answers will come."""
        limit = self.config.decode_silence_timeout_s
        interval = min(0.25, limit / 4)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last_tick > max(1.0, limit / 2):  # this router's own loop stalled: its view is stale
                self._last_heard = dict.fromkeys(self._last_heard, now)
            last_tick = now
            for worker_id in worker_ids:
                heard = self._last_heard.get(worker_id)
                if heard is not None and now - heard > limit and self.policy.is_available(worker_id):
                    self._fail_worker(worker_id, f"sent nothing on its event stream for {limit:g} s (hung)")

    async def _probe_prefill_worker(self, worker: WorkerHandle) -> None:
        """Ask a prefill worker ``ready()`` every ``PREFILL_PROBE_S``. Silent for ``decode_silence_timeout_s``
        (its process hangs) or answering that its engine stalled, it is down: its prefills in flight fail with
        UNAVAILABLE and nothing is routed to it. It is back once it answers ``ready()`` again (Ray restarted
        it, or its engine turns again). One probe is out at a time."""
        limit = self.config.decode_silence_timeout_s
        last_answer = time.monotonic()
        probe: asyncio.Future | None = None
        while True:
            if probe is None:
                probe = asyncio.ensure_future(_awaited(worker.actor.ready.remote()))
            done, _ = await asyncio.wait({probe}, timeout=PREFILL_PROBE_S)
            now = time.monotonic()
            if done:
                answered, probe = probe, None
                error = answered.exception()
                if error is None:
                    last_answer = now
                    if not self.policy.is_available(worker.worker_id):
                        log.info("%s: prefill worker %s is back", self.router_id, worker.worker_id)
                        self.policy.set_available(worker.worker_id, True)
                elif isinstance(error, EngineStalled):  # Ray's RayTaskError subclasses its cause's type
                    self._fail_prefill_worker(worker.worker_id, _cause_text(error))
                elif self.policy.is_available(worker.worker_id):
                    # dead or restarting: the prefill call itself fails (RayActorError), and the router
                    # prefills locally; it is routed to again once it answers
                    self.policy.set_available(worker.worker_id, False)
                await asyncio.sleep(max(0.0, PREFILL_PROBE_S - (time.monotonic() - now)))
            elif now - last_answer > limit:
                self._fail_prefill_worker(worker.worker_id, f"is hung: it has not answered for {limit:g} s")

    def _fail_prefill_worker(self, worker_id: str, reason: str) -> None:
        """The prefill worker counts as down until it answers again: route nothing to it, fail its prefills."""
        if self.policy.is_available(worker_id):
            log.warning("%s: prefill worker %s %s; failing its prefills", self.router_id, worker_id, reason)
        self.policy.set_available(worker_id, False)
        for request in list(self.active.values()):
            if request.served.prefill_worker == worker_id and request.prefill_pending:
                error = reason if reason.startswith("prefill worker") else f"prefill worker {worker_id} {reason}"
                request.deliver(TokenUpdate(request.key, [], "abort", error=error))

    async def _watch_idle_streams(self) -> None:
        """Fail a stream that got no update for ``stream_idle_timeout_s`` (one timer for all requests)."""
        limit = self.config.stream_idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for request in list(self.active.values()):
                if request.waiter is not None and now - request.last_update > limit:
                    error = f"no token from the decode worker for {limit} s"
                    request.deliver(TokenUpdate(request.key, [], "abort", error=error))


async def _awaited(ref: Any) -> Any:
    return await ref


def _cause_text(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    return str(cause) if cause is not None else str(error).strip().splitlines()[-1]
