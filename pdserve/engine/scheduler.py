"""Chunked-prefill scheduler. Pure Python: no torch, so the simulator drives this very class.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Two policies (``SchedulerConfig.scheduling``):

- ``mixed`` (the default; Sarathi-Serve's stall-free batching, vLLM V1): running decodes (one token
  each), then partially prefilled requests, then waiting requests in arrival order share each step;
- ``prefill-first`` (vLLM v0, the baseline of the disaggregation papers): while a prompt can be
  scheduled, a step holds prompt work only (partially prefilled requests, then waiting prompts in
  arrival order) and every running decode waits; a step of decodes runs only when no prompt can.

Each prompt takes ``min(uncomputed tokens, budget left, chunk cap)``. With chunking off a prefill is
scheduled whole or not at all. When blocks run out, the newest running request is preempted (its
blocks freed, its tokens recomputed later).
"""

from __future__ import annotations

import heapq
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


SCHEDULING_POLICIES = ("mixed", "prefill-first")


class SchedulerConfig(NamedTuple):
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_chunk_tokens: int | None = None
    scheduling: str = "mixed"  # one of SCHEDULING_POLICIES


class _StepPlan:
    """The step being built: its chunks, the requests in it, the budget left, the preemptions made."""

    __slots__ = ("budget", "chunks", "preempted", "scheduled")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks: list[ScheduledChunk] = []
        self.preempted: list[str] = []
        self.scheduled: set[str] = set()

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.scheduled.add(chunk.request_id)
        self.budget -= len(chunk.token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_POLICIES)}, got {config.scheduling!r}")
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
            self.waiting.append(request)

    def admit_front(self, request: Request) -> None:
        """Queue an already-known request (remote KV arrived) ahead of new arrivals."""
        request.status = RequestStatus.WAITING
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
        plan = _StepPlan(self.config.max_num_batched_tokens)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if self._is_decode(request) else prefills).append(request)
        if self.config.scheduling == "prefill-first":
            self._schedule_running_prefills(plan, prefills)
            self._schedule_waiting(plan, only="prompts")
            if not plan.chunks:  # no prompt could run: the decodes' step (remote KV admitted ones included)
                self._schedule_decodes(plan, decodes)
                self._schedule_waiting(plan, only="decodes")
        else:
            self._schedule_decodes(plan, decodes)
            self._schedule_running_prefills(plan, prefills)
            self._schedule_waiting(plan)
        return SchedulerOutput(plan.chunks, plan.preempted)

    def _schedule_decodes(self, plan: _StepPlan, decodes: list[Request]) -> None:
        """One token for every running decode, preempting the newest unscheduled requests for blocks."""
        for request in decodes:
            if plan.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step, for another decode's sake
            while not self.block_manager.allocate_slots(request, 1):
                victim = self._newest_unscheduled(plan.scheduled)
                if victim is None:
                    break
                self._preempt(victim)
                plan.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING or not self._owns_slots(request, 1):
                continue
            plan.add(self._chunk(request, 1))

    def _schedule_running_prefills(self, plan: _StepPlan, prefills: list[Request]) -> None:
        """The next chunk of every partially prefilled running request that the budget and blocks allow."""
        for request in prefills:
            if plan.budget == 0 or request.status != RequestStatus.RUNNING:
                continue
            n = self._chunk_size(request, plan.budget)
            if n == 0 or not self.block_manager.allocate_slots(request, n):
                continue  # stays partially prefilled; it will get blocks when others finish
            plan.add(self._chunk(request, n))

    def _schedule_waiting(self, plan: _StepPlan, only: str | None = None) -> None:
        """Waiting requests in arrival order while budget, sequence cap and blocks allow; the first that does
        not fit stops the rest (no overtaking). ``only="prompts"`` steps over the decode-ready requests (remote
        KV admitted, queued at the head); ``only="decodes"`` takes those at the head and stops at a prompt."""
        i = 0
        while i < len(self.waiting) and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if only is not None and (only == "decodes") != self._is_decode(request):
                if only == "decodes":
                    break
                i += 1
                continue
            hit = None
            if not request.block_ids:
                hit = self.block_manager.find_prefix_hit(request)
                if hit.num_tokens == 0:
                    hit = None
            uncomputed = request.num_uncomputed_tokens - (hit.num_tokens if hit else 0)
            n = self._chunk_size(request, plan.budget, uncomputed)
            if n == 0 or not self.block_manager.can_allocate(request, n, hit):
                break
            del self.waiting[i]
            if hit is not None:
                self.block_manager.take_prefix_hit(request, hit)
            ok = self.block_manager.allocate_slots(request, n)
            assert ok, "can_allocate promised blocks"
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = self.clock()
            self.running.append(request)
            plan.add(self._chunk(request, n))

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

    # ---- runs of identical decode steps (the simulator's fast path) ------------------------------
    def decode_run_length(self, output: SchedulerOutput) -> int:
        """How many steps, ``output`` (just scheduled) the first, the running batch can repeat as it is: every
        running request decodes one token a step, nothing waits, and the run ends at the step in which the
        first request reaches its ``max_tokens`` or the model length, or before the first step whose blocks
        the free pool cannot hold. 0 when ``output`` is not such a step. Only a caller that knows no request
        stops earlier (no EOS, no stop strings: the simulator) can run the steps as one
        (``advance_decode_run``)."""
        chunks = output.chunks
        if self.waiting or output.preempted or len(chunks) != len(self.running):
            return 0
        if any(len(c.token_ids) != 1 or not c.samples for c in chunks):
            return 0
        requests = [self.requests[c.request_id] for c in chunks]
        max_len = self.config.max_model_len
        last = min(min(r.params.max_tokens - r.num_output_tokens, max_len - r.num_tokens) for r in requests)
        if last < 1:
            return 0
        return self._steps_with_blocks(requests, [c.start for c in chunks], last)

    def _steps_with_blocks(self, requests: list[Request], first_starts: list[int], last: int) -> int:
        """The most steps (up to ``last``) of a run whose blocks the free pool holds: step ``i`` needs
        every request's blocks to cover its first start + ``i`` tokens."""
        blocks = self.block_manager
        bs, free = blocks.block_size, blocks.num_available_blocks
        held = [len(r.block_ids) for r in requests]

        def needed(steps: int) -> int:
            return sum(max(0, -(-(s + steps) // bs) - h) for s, h in zip(first_starts, held, strict=True))

        if needed(last) <= free:
            return last
        lo, hi = 1, last  # needed(lo) == 0 (step 1 is allocated), needed(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if needed(mid) <= free else (lo, mid)
        return lo

    def advance_decode_run(
        self, requests: list[Request], first_starts: list[int], a: int, j: int, token_id: int
    ) -> SchedulerOutput:
        """Apply steps ``a .. j-1`` of a run (``decode_run_length``) whose step ``a`` is scheduled and whose
        first step computed each request's token at ``first_starts``, every step sampling ``token_id``: the
        tokens, the computed counts and the blocks as those steps one by one and ``schedule()`` between
        them would have left them; returns step ``j``, scheduled (its blocks allocated)."""
        n = j - a
        if n:
            sampled = [token_id] * n
            for request in requests:
                request.all_token_ids.extend(sampled)
            self._apply_block_steps(requests, first_starts, a, j)
        chunks = []
        for request, first in zip(requests, first_starts, strict=True):
            start = first + j - 1
            request.num_computed_tokens = start
            chunks.append(
                ScheduledChunk(
                    request.request_id, request.all_token_ids[start : start + 1], start, list(request.block_ids), True
                )
            )
        return SchedulerOutput(chunks, [])

    def _apply_block_steps(self, requests: list[Request], first_starts: list[int], a: int, j: int) -> None:
        """What steps ``a .. j-1`` did to the blocks, in the engine's order: after each step, every
        request whose computed tokens fill a block registers it (prefix caching); then the next step
        allocates a block to every request whose next token needs one. Only those requests are visited
        (and, with prefix caching, any whose registration is behind: retried after every step)."""
        blocks = self.block_manager
        bs, caching = blocks.block_size, blocks.enable_prefix_caching
        events: list[tuple[int, int, int]] = []  # (step i, 0: register after it / 1: allocate for step i+1, request)
        behind: set[int] = set()
        for q, (request, first) in enumerate(zip(requests, first_starts, strict=True)):
            if caching:
                if request.num_registered_blocks < _num_full(request, bs, first + a - 1):
                    behind.add(q)
                    events.extend((i, 0, q) for i in range(a, j))
                else:
                    events.extend((i, 0, q) for i in range(a + (-(first + a)) % bs, j, bs))
            covered = len(request.block_ids) * bs  # slots held; step i + 1 needs first + i + 1 of them
            events.extend((i, 1, q) for i in range(max(a, covered - first), j, bs))
        heapq.heapify(events)
        while events:
            i, phase, q = heapq.heappop(events)
            request = requests[q]
            request.num_computed_tokens = first_starts[q] + i
            if phase == 1:
                ok = blocks.allocate_slots(request, 1)
                assert ok, "the run was planned within the free blocks"
                continue
            blocks.cache_full_blocks(request)
            if q not in behind and request.num_registered_blocks < _num_full(request, bs, request.num_computed_tokens):
                behind.add(q)
                for later in range(i + 1, j):
                    if (first_starts[q] + later) % bs:  # the block-filling steps are queued already
                        heapq.heappush(events, (later, 0, q))

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


def _num_full(request: Request, block_size: int, computed: int) -> int:
    """The request's full blocks when ``computed`` of its tokens are computed (``cache_full_blocks``)."""
    return min(computed // block_size, len(request.block_ids))
