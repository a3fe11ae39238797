"""The router's core: validate, route, drive the workers, stream tokens back. No gRPC in here.

Tokens come back on one event stream per decode worker (``DecodeWorker.events``), subscribed once at
``start``: each item carries every new token of this router's requests from one worker step, and a
reader task per worker demultiplexes them into the requests' queues (``worker_events``). Starting,
reserving and aborting are plain actor calls. Colocated: ``decode.generate`` starts the request. Disaggregated:
``decode.reserve`` → blocks; ``prefill.prefill`` → chunked prefill with per-chunk KV pushes, returns
the first token (sent to the client at once); ``decode.decode(first_token)`` decodes the rest once the
KV has landed. If the prefill worker fails, the request falls back to a local prefill on its decode
worker. Several routers can serve the same workers: each subscribes under its own id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any, NamedTuple

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from pdserve.engine.async_engine import EngineStalled, NotSubscribed
from pdserve.engine.prompt import check_prompt_text, check_prompt_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.messages import (
    SHUTTING_DOWN,
    Logprob,
    PromptLogprob,
    RequestMetrics,
    TokenUpdate,
    WorkerRequestStats,
    WorkerStats,
    worker_key,
)
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import NoWorkerAvailable, Route, RoutingPolicy
from pdserve.router.worker_events import InFlight, WorkerEvents

log = logging.getLogger(__name__)

REUSE_GRACE_S = 0.5  # how long a new request waits for a live request with its id to end
ABORT_CALL_TIMEOUT_S = 15.0  # an abort call to a worker is let go after this (the worker fences its own blocks)


class RequestError(Exception):
    """A request the router refuses or could not serve; ``code`` names the gRPC status to use."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, UNAVAILABLE, INTERNAL


class QueueTimeExceeded(RequestError):
    """A request that waited longer than ``RouterConfig.max_queue_time_s`` for its first token: refused."""

    def __init__(self, waited_s: float, limit_s: float) -> None:
        super().__init__(
            "RESOURCE_EXHAUSTED",
            f"request waited {waited_s:.1f} s without its first token, over max_queue_time_s={limit_s:g}: "
            "the server is overloaded, retry later",
        )


class GenerateInput(NamedTuple):
    request_id: str | None
    prompt: str | list[int]
    params: SamplingParams
    mode: str | None  # None = the deployment's default
    # True: params.max_tokens is a default, cut to the room the prompt leaves (a chat without max_tokens);
    # False: a prompt plus max_tokens over max_model_len is refused (INVALID_ARGUMENT)
    fit_max_tokens: bool = False
    stream_interval: int = 0  # tokens per message after the first; 0 = the deployment's (RouterConfig)
    # the text ends before the first of these strings; the request then ends with finish_reason "stop"
    stop: tuple[str, ...] = ()
    owner: str = ""  # who sent it (a client id, or its connection): only the same owner may abort it


class RouterEvent(NamedTuple):
    """What the client stream gets: new tokens and their text; on the last event how it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None  # on the last event
    logprobs: list[Logprob] | None = None  # per token, when the request asked (SamplingParams.logprobs)
    # on the first event, when the request asked (SamplingParams.prompt_logprobs): one per prompt token after the first
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopMatcher:
    """Cuts streamed text before the first of some stop strings; holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("stop: strings must not be empty")
        self.stops = tuple(stops)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to release, and whether a stop string matched (the text then ends before it)."""
        buffer = self.pending + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buffer[:cut], True
        hold = 0
        for k in range(min(len(buffer), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(buffer[-k:]) for s in self.stops):
                hold = k
                break
        self.pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class WorkerHandle(NamedTuple):
    worker_id: str
    role: str
    actor: Any  # a Ray actor handle


class ModelLimits(NamedTuple):
    vocab_size: int
    max_model_len: int


class Router:
    def __init__(
        self,
        config: RouterConfig,
        decode_workers: list[WorkerHandle],
        prefill_workers: list[WorkerHandle],
        limits: ModelLimits,
        tokenizer: Tokenizer | None,
        router_id: str = "router-0",
    ) -> None:
        self.config = config
        self.router_id = router_id
        self.policy = RoutingPolicy(
            config, [w.worker_id for w in decode_workers], [w.worker_id for w in prefill_workers]
        )
        self.decode_workers = {w.worker_id: w for w in decode_workers}
        self.workers = {w.worker_id: w for w in [*decode_workers, *prefill_workers]}
        self.limits = limits
        self.tokenizer = tokenizer
        self.active: dict[str, InFlight] = {}  # by the client's request id
        self._by_key: dict[str, InFlight] = {}  # by the workers' request id
        self._serial = itertools.count()
        self.num_queued = 0  # requests waiting for their first token
        self.queued_prompt_tokens = 0
        self.handle: Any = None  # this router's actor handle (set by its RouterProcess): workers watch it
        self._events = WorkerEvents(router_id, config, self.policy, self.workers, self.active, self._by_key, self)
        self._ids = itertools.count()
        self._seeds = random.Random()
        self.metrics = RouterMetrics(router_id)
        self._unanswered: set[asyncio.Future] = set()  # decode-worker calls in flight (a hung one outlives its request)
        self.groups: dict[str, list[str]] = {}  # a request of several choices: its id -> its choices' ids
        self.draining = False  # set by ``drain``: new requests are refused

    # ---- the workers' event streams (``WorkerEvents``) -------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> None:
        """Subscribe to every decode worker's event stream; returns once all of them confirmed."""
        await self._events.start(list(self.decode_workers.values()), timeout_s)

    async def close(self) -> None:
        await self._events.close()

    @property
    def num_stream_items(self) -> int:
        """Event-stream items received from the workers."""
        return self._events.num_items

    # ---- validation and admission ----------------------------------------------------------------
    async def _validate(self, req: GenerateInput) -> tuple[str, list[int], SamplingParams]:
        """Check everything a worker would refuse, cheapest first; RequestError names the field."""
        if self.draining:
            raise RequestError("UNAVAILABLE", SHUTTING_DOWN)
        max_len = self.limits.max_model_len
        try:
            if isinstance(req.prompt, str):
                check_prompt_text(req.prompt, max_len, self.tokenizer is not None)
                assert self.tokenizer is not None
                if len(req.prompt) > 16384:  # long texts are tokenized off the event loop
                    tokens = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
                else:
                    tokens = self.tokenizer.encode(req.prompt)
            else:
                tokens = req.prompt
            prompt = check_prompt_tokens(tokens, self.limits.vocab_size, max_len)
            if req.stop:
                StopMatcher(req.stop)
        except ValueError as e:
            raise RequestError("INVALID_ARGUMENT", str(e)) from None
        params = req.params
        if req.stream_interval < 0:
            raise RequestError("INVALID_ARGUMENT", f"stream_interval: must be >= 0, got {req.stream_interval}")
        if params.max_tokens > max_len:
            raise RequestError(
                "INVALID_ARGUMENT", f"max_tokens: must be <= max_model_len={max_len}, got {params.max_tokens}"
            )
        room = max_len - len(prompt)
        if params.max_tokens > room:
            if not req.fit_max_tokens:
                raise RequestError(
                    "INVALID_ARGUMENT",
                    f"max_tokens: this model's maximum context length is {max_len} tokens, but {len(prompt)} prompt "
                    f"tokens + max_tokens={params.max_tokens} is {len(prompt) + params.max_tokens}; "
                    f"ask for at most {room} tokens or shorten the prompt",
                )
            params = replace(params, max_tokens=room)
        if params.seed is None:  # prefill and decode workers must draw from the same seed
            params = replace(params, seed=self._seeds.getrandbits(63))
        request_id = req.request_id or f"{self.router_id}-{next(self._ids)}-{random.getrandbits(32):08x}"
        previous = self.active.get(request_id)
        if previous is not None:
            # A client that cancelled a stream may reuse its id before the cancel has reached us:
            # give the old request a moment to be torn down before calling the id taken.
            try:
                await asyncio.wait_for(previous.done.wait(), REUSE_GRACE_S)
            except TimeoutError:
                raise RequestError("ALREADY_EXISTS", f"request_id {request_id!r} is already in use") from None
        self._admit(len(prompt))
        return request_id, prompt, params

    def _admit(self, num_prompt_tokens: int) -> None:
        """Shed load at once (RESOURCE_EXHAUSTED) rather than queue without bound."""
        c = self.config
        if len(self.active) >= c.max_active_requests:
            raise RequestError(
                "RESOURCE_EXHAUSTED", f"router is at its limit of {c.max_active_requests} active requests"
            )
        if (
            self.num_queued >= c.max_queued_requests
            or self.queued_prompt_tokens + num_prompt_tokens > c.max_queued_prompt_tokens
        ):
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"router queue is full: {self.num_queued} requests with {self.queued_prompt_tokens} prompt tokens wait "
                f"for their first token (limits {c.max_queued_requests} requests, {c.max_queued_prompt_tokens} tokens)",
            )

    def _dequeue(self, request: InFlight) -> None:
        if request.queued:
            request.queued = False
            self.num_queued -= 1
            self.queued_prompt_tokens -= request.num_prompt_tokens

    # ---- serving -------------------------------------------------------------------------------
    async def generate(self, req: GenerateInput) -> AsyncGenerator[RouterEvent, None]:
        """Stream a request's tokens. Raises RequestError before the first event for bad input.

        The hot path is this one loop: one wake-up per batch of the request's updates, coalesced into
        one event when the client lags behind. With a stream interval k > 1, tokens after the first are
        held until k have gathered (or the request ends): one event per k tokens.
        """
        received = time.time()
        try:
            request_id, prompt, params = await self._validate(req)
            route = self._route(prompt, params, req.mode)
        except RequestError as e:
            self.metrics.request_rejected(e.code, req.mode or self.config.default_mode)
            raise
        request = InFlight(
            request_id,
            worker_key(request_id, self.router_id, next(self._serial)),
            route,
            route,
            received,
            len(prompt),
            self.tokenizer.detokenizer() if self.tokenizer else None,
            num_cached_tokens=route.expected_cached_tokens,
            prefill_pending=route.prefill_worker is not None,
        )
        request.owner = req.owner
        if req.mode == "disaggregated" and route.mode == "colocated":
            request.fallback = "no prefill worker available"
        self.active[request_id] = request
        self._by_key[request.key] = request
        self.num_queued += 1
        self.queued_prompt_tokens += len(prompt)
        self.policy.start(route, prompt, params.max_tokens)
        log.debug("%s: request %s starts as %s: %s", self.router_id, request_id, request.key, route)
        finished = False  # the workers ended the request
        ended = False  # the client's stream has its last event (a stop string may end it before the workers do)
        stop = StopMatcher(req.stop) if req.stop else None
        interval = req.stream_interval or self.config.stream_interval
        held: list[int] = []
        held_logprobs: list[Logprob] = []
        with_logprobs = params.logprobs is not None
        try:
            if route.mode == "disaggregated":
                first = await self._within_queue_time(request, self._prefill_remotely(request, prompt, params))
                if first is not None:
                    finished = first.finished
                    first = self._cut_at_stop(request, stop, first)
                    ended = first.finished
                    # the decode worker is told at once, not once the client has read the first token:
                    # a slow reader must not eat into the reservation's deadline
                    decoding = None if ended else asyncio.ensure_future(self._start_decode(request))
                    try:
                        yield first
                    finally:
                        if decoding is not None and not decoding.done():
                            await asyncio.shield(decoding)
                    if decoding is not None:
                        decoding.result()
            else:
                await self._start_colocated(request, prompt, params)
            while not ended:
                if request.ttft_s is None and self.config.max_queue_time_s is not None:
                    updates = await self._within_queue_time(request, request.next_updates())
                else:
                    updates = await request.next_updates()
                last = updates[-1]
                token_ids = updates[0].token_ids if len(updates) == 1 else [t for u in updates for t in u.token_ids]
                if last.error:
                    raise RequestError("UNAVAILABLE", last.error)
                finished = last.finish_reason is not None
                logprobs = [lp for u in updates for lp in (u.logprobs or ())] if with_logprobs else None
                prompt_logprobs = _prompt_logprobs(updates) if params.prompt_logprobs is not None else None
                if interval > 1 and request.ttft_s is not None:
                    held.extend(token_ids)
                    held_logprobs.extend(logprobs or ())
                    if len(held) < interval and not finished:
                        continue
                    token_ids, held = held, []
                    logprobs, held_logprobs = (held_logprobs if with_logprobs else None), []
                event = self._event(request, token_ids, last.finish_reason, last.stats, logprobs, prompt_logprobs)
                event = self._cut_at_stop(request, stop, event)
                ended = event.finished
                yield event
        except BaseException as e:
            if not finished and not ended:
                self._end_unfinished(request, e)
            raise
        finally:
            self._dequeue(request)
            self._prefill_finished(request, prompt)
            self.policy.finish(route, prompt, params.max_tokens)
            # Forget the request before awaiting anything: a consumer that went away (an HTTP client that
            # disconnected) may cancel this generator again while it waits, and the count must not leak.
            # The worker key is unique per incarnation, so the id may be reused while the abort runs.
            self.active.pop(request_id, None)
            self._by_key.pop(request.key, None)
            if finished:
                request.done.set()
            else:  # cancelled or failed: make sure no worker keeps working on it (the client is not kept waiting)
                self._abort_on_workers(request.key, request.served).add_done_callback(lambda _: request.done.set())

    def _cut_at_stop(self, request: InFlight, stop: StopMatcher | None, event: RouterEvent) -> RouterEvent:
        """``event`` with its text cut before a stop string: the request's last event (finish_reason "stop")
        when one matched, which the workers are then told to stop."""
        if stop is None:
            return event
        text, matched = stop.push(event.text)
        if matched:
            request.stopped = True
            metrics = event.metrics
            if metrics is None:
                metrics = self._metrics(request, WorkerRequestStats(), time.time())
                self.metrics.request_finished(metrics, "finished", reason="stop")
            return event._replace(text=text, finish_reason="stop", metrics=metrics)
        if event.finished:
            text += stop.flush()
        return event._replace(text=text)

    async def drain(self, grace_s: float, timeout_s: float = 10.0) -> int:
        """Stop serving: refuse new requests (UNAVAILABLE, ``SHUTTING_DOWN``), give the open ones ``grace_s`` to
        finish, then end the rest with that error (their streams get it as their last event; their workers
        stop them). Returns how many were ended so; waits at most ``timeout_s`` more for them to be gone."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        open_requests = list(self.active.values())
        for request in open_requests:
            request.deliver(TokenUpdate(request.key, [], "abort", error=SHUTTING_DOWN))
        waiting = [asyncio.ensure_future(r.done.wait()) for r in open_requests]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=timeout_s)
            for task in late:
                task.cancel()
        return len(open_requests)

    async def _within_queue_time(self, request: InFlight, waiting: Any) -> Any:
        """Await ``waiting`` (a step towards the first token) until ``max_queue_time_s`` after arrival."""
        limit = self.config.max_queue_time_s
        if limit is None:
            return await waiting
        try:
            return await asyncio.wait_for(waiting, max(0.0, request.received + limit - time.time()))
        except TimeoutError:
            raise QueueTimeExceeded(time.time() - request.received, limit) from None

    def _route(self, prompt: list[int], params: SamplingParams, mode: str | None) -> Route:
        try:
            return self.policy.route(prompt, params.max_tokens, mode)
        except NoWorkerAvailable as e:
            raise RequestError("UNAVAILABLE", str(e)) from None
        except ValueError as e:
            raise RequestError("INVALID_ARGUMENT", str(e)) from None

    def _end_unfinished(self, request: InFlight, error: BaseException) -> None:
        """Count (and log, when it failed) a request whose stream ends without its last event."""
        metrics = self._metrics(request, WorkerRequestStats(), time.time())
        code = error.code if isinstance(error, RequestError) else "INTERNAL"
        if isinstance(error, QueueTimeExceeded):  # refused under load: counted, not logged per request
            self.metrics.request_finished(metrics, "rejected", code, str(error))
            return
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)) or code == "CANCELLED":
            stopped = request.stopped  # a stop string matched in the front door
            self.metrics.request_finished(
                metrics, "finished" if stopped else "aborted", reason="stop" if stopped else "abort"
            )
            return
        if not self.draining:
            log.warning("%s: request %s failed: %s: %s", self.router_id, request.key, code, error)
        self.metrics.request_finished(metrics, "failed", code, str(error), reason="error")

    async def _start_colocated(self, request: InFlight, prompt: list[int], params: SamplingParams) -> None:
        worker_id = request.served.decode_worker
        await self._unless_down(
            worker_id, self.workers[worker_id].actor.generate.remote(request.key, prompt, params, self.router_id)
        )

    async def _prefill_remotely(
        self, request: InFlight, prompt: list[int], params: SamplingParams
    ) -> RouterEvent | None:
        """Reserve on the decode worker, prefill on the prefill worker; returns the first token's event.

        When the prefill worker fails, the request is prefilled on its decode worker instead (None).
        """
        route = request.route
        decode = self.workers[route.decode_worker].actor
        prefill = self.workers[route.prefill_worker].actor  # type: ignore[index]
        try:
            result = await self._prefill_unless_decode_fails(
                request,
                prefill.prefill.remote(
                    request.key, prompt, params, decode, self.config.reserve_timeout_s, self.router_id
                ),
            )
        except (RayActorError, RayTaskError) as e:
            if _is_value_error(e):
                raise RequestError("INVALID_ARGUMENT", _cause(e)) from None
            if _cause_is(e, "ReservationTimeout"):
                raise RequestError("RESOURCE_EXHAUSTED", _cause(e)) from None
            if request.aborted:
                return self._event(request, [], "abort")
            if isinstance(e, EngineStalled | NotSubscribed) or _cause_is(e, "DecodeUnavailable"):
                # a hung worker (either one), or a decode worker that lost this router: nothing to fall back on
                if isinstance(e, EngineStalled):
                    self.policy.set_available(route.prefill_worker, False)  # type: ignore[arg-type]
                self._abort_on_workers(request.key, route)
                raise RequestError("UNAVAILABLE", _cause(e)) from None
            if isinstance(e, RayActorError):
                self.policy.set_available(route.prefill_worker, False)  # type: ignore[arg-type]
            log.warning(
                "prefill %s failed on %s (%s); prefilling locally", route.prefill_worker, request.key, _cause(e)
            )
            # a prefill process that is dead pushes nothing more; one that failed the request is asked first
            gone = isinstance(e, ActorDiedError)
            self._abort_on_workers(request.key, route._replace(prefill_worker=None) if gone else route)
            self._prefill_finished(request, prompt)
            # a new key: the decode worker may still hold the old one's blocks until the prefill side confirms
            self._by_key.pop(request.key, None)
            request.pending.clear()  # what its reservation's stream said is about the old key
            request.key = f"{request.key}~local"
            self._by_key[request.key] = request
            request.served = route._replace(mode="colocated", prefill_worker=None)
            request.fallback = f"prefill worker failed: {_cause(e)}"
            await self._start_colocated(request, prompt, params)
            return None
        request.num_cached_tokens = result.decode_cached_tokens
        request.prefill = result
        self._prefill_finished(request, prompt)
        logprobs = [result.first_logprobs] if result.first_logprobs is not None else None
        return self._event(request, [result.first_token], logprobs=logprobs, prompt_logprobs=result.prompt_logprobs)

    async def _prefill_unless_decode_fails(self, request: InFlight, prefill_ref: Any) -> Any:
        """The prefill call's result; UNAVAILABLE at once if the decode worker's stream fails meanwhile
        (it died: nothing can decode this request), after stopping the prefill."""

        async def prefill() -> Any:
            return await prefill_ref

        call = asyncio.ensure_future(prefill())
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when no one awaits it
        watch = asyncio.ensure_future(request.next_updates())
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watch.done():
                watch.cancel()
        updates = watch.result() if watch.done() and not watch.cancelled() else []
        if call.done() or not any(u.error for u in updates):
            request.pending[:0] = updates  # not for this phase: the main loop reads them
            return await call
        error = next(u.error for u in updates if u.error)
        self._abort_on_workers(request.key, request.route)
        call.cancel()
        raise RequestError("UNAVAILABLE", error)

    async def _start_decode(self, request: InFlight) -> None:
        """Hand the first token to the decode worker: it decodes once all the KV has landed."""
        worker_id = request.route.decode_worker
        first_token, first_time = request.prefill.first_token, request.prefill.first_token_time
        await self._unless_down(
            worker_id, self.workers[worker_id].actor.decode.remote(request.key, first_token, first_time, self.router_id)
        )

    async def _unless_down(self, decode_worker: str, ref: Any) -> Any:
        """Await a call to a decode worker (as ``_call``); UNAVAILABLE as soon as the worker counts as down
        (its event stream dropped or went silent): a hung process would never answer."""
        down = self._events.down(decode_worker)
        call = self._keep(_call(ref))
        watch = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if call.done():
            return call.result()
        raise RequestError("UNAVAILABLE", f"decode worker {decode_worker} does not answer (down or hung)")

    def _prefill_finished(self, request: InFlight, prompt: list[int]) -> None:
        if request.prefill_pending:
            request.prefill_pending = False
            self.policy.prefill_done(request.route, prompt)

    def _event(
        self,
        request: InFlight,
        token_ids: list[int],
        finish_reason: str | None = None,
        stats: WorkerRequestStats | None = None,
        logprobs: list[Logprob] | None = None,
        prompt_logprobs: list[PromptLogprob] | None = None,
    ) -> RouterEvent:
        detok = request.detokenizer
        text = detok.push(token_ids) if detok is not None and token_ids else ""
        request.num_output_tokens += len(token_ids)
        now = time.time()
        if token_ids:
            if request.ttft_s is None:
                request.ttft_s = now - request.received
                self._dequeue(request)
            else:
                self.metrics.token_gap(now - request.last_event, request.served.mode)
            request.last_event = now
        if finish_reason is None:
            return RouterEvent(token_ids, text, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if detok is not None:
            text += detok.flush()
        metrics = self._metrics(request, stats or WorkerRequestStats(), now)
        outcome = "aborted" if finish_reason == "abort" else "finished"
        self.metrics.request_finished(metrics, outcome, reason=finish_reason)
        return RouterEvent(token_ids, text, finish_reason, metrics, logprobs, prompt_logprobs)

    def _metrics(self, request: InFlight, stats: WorkerRequestStats, now: float) -> RequestMetrics:
        served, prefill = request.served, request.prefill
        return RequestMetrics(
            request_id=request.request_id,
            mode=served.mode,
            decode_worker=served.decode_worker,
            prefill_worker=served.prefill_worker or "",
            router=self.router_id,
            queue_s=prefill.queue_s if prefill is not None else stats.queue_s,
            prefill_s=prefill.prefill_s if prefill is not None else stats.prefill_s,
            kv_transfer_s=stats.kv_transfer_s,
            kv_transfer_bytes=stats.kv_transfer_bytes,
            ttft_s=request.ttft_s if request.ttft_s is not None else now - request.received,
            e2e_s=now - request.received,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=stats.num_cached_tokens if request.prefill is None else request.num_cached_tokens,
            second_token_time=stats.second_token_time,
            fallback=request.fallback,
            decode_call_time=stats.call_time,
        )

    def _keep(self, awaitable: Any) -> asyncio.Future:
        """Run ``awaitable`` to its end even when nobody awaits it any more; its failure is read (and dropped)."""
        task = asyncio.ensure_future(awaitable)
        self._unanswered.add(task)
        task.add_done_callback(self._forget_unanswered)
        return task

    def _forget_unanswered(self, task: asyncio.Future) -> None:
        self._unanswered.discard(task)
        if not task.cancelled():
            task.exception()  # read, so an ignored failure is not logged as never retrieved

    def _abort_on_workers(self, key: str, route: Route) -> asyncio.Future:
        """Stop a request everywhere, without keeping anyone waiting: returns a future that is done once both
        workers answered or ``ABORT_CALL_TIMEOUT_S`` passed.

        The prefill worker and the decode worker are told at once. Neither answer is needed for the blocks'
        sake: a reservation's blocks are the decode worker's own, and it frees them only once no push can still
        land (it asks the prefill worker itself, or its transport refuses late writes). A decode worker whose
        event stream is down is not waited for: it died (a fresh process holds nothing of this request) or it
        hangs (it runs the abort when it resumes) or it lost this router's stream (and stops the router's
        requests itself).
        """
        calls = []
        if route.prefill_worker is not None:
            calls.append(_bounded(self.workers[route.prefill_worker].actor.abort.remote(key), ABORT_CALL_TIMEOUT_S))
        ref = self.workers[route.decode_worker].actor.abort.remote(key)
        if self.policy.is_available(route.decode_worker):
            calls.append(_bounded(self._unless_down(route.decode_worker, ref), ABORT_CALL_TIMEOUT_S))
        else:
            self._keep(_call(ref))
        return self._keep(_log_failures(key, asyncio.gather(*calls, return_exceptions=True)))

    async def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Stop the client's request ``request_id`` (every choice of a request of several); False when there is
        none. With ``owner``, only a request started by that owner (``GenerateInput.owner``) counts: a client
        cannot stop another client's request. Returns at once; the request's stream ends with an ``abort``
        finish."""
        choices = self.groups.get(request_id)
        if choices is not None:
            found = await asyncio.gather(*(self.abort(choice, owner) for choice in choices))
            return any(found)
        request = self.active.get(request_id)
        if request is None or (owner is not None and request.owner != owner):
            return False
        request.aborted = True
        self._abort_on_workers(request.key, request.served)
        return True

    async def stats(self, steps_since: float | None = None) -> list[WorkerStats]:
        """Every worker's statistics; a worker that does not answer is listed as unavailable."""
        refs = [w.actor.stats.remote(steps_since) for w in self.workers.values()]
        answers = await asyncio.gather(*[asyncio.wait_for(r, 2.0) for r in refs], return_exceptions=True)
        out = []
        for worker, answer in zip(self.workers.values(), answers, strict=True):
            if isinstance(answer, BaseException):
                answer = WorkerStats(worker.worker_id, worker.role, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, state="unavailable")
            out.append(answer)
        return out

    async def health(self, timeout_s: float = 1.0) -> tuple[bool, str]:
        """Serving while some decode worker answers; the status names every worker that does not."""
        if self.draining:
            return False, SHUTTING_DOWN

        async def answers(worker: WorkerHandle) -> bool:
            try:
                await asyncio.wait_for(worker.actor.ready.remote(), timeout_s)
            except Exception:
                return False
            return True

        workers = list(self.workers.values())
        answered = await asyncio.gather(*[answers(w) for w in workers])
        # a decode worker serves once it answers and this router is subscribed to its event stream again
        alive = [ok and self.policy.is_available(w.worker_id) for w, ok in zip(workers, answered, strict=True)]
        down = [w.worker_id for w, ok in zip(workers, alive, strict=True) if not ok]
        serving = any(ok and w.role == "decode" for w, ok in zip(workers, alive, strict=True))
        if not serving:
            return False, f"no decode worker answers (down: {', '.join(down)})"
        return True, "serving" if not down else f"serving; down: {', '.join(down)}"


def _prompt_logprobs(updates: list[TokenUpdate]) -> list[PromptLogprob] | None:
    return next((u.prompt_logprobs for u in updates if u.prompt_logprobs is not None), None)


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(_awaited(awaitable), timeout_s)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _log_failures(key: str, answers: Any) -> None:
    for answer in await answers:
        if isinstance(answer, BaseException) and not isinstance(answer, ActorDiedError):
            log.warning("abort of %s unconfirmed: %r", key, answer)


async def _call(ref: Any) -> Any:
    """Await an actor call, turning its failure into the RequestError a client should see."""
    try:
        return await ref
    except RayTaskError as e:
        if _is_value_error(e):
            code = "INVALID_ARGUMENT"
        elif _cause_is(e, "ReservationGone") or isinstance(e, EngineStalled | NotSubscribed):
            code = "UNAVAILABLE"  # the decode worker gave up on the KV, hangs, or lost this router: not the client's
        else:
            code = "INTERNAL"
        raise RequestError(code, _cause(e)) from None
    except RayActorError as e:
        raise RequestError("UNAVAILABLE", f"worker died: {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]


def _cause_is(e: BaseException, class_name: str) -> bool:
    return type(getattr(e, "cause", None)).__name__ == class_name


def _is_value_error(e: BaseException) -> bool:
    return isinstance(getattr(e, "cause", None), ValueError)
