"""The decode worker: a Ray actor that decodes, prefills locally, and accepts KV pushed by prefill workers.

Colocated requests (``generate``) run chunked prefill and decode in this worker's continuous batch.
Disaggregated requests go ``reserve`` → (a prefill worker pushes KV into the reserved blocks, one
notification per push) → ``decode(first_token)``; the request joins the running batch once every
push has landed and the first token is known.

Blocks reserved for remote KV belong to this worker until the request ends. Each reservation has
a deadline: if the KV is not all here by then (prefill worker dead or stuck), the blocks are freed
and the request's stream ends with an error. Nothing waits forever; no block leaks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, TokenEvent, WorkerStats, request_timings
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.request import Request
from pdserve.kv_transfer import TransferTarget, make_transport

from pdserve.placement import current_node

log = logging.getLogger(__name__)


class ReserveResult(NamedTuple):
    """Where a prefill worker must write a request's KV."""

    worker_id: str
    target: TransferTarget
    block_ids: list[int]  # one per prompt block, in order (cached ones included: they need no push)
    num_cached_tokens: int  # leading prompt tokens already here (their blocks need no transfer)
    deadline: float  # unix time after which the reservation is dropped


@dataclass
class _Pending:
    """A reservation waiting for its KV and its first token."""

    deadline: float
    reserved_at: float
    first_token: int | None = None
    first_token_time: float | None = None
    pushes_seen: set[int] = field(default_factory=set)
    last_push: int | None = None  # chunk_index of the push marked is_last
    kv_done_at: float | None = None


class DecodeWorker:
    """A Ray actor (async). Construct through ``ray.remote(DecodeWorker)``; await ``ready()``."""

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transport: str = "nixl",
        transport_config: Any = None,
        reservation_timeout_s: float = 120.0,
        stream_timeout_s: float = 600.0,
    ) -> None:
        self.worker_id = worker_id
        self.reservation_timeout_s = reservation_timeout_s
        self.stream_timeout_s = stream_timeout_s
        engine = LLMEngine(engine_config)
        self.transport = make_transport(transport, transport_config)
        self.transport.register_pool(engine.kv_cache)
        self.target = self.transport.describe()
        self._pending: dict[str, _Pending] = {}  # touched on the loop thread only
        self._requests: dict[str, tuple[Request, dict[str, Any]]] = {}  # live streams: request, metadata
        self._kv_bytes = 0
        self.aengine = AsyncEngine(engine, on_step=self._on_step, on_tick=self._on_tick)
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        engine = self.aengine.engine
        return {
            "worker_id": self.worker_id,
            "role": "decode",
            "node": self.node,
            "num_blocks": engine.block_manager.num_blocks,
            "block_size": engine.config.block_size,
            "device": str(engine.device),
            "transport": self.target.kind,
        }

    # ---- colocated: prefill and decode here ----------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[TokenEvent]]:
        """Stream batches of token events for a request that this worker prefills and decodes."""
        self.aengine.open_stream(request_id)
        try:
            await self.aengine.run(lambda e: self._add_local(e, request_id, prompt_token_ids, params))
        except Exception:
            self.aengine.close_stream(request_id)
            raise
        async for batch in self._stream(request_id):
            yield batch

    def _add_local(self, engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        engine.add_request(prompt, params, request_id, detokenize=False)  # the router detokenizes
        self._requests[request_id] = (engine.get_request(request_id), {"mode_local": True})  # type: ignore[assignment]

    # ---- disaggregated: KV comes from a prefill worker -----------------------------------------
    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> ReserveResult | None:
        """Set aside blocks for the prompt's KV. None when this worker has no room now."""

        def do(engine: LLMEngine) -> ReserveResult | None:
            reservation = engine.reserve_remote(prompt_token_ids, params, request_id)
            if reservation is None:
                return None
            now = time.time()
            deadline = now + self.reservation_timeout_s
            self._pending[request_id] = _Pending(deadline=deadline, reserved_at=now)
            self._requests[request_id] = (engine.get_request(request_id), {})  # type: ignore[assignment]
            return ReserveResult(
                self.worker_id, self.target, reservation.block_ids, reservation.num_cached_tokens, deadline
            )

        return await self.aengine.run(do)

    async def decode(
        self, request_id: str, first_token: int, first_token_time: float, prefill_meta: dict[str, Any] | None = None
    ) -> AsyncIterator[list[TokenEvent]]:
        """Stream the tokens after ``first_token`` (already sent to the client by the router)."""
        self.aengine.open_stream(request_id)

        def do(engine: LLMEngine) -> None:
            pending = self._pending.get(request_id)
            if pending is None:
                raise ValueError(
                    f"request {request_id!r} has no live reservation on {self.worker_id} "
                    "(never reserved, aborted, or its KV deadline passed)"
                )
            pending.first_token, pending.first_token_time = first_token, first_token_time
            self._requests[request_id][1].update(prefill_meta or {})
            self._admit_if_ready(engine, request_id, pending)

        try:
            await self.aengine.run(do)
        except Exception:
            self.aengine.close_stream(request_id)
            raise
        async for batch in self._stream(request_id):
            yield batch

    def _on_tick(self, engine: LLMEngine) -> None:
        for note in self.transport.poll_notifications():
            pending = self._pending.get(note.request_id)
            if pending is None:
                continue  # a late push for a request that is gone
            pending.pushes_seen.add(note.chunk_index)
            if note.is_last:
                pending.last_push = note.chunk_index
            self._admit_if_ready(engine, note.request_id, pending)
        if self._pending:
            now = time.time()
            for request_id, pending in list(self._pending.items()):
                if now > pending.deadline:
                    log.warning("%s: KV for %s did not arrive in time; freeing its blocks", self.worker_id, request_id)
                    self._pending.pop(request_id)
                    engine.abort(request_id)
                    self._finish_stream(
                        request_id, TokenEvent([], "", True, "abort", error="KV transfer deadline passed")
                    )

    def _admit_if_ready(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        if pending.last_push is None or len(pending.pushes_seen) < pending.last_push + 1:
            return
        if pending.kv_done_at is None:
            pending.kv_done_at = time.time()
        if pending.first_token is None:
            return
        del self._pending[request_id]
        request, meta = self._requests[request_id]
        block_bytes = self.target.block_bytes
        pushed_blocks = len(request.block_ids) - request.num_cached_tokens // engine.config.block_size
        self._kv_bytes += pushed_blocks * block_bytes
        meta["kv_transfer_bytes"] = pushed_blocks * block_bytes
        meta["kv_transfer_s"] = max(0.0, pending.kv_done_at - (pending.first_token_time or pending.kv_done_at))
        meta["kv_wait_s"] = pending.kv_done_at - pending.reserved_at
        final = engine.admit_remote(request_id, pending.first_token)
        if final is not None:  # the first token already ended it (EOS, stop token, max_tokens=1)
            self._emit_output(engine, final)

    # ---- streaming -----------------------------------------------------------------------------
    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._emit_output(engine, out)

    def _emit_output(self, engine: LLMEngine, out: RequestOutput) -> None:
        if not out.finished:
            self.aengine.emit(out.request_id, TokenEvent(out.new_token_ids, out.new_text, False))
            return
        entry = self._requests.pop(out.request_id, None)
        meta: dict[str, Any] = {"decode_worker": self.worker_id}
        if entry is not None:
            request, extra = entry
            local = extra.pop("mode_local", False)
            meta.update(
                request_timings(request)
                if local
                else {
                    "num_cached_tokens": request.num_cached_tokens,
                    "num_prompt_tokens": request.num_prompt_tokens,
                    "num_output_tokens": request.num_output_tokens,
                }
            )
            meta.update(extra)
            if len(request.times.tokens) > 1:
                meta["second_token_time"] = request.times.tokens[1]
        reason = out.finish_reason.value if out.finish_reason else None
        self.aengine.emit(out.request_id, TokenEvent(out.new_token_ids, out.new_text, True, reason, meta))

    def _finish_stream(self, request_id: str, event: TokenEvent) -> None:
        self._requests.pop(request_id, None)
        self.aengine.emit(request_id, event)

    async def _stream(self, request_id: str) -> AsyncIterator[list[TokenEvent]]:
        finished = False
        try:
            async for batch in self.aengine.stream(request_id, self.stream_timeout_s):
                finished = any(e.finished for e in batch)
                yield batch
        finally:
            if not finished:  # the consumer went away or the stream timed out: stop the work
                await self.abort(request_id)

    # ---- control -------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Stop a request (running, waiting, or reserved) and free its blocks."""

        def do(engine: LLMEngine) -> bool:
            self._pending.pop(request_id, None)
            found = engine.abort(request_id)
            if found:
                self._finish_stream(request_id, TokenEvent([], "", True, "abort"))
            return found

        return await self.aengine.run(do)

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        stats = await self.aengine.stats(self.worker_id, "decode", len(self._pending), self._kv_bytes, steps_since)
        return stats._replace(node=self.node, device=str(self.aengine.engine.device))

    async def check_integrity(self) -> None:
        await self.aengine.run(lambda e: e.block_manager.check_integrity())

    async def cached_prompt_kv(self, prompt_token_ids: list[int]) -> Any:
        """Test hook: K/V of the prompt's leading full blocks found in this worker's prefix cache."""
        from pdserve.engine.model_runner import gather_kv

        def do(engine: LLMEngine):
            probe = Request("probe", prompt_token_ids, SamplingParams())
            hit = engine.block_manager.find_prefix_hit(probe)
            return gather_kv(engine.kv_cache, hit.block_ids, hit.num_tokens) if hit.block_ids else None

        return await self.aengine.run(do)

    async def shutdown(self) -> None:
        self.aengine.close()
        self.transport.close()
