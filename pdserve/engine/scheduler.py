"""Chunked-prefill scheduler. Pure Python: no torch, so the simulator drives this very class.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Order of service: running decodes (one token each), then partially prefilled requests, then waiting
requests in arrival order. Each takes ``min(uncomputed tokens, budget left, chunk cap)``. With
chunking off a prefill is scheduled whole or not at all. When blocks run out, the newest running
request is preempted (its blocks freed, its tokens recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Mapping
from typing import NamedTuple

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import FinishReason, Request, RequestStatus


def chunk_context_tokens(start: int, num_tokens: int) -> int:
    """Keys attended by a chunk of ``num_tokens`` at absolute ``start``: ``Σ_i (start + i + 1)``."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class ScheduledChunk(NamedTuple):
    """One request's share of a step: compute tokens [start, start + num_tokens)."""

    request_id: str
    token_ids: list[int]
    start: int  # absolute position of the first token (== num_computed_tokens before the step)
    block_ids: list[int]
    samples: bool  # the chunk reaches the last known token, so a new token is sampled


class SchedulerOutput(NamedTuple):
    """A plain description of one step; the model runner (or the simulator's cost model) consumes it."""

    chunks: list[ScheduledChunk]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if len(c.token_ids) == 1 and c.samples)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_context_tokens(self) -> int:
        """Keys attended, summed over every scheduled token (token i of a chunk sees start + i + 1)."""
        return sum(chunk_context_tokens(c.start, len(c.token_ids)) for c in self.chunks)

    @property
    def num_decode_context_tokens(self) -> int:
        """Of ``num_context_tokens``, the keys attended by decode tokens (``start + 1`` each)."""
        return sum(c.start + 1 for c in self.chunks if len(c.token_ids) == 1 and c.samples)

    @property
    def num_kv_read_tokens(self) -> int:
        """Already cached tokens whose KV the step reads: the sum of the chunks' starts."""
        return sum(c.start for c in self.chunks)


def append_token(request: Request, token: int, now: float, max_model_len: int) -> FinishReason | None:
    """Append a sampled token with its time; returns why the request ends now, or None (the stop rule: EOS
    unless ignored, a stop token, ``max_tokens``, ``max_model_len``)."""
    request.all_token_ids.append(token)
    request.times.tokens.append(now)
    if request.times.first_token is None:
        request.times.first_token = now
    params = request.params
    if (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class TokenUpdate(NamedTuple):
    """One sampled token as ``Scheduler.update_from_output`` applied it."""

    request: Request
    token: int
    finish_reason: FinishReason | None  # set when the token ended the request


class SchedulerConfig(NamedTuple):
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_chunk_tokens: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0  # steps scheduled so far (a stalled schedule, with no chunks, is not one)
        self.clock = time.time  # the simulator swaps in its virtual clock
        # Which running requests may be preempted to break a stall (a prefill worker keeps those whose
        # KV blocks a push is still reading); None = any.
        self.preemptable: Callable[[Request], bool] | None = None

    # ---- queue management ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING:
            request.queued_at_step = self.num_steps
            self.waiting.append(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            request.reserved_at_step = self.num_steps

    def admit_front(self, request: Request) -> None:
        """Queue an already-known request (remote KV arrived) ahead of new arrivals."""
        request.status = RequestStatus.WAITING
        request.queued_at_step = self.num_steps
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason, free_blocks: bool = True) -> None:
        """Remove a request from the queues and, unless told to keep them, free its blocks (idempotent)."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.times.finished = self.clock()
        if free_blocks:
            self.block_manager.free(request)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step. If it would compute nothing while several requests run (partial prefills holding
        every block, each waiting for one more), the newest preemptable one is preempted until it can."""
        output = self._schedule_once()
        preempted: list[str] = []
        while not output.chunks and len(self.running) > 1:
            victim = next((r for r in reversed(self.running) if self.preemptable is None or self.preemptable(r)), None)
            if victim is None:
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
            output = self._schedule_once()
        if output.chunks:
            self.num_steps += 1
        return SchedulerOutput(output.chunks, preempted + output.preempted) if preempted else output

    def _schedule_once(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[str] = set()

        decodes = [r for r in self.running if self._is_decode(r)]
        prefills = [r for r in self.running if not self._is_decode(r)]
        for request in decodes:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step, for another decode's sake
            while not self.block_manager.allocate_slots(request, 1):
                victim = self._newest_unscheduled(scheduled)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING or not self._owns_slots(request, 1):
                continue
            chunks.append(self._chunk(request, 1))
            scheduled.add(request.request_id)
            budget -= 1

        for request in prefills:
            if budget == 0 or request.status != RequestStatus.RUNNING:
                continue
            n = self._chunk_size(request, budget)
            if n == 0 or not self.block_manager.allocate_slots(request, n):
                continue  # stays partially prefilled; it will get blocks when others finish
            chunks.append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = None
            if not request.block_ids:
                hit = self.block_manager.find_prefix_hit(request)
                if hit.num_tokens == 0:
                    hit = None
            uncomputed = request.num_uncomputed_tokens - (hit.num_tokens if hit else 0)
            n = self._chunk_size(request, budget, uncomputed)
            if n == 0 or not self.block_manager.can_allocate(request, n, hit):
                break
            self.waiting.popleft()
            if hit is not None:
                self.block_manager.take_prefix_hit(request, hit)
            ok = self.block_manager.allocate_slots(request, n)
            assert ok, "can_allocate promised blocks"
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = self.clock()
            self.running.append(request)
            chunks.append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n

        return SchedulerOutput(chunks, preempted)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` by what the step computed; register newly full blocks."""
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.start + len(chunk.token_ids)
            self.block_manager.cache_full_blocks(request)

    def update_from_output(
        self, output: SchedulerOutput, tokens: Mapping[str, int], now: float, keep_blocks: Container[str] = ()
    ) -> list[TokenUpdate]:
        """Apply a step's results: advance what it computed (``update_after_step``), then append each sampled
        token of a still-running request under the stop rule (``append_token``), finishing the requests it
        ends (their blocks freed, unless their id is in ``keep_blocks``). One update per appended token."""
        self.update_after_step(output)
        updates = []
        for request_id, token in tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            reason = append_token(request, token, now, self.config.max_model_len)
            if reason is not None:
                self.finish(request, reason, free_blocks=request_id not in keep_blocks)
            updates.append(TokenUpdate(request, token, reason))
        return updates

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _is_decode(request: Request) -> bool:
        return request.num_uncomputed_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens

    def _chunk_size(self, request: Request, budget: int, uncomputed: int | None = None) -> int:
        remaining = request.num_uncomputed_tokens if uncomputed is None else uncomputed
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.config.max_chunk_tokens or budget
        return min(remaining, budget, cap)

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request.request_id,
            request.all_token_ids[start : start + n],
            start,
            list(request.block_ids),
            samples=start + n == request.num_tokens,
        )

    def _owns_slots(self, request: Request, n: int) -> bool:
        return len(request.block_ids) * self.block_manager.block_size >= request.num_computed_tokens + n

    def _newest_unscheduled(self, scheduled: set[str]) -> Request | None:
        for request in reversed(self.running):
            if request.request_id not in scheduled:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
