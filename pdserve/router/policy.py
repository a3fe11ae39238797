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
from pdserve.options import option
from pdserve.transport_config import DEFAULT_RESERVATION_TTL_S

MODES = ("colocated", "disaggregated", "auto")


@dataclass(frozen=True)
class RouterConfig:
    """A router's policy and limits. Fields with a help text are command-line options (``pdserve.options``);
    the deployment sets the others from its own settings."""

    default_mode: str = "colocated"
    block_size: int = 16
    auto_min_remote_tokens: int = option(
        512, "auto mode: prefill remotely when a prompt has more uncached tokens than this..."
    )
    auto_max_prefill_queue_tokens: int = option(
        16384, "...and some prefill worker has fewer prompt tokens queued than this"
    )
    max_active_requests: int = option(4096, "requests in flight through one router; beyond this, RESOURCE_EXHAUSTED")
    max_queued_requests: int = option(512, "requests waiting for their first token; beyond this, RESOURCE_EXHAUSTED")
    max_queued_prompt_tokens: int = option(
        262144, "prompt tokens of the requests waiting for their first token; beyond this, RESOURCE_EXHAUSTED"
    )
    max_request_bytes: int = option(8 << 20, "a larger request body is refused before it is parsed (gRPC and HTTP)")
    default_chat_max_tokens: int = option(1024, "HTTP chat requests that name no max_tokens get at most this many")
    reserve_timeout_s: float = option(60.0, "seconds a prefill may wait for its decode worker to have room")
    abort_fence_s: float = DEFAULT_RESERVATION_TTL_S  # an abort waits this long for the prefill worker's confirmation
    stream_idle_timeout_s: float = option(600.0, "a stream with no token for this many seconds fails with UNAVAILABLE")
    decode_silence_timeout_s: float = option(
        5.0,
        "a decode worker whose event stream is silent this long (an idle one sends a heartbeat every 0.5 s) "
        "counts as hung: its requests fail with UNAVAILABLE and nothing is routed to it until it streams again",
    )
    max_queue_time_s: float | None = option(
        None,
        "refuse (RESOURCE_EXHAUSTED / HTTP 429) a request still without its first token after this many seconds, "
        "and abort it on its workers, rather than serve it late; default: no bound",
    )
    prefix_index_blocks: int = option(65536, "prompt blocks the router remembers per decode worker (prefix routing)")
    prefix_caching: bool = True  # the workers cache prefixes; if not, the view remembers nothing
    stream_interval: int = option(
        1, "tokens per streamed message after the first (a request may ask for its own); 1: every token"
    )

    def __post_init__(self) -> None:
        if self.default_mode not in MODES:
            raise ValueError(f"default_mode must be one of {', '.join(MODES)}, got {self.default_mode!r}")
        for name in (
            "block_size",
            "max_active_requests",
            "max_queued_requests",
            "max_queued_prompt_tokens",
            "max_request_bytes",
            "default_chat_max_tokens",
            "prefix_index_blocks",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.auto_min_remote_tokens < 0 or self.auto_max_prefill_queue_tokens < 0:
            raise ValueError("auto thresholds must be >= 0")
        for name in ("reserve_timeout_s", "abort_fence_s", "stream_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.decode_silence_timeout_s >= 1.0:  # several heartbeats must fit in it
            raise ValueError(f"decode_silence_timeout_s must be >= 1, got {self.decode_silence_timeout_s!r}")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0 (or None), got {self.max_queue_time_s!r}")


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
        mode = mode or self.config.default_mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
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
