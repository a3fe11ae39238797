"""Routing decisions: which decode worker, which prefill worker, and local or remote prefill.

Pure Python and synchronous, so it is tested without a cluster. The router keeps an approximate
view of each worker: the tokens it has outstanding, and (for decode workers) the chained hashes of
prompt blocks recently sent there — the blocks most likely to sit in its prefix cache. The view is
a hint; the worker's own prefix cache has the final word when it reserves or schedules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.block_manager import compute_block_hashes
from pdserve.messages import Mode
from pdserve.router.config import RouterConfig


@dataclass
class WorkerView:
    worker_id: str
    outstanding_tokens: int = 0
    num_requests: int = 0
    available: bool = True  # False while the worker is dead or restarting: nothing is routed to it
    prefix_blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched_tokens(self, hashes: list[bytes], block_size: int) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefix_blocks:
                break
            n += 1
        return n * block_size

    def remember(self, hashes: list[bytes], capacity: int) -> None:
        for h in hashes:
            self.prefix_blocks[h] = None
            self.prefix_blocks.move_to_end(h)
        while len(self.prefix_blocks) > capacity:
            self.prefix_blocks.popitem(last=False)


class NoWorkerAvailable(LookupError):
    """Every worker a request needs is down; the router answers UNAVAILABLE."""


class Route(NamedTuple):
    mode: str  # "colocated" or "disaggregated" (auto resolved)
    decode_worker: str
    prefill_worker: str | None
    expected_cached_tokens: int


class RoutingPolicy:
    def __init__(self, config: RouterConfig, decode_workers: list[str], prefill_workers: list[str]) -> None:
        if not decode_workers:
            raise ValueError("a deployment needs at least one decode worker")
        if config.default_mode != "colocated" and not prefill_workers:
            raise ValueError(f"default mode {config.default_mode!r} needs at least one prefill worker")
        self.config = config
        self.decode = {w: WorkerView(w) for w in decode_workers}
        self.prefill = {w: WorkerView(w) for w in prefill_workers}

    def route(
        self, prompt: list[int], max_tokens: int, mode: str | None, block_hashes: Sequence[bytes] | None = None
    ) -> Route:
        """Choose workers and resolve ``auto``; does not change the view (see ``start``). ``block_hashes``:
        the prompt's ``compute_block_hashes`` when the caller has them already (else computed here)."""
        mode = Mode.parse(mode or self.config.default_mode)
        if mode != "colocated" and not self.prefill:
            raise ValueError(f"mode {mode!r} needs a prefill worker; this deployment has none")
        if block_hashes is None:
            block_hashes = compute_block_hashes(prompt, self.config.block_size)
        hashes = list(block_hashes[: (len(prompt) - 1) // self.config.block_size])
        decodes = [v for v in self.decode.values() if v.available]
        if not decodes:
            raise NoWorkerAvailable("no decode worker is available (all are dead or restarting)")
        prefills = [v for v in self.prefill.values() if v.available]
        if mode == "disaggregated" and not prefills:
            mode = "colocated"  # every prefill worker is down: prefill on the decode worker

        def decode_cost(view: WorkerView) -> tuple[int, int]:
            # the work this request adds there (its uncached prompt and its outputs) on top of what is queued
            cached = view.matched_tokens(hashes, self.config.block_size)
            return view.outstanding_tokens + len(prompt) - cached + max_tokens, view.num_requests

        decode = min(decodes, key=decode_cost)
        cached = decode.matched_tokens(hashes, self.config.block_size)
        prefill = min(prefills, key=lambda v: (v.outstanding_tokens, v.num_requests), default=None)
        if mode == "auto":
            uncached = len(prompt) - cached
            remote = (
                prefill is not None
                and uncached > self.config.auto_min_remote_tokens
                and prefill.outstanding_tokens < self.config.auto_max_prefill_queue_tokens
            )
            mode = "disaggregated" if remote else "colocated"
        return Route(mode, decode.worker_id, prefill.worker_id if mode == "disaggregated" and prefill else None, cached)

    def set_available(self, worker_id: str, available: bool) -> None:
        view = self.decode.get(worker_id) or self.prefill.get(worker_id)
        if view is not None:
            view.available = available

    def is_available(self, worker_id: str) -> bool:
        view = self.decode.get(worker_id) or self.prefill.get(worker_id)
        return view is not None and view.available

    # ---- bookkeeping: the router calls these as requests move ----------------------------------
    def start(
        self, route: Route, prompt: list[int], max_tokens: int, block_hashes: Sequence[bytes] | None = None
    ) -> None:
        decode = self.decode[route.decode_worker]
        decode.outstanding_tokens += len(prompt) - route.expected_cached_tokens + max_tokens
        decode.num_requests += 1
        hashes = (
            list(block_hashes) if block_hashes is not None else compute_block_hashes(prompt, self.config.block_size)
        )
        if self.config.prefix_caching:
            decode.remember(hashes, self.config.prefix_index_blocks)
        if route.prefill_worker is not None:
            prefill = self.prefill[route.prefill_worker]
            prefill.outstanding_tokens += len(prompt) - route.expected_cached_tokens
            prefill.num_requests += 1

    def prefill_done(self, route: Route, prompt: list[int]) -> None:
        if route.prefill_worker is not None:
            prefill = self.prefill[route.prefill_worker]
            prefill.outstanding_tokens -= len(prompt) - route.expected_cached_tokens
            prefill.num_requests -= 1

    def finish(self, route: Route, prompt: list[int], max_tokens: int) -> None:
        decode = self.decode[route.decode_worker]
        decode.outstanding_tokens -= len(prompt) - route.expected_cached_tokens + max_tokens
        decode.num_requests -= 1
