"""Disaggregation's engine-side protocol, torch-free: one copy for the engine and the simulator.

- ``reserve_remote_blocks``: set aside blocks for a prompt whose KV another worker computes (leading
  full blocks found in the prefix cache are shared and need no transfer);
- ``admit_remote``: all of the prompt's KV has arrived and the first token is known: decode from here;
- ``append_token``: the scheduler's stop rule (``engine.scheduler.append_token``), applied to the first token;
- ``prefill_admission_open``: a prefill worker keeps its own FIFO of accepted prompts and admits the
  next one into its engine (reserving on the decode worker at that moment) only while the engine's
  waiting queue holds fewer prompt tokens than one step's token budget.

``engine.llm_engine.LLMEngine`` (``reserve_remote``, ``admit_remote``, ``step``) and
``sim.simulator`` call these functions; neither re-types them.
"""

from __future__ import annotations

from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, append_token

__all__ = [
    "admission_open",
    "admit_remote",
    "append_token",
    "prefill_admission_open",
    "reserve_remote_blocks",
    "waiting_prompt_tokens",
]


def reserve_remote_blocks(scheduler: Scheduler, request: Request, now: float) -> int | None:
    """Allocate blocks for ``request``'s prompt and register it as waiting for remote KV.

    Returns the number of leading prompt tokens already in the prefix cache (their blocks need no
    transfer), or None, changing nothing, when there are not enough free blocks now.
    """
    blocks = scheduler.block_manager
    hit = blocks.find_prefix_hit(request)
    uncached = request.num_prompt_tokens - hit.num_tokens
    if not blocks.can_allocate(request, uncached, hit):
        return None
    blocks.take_prefix_hit(request, hit)
    ok = blocks.allocate_slots(request, uncached)
    assert ok, "can_allocate promised blocks"
    request.status = RequestStatus.WAITING_FOR_REMOTE_KV
    request.times.first_scheduled = now
    scheduler.add(request)
    return hit.num_tokens


def admit_remote(
    scheduler: Scheduler, request: Request, first_token: int, now: float, max_model_len: int
) -> FinishReason | None:
    """The prompt's KV is all in the reserved blocks: mark it computed, append the first token, and
    queue the request ahead of new arrivals. When the first token already ends it, finish it (freeing
    its blocks) and return the reason; else None. Raises ValueError unless it waits for remote KV."""
    if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
        raise ValueError(f"request {request.request_id!r} is not waiting for remote KV")
    request.num_computed_tokens = request.num_prompt_tokens
    scheduler.block_manager.cache_full_blocks(request)
    reason = append_token(request, first_token, now, max_model_len)
    if reason is not None:
        scheduler.finish(request, reason)
        return reason
    scheduler.admit_front(request)
    return None


def waiting_prompt_tokens(scheduler: Scheduler) -> int:
    """Tokens still to compute of the requests in the scheduler's waiting queue."""
    return sum(r.num_uncomputed_tokens for r in scheduler.waiting)


def admission_open(waiting_tokens: int, budget: int) -> bool:
    """The prefill worker's admission rule: admit the next prompt of its FIFO into its engine while
    fewer prompt tokens than one step's budget (``max_num_batched_tokens``) wait to be computed there.
    Every prompt admitted while a step runs joins the next step, up to that budget."""
    return waiting_tokens < budget


def prefill_admission_open(scheduler: Scheduler) -> bool:
    """``admission_open`` for what waits in ``scheduler`` now."""
    return admission_open(waiting_prompt_tokens(scheduler), scheduler.config.max_num_batched_tokens)
