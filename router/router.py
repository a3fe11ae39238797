"""The router's core: validate, route, drive the workers, stream tokens back. No gRPC in here.

Colocated: ``decode.generate`` streams everything. Disaggregated: ``decode.reserve`` → blocks;
``prefill.prefill`` → chunked prefill with per-chunk KV pushes, returns the first token (sent to
the client at once); ``decode.decode(first_token)`` streams the rest once the KV has landed.
If the prefill worker fails, the request falls back to a local prefill on its decode worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, NamedTuple

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.policy import Route, RouterConfig, RoutingPolicy
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the router refuses or could not serve; ``code`` names the gRPC status to use."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, UNAVAILABLE, INTERNAL


class GenerateInput(NamedTuple):
    request_id: str | None
    prompt: str | list[int]
    params: SamplingParams
    mode: str | None  # None = the deployment's default


class RouterEvent(NamedTuple):
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    metadata: dict[str, Any] | None = None


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
    ) -> None:
        self.config = config
        self.policy = RoutingPolicy(
            config, [w.worker_id for w in decode_workers], [w.worker_id for w in prefill_workers]
        )
        self.workers = {w.worker_id: w for w in [*decode_workers, *prefill_workers]}
        self.limits = limits
        self.tokenizer = tokenizer
        self.active: dict[str, Route | None] = {}
        self._ids = itertools.count()
        self._seeds = random.Random()

    # ---- validation ----------------------------------------------------------------------------
    def _validate(self, req: GenerateInput) -> tuple[str, list[int], SamplingParams]:
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise RequestError("INVALID_ARGUMENT", "prompt: must not be empty")
            if self.tokenizer is None:
                raise RequestError("INVALID_ARGUMENT", "prompt: this model has no tokenizer; send token ids")
            prompt = self.tokenizer.encode(req.prompt)
        else:
            prompt = list(req.prompt)
        if not prompt:
            raise RequestError("INVALID_ARGUMENT", "prompt: must not be empty")
        bad = [t for t in prompt if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise RequestError(
                "INVALID_ARGUMENT", f"prompt: token ids must be in [0, {self.limits.vocab_size}), got {bad[:5]}"
            )
        if len(prompt) >= self.limits.max_model_len:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"prompt: {len(prompt)} tokens leaves no room to generate "
                f"within max_model_len={self.limits.max_model_len}",
            )
        params = req.params
        if params.seed is None:  # prefill and decode workers must draw from the same seed
            params = replace(params, seed=self._seeds.getrandbits(63))
        request_id = req.request_id or f"rt-{next(self._ids)}-{random.getrandbits(32):08x}"
        if request_id in self.active:
            raise RequestError("ALREADY_EXISTS", f"request_id {request_id!r} is already in use")
        if len(self.active) >= self.config.max_active_requests:
            raise RequestError(
                "RESOURCE_EXHAUSTED", f"router is at its limit of {self.config.max_active_requests} active requests"
            )
        return request_id, prompt, params

    # ---- serving -------------------------------------------------------------------------------
    async def generate(self, req: GenerateInput) -> AsyncIterator[RouterEvent]:
        """Stream a request's tokens. Raises RequestError before the first event for bad input."""
        received = time.time()
        request_id, prompt, params = self._validate(req)
        try:
            route = self.policy.route(prompt, params.max_tokens, req.mode)
        except ValueError as e:
            raise RequestError("INVALID_ARGUMENT", str(e)) from None
        self.active[request_id] = route
        self.policy.start(route, prompt, params.max_tokens)
        detok = self.tokenizer.detokenizer() if self.tokenizer else None
        meta: dict[str, Any] = {
            "request_id": request_id,
            "mode": route.mode,
            "decode_worker": route.decode_worker,
            "prefill_worker": route.prefill_worker or "",
        }
        prefill_pending = route.prefill_worker is not None
        first_sent: float | None = None
        num_out = 0
        finished = False
        try:
            if route.mode == "disaggregated":
                events = self._disaggregated(request_id, prompt, params, route, meta)
            else:
                events = self._colocated(request_id, prompt, params, route)
            async for token_ids, done, reason, worker_meta in events:
                if prefill_pending and worker_meta is not None and worker_meta.get("prefill_done"):
                    self.policy.prefill_done(route, prompt)
                    prefill_pending = False
                    continue
                text = detok.push(token_ids) if detok is not None and token_ids else ""
                if done and detok is not None:
                    text += detok.flush()
                num_out += len(token_ids)
                if token_ids and first_sent is None:
                    first_sent = time.time()
                    meta["ttft_s"] = first_sent - received
                if done:
                    finished = True
                    meta.update({k: v for k, v in (worker_meta or {}).items() if k in _META_KEYS})
                    meta.update(e2e_s=time.time() - received, num_prompt_tokens=len(prompt), num_output_tokens=num_out)
                    meta.setdefault("ttft_s", time.time() - received)
                    yield RouterEvent(token_ids, text, True, reason, meta)
                    return
                yield RouterEvent(token_ids, text, False)
            raise RequestError("INTERNAL", f"worker stream for {request_id} ended without a final message")
        finally:
            if prefill_pending:
                self.policy.prefill_done(route, prompt)
            self.policy.finish(route, prompt, params.max_tokens)
            self.active.pop(request_id, None)
            if not finished:  # cancelled or failed: make sure no worker keeps working on it
                await asyncio.shield(self._abort_on_workers(request_id, route))

    async def _colocated(self, request_id: str, prompt: list[int], params: SamplingParams, route: Route):
        decode = self.workers[route.decode_worker].actor
        stream = decode.generate.options(num_returns="streaming").remote(request_id, prompt, params)
        async for item in self._worker_stream(stream):
            yield item

    async def _disaggregated(
        self, request_id: str, prompt: list[int], params: SamplingParams, route: Route, meta: dict[str, Any]
    ):
        decode = self.workers[route.decode_worker].actor
        prefill = self.workers[route.prefill_worker].actor  # type: ignore[index]
        reservation = await self._reserve(decode, request_id, prompt, params)
        meta["num_cached_tokens"] = reservation.num_cached_tokens
        try:
            result = await prefill.prefill.remote(
                request_id,
                prompt,
                params,
                reservation.target,
                reservation.block_ids,
                reservation.num_cached_tokens,
                reservation.deadline,
            )
        except (RayActorError, RayTaskError) as e:
            if _is_value_error(e):
                raise RequestError("INVALID_ARGUMENT", _cause(e)) from None
            log.warning(
                "prefill worker %s failed on %s (%s); prefilling locally", route.prefill_worker, request_id, _cause(e)
            )
            await asyncio.shield(self._abort_on_workers(request_id, route))
            meta.update(mode="colocated", prefill_worker="", fallback=f"prefill worker failed: {_cause(e)}")
            yield [], False, None, {"prefill_done": True}
            async for item in self._colocated(request_id, prompt, params, route._replace(mode="colocated")):
                yield item
            return
        meta.update(queue_s=result.queue_s, prefill_s=result.prefill_s)
        yield [], False, None, {"prefill_done": True}
        yield [result.first_token], False, None, None
        prefill_meta = {"queue_s": result.queue_s, "prefill_s": result.prefill_s}
        stream = decode.decode.options(num_returns="streaming").remote(
            request_id, result.first_token, result.first_token_time, prefill_meta
        )
        async for item in self._worker_stream(stream):
            yield item

    async def _reserve(self, decode, request_id: str, prompt: list[int], params: SamplingParams):
        deadline = time.monotonic() + self.config.reserve_timeout_s
        delay = 0.005
        while True:
            try:
                reservation = await decode.reserve.remote(request_id, prompt, params)
            except RayTaskError as e:
                code = "INVALID_ARGUMENT" if _is_value_error(e) else "INTERNAL"
                raise RequestError(code, _cause(e)) from None
            if reservation is not None:
                return reservation
            if time.monotonic() > deadline:
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"no KV blocks free on the decode worker for {self.config.reserve_timeout_s} s",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _worker_stream(self, stream):
        try:
            async for ref in stream:
                for event in await ref:
                    if event.error:
                        raise RequestError("UNAVAILABLE", f"worker: {event.error}")
                    yield event.token_ids, event.finished, event.finish_reason, event.metadata
                    if event.finished:
                        return
        except RayTaskError as e:
            code = "INVALID_ARGUMENT" if _is_value_error(e) else "INTERNAL"
            raise RequestError(code, _cause(e)) from None
        except RayActorError as e:
            raise RequestError("UNAVAILABLE", f"worker died: {_cause(e)}") from None

    async def _abort_on_workers(self, request_id: str, route: Route) -> None:
        # Prefill first: it returns once none of its pushes can still write into the decode pool.
        for worker_id in (route.prefill_worker, route.decode_worker):
            if worker_id is None:
                continue
            try:
                await asyncio.wait_for(self.workers[worker_id].actor.abort.remote(request_id), 30.0)
            except Exception as e:  # a dead worker has nothing left to abort
                log.warning("abort of %s on %s failed: %s", request_id, worker_id, e)

    async def abort(self, request_id: str) -> bool:
        route = self.active.get(request_id)
        if route is None:
            return False
        await self._abort_on_workers(request_id, route)
        return True

    async def stats(self, steps_since: float | None = None) -> list[Any]:
        refs = [w.actor.stats.remote(steps_since) for w in self.workers.values()]
        return list(await asyncio.gather(*refs))

    async def health(self, timeout_s: float = 5.0) -> tuple[bool, str]:
        try:
            await asyncio.wait_for(asyncio.gather(*[w.actor.ready.remote() for w in self.workers.values()]), timeout_s)
        except Exception as e:
            return False, f"a worker is not answering: {e}"
        return True, "serving"


_META_KEYS = {
    "queue_s",
    "prefill_s",
    "kv_transfer_s",
    "kv_transfer_bytes",
    "num_cached_tokens",
    "decode_worker",
    "second_token_time",
}


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]


def _is_value_error(e: BaseException) -> bool:
    return isinstance(getattr(e, "cause", None), ValueError)
