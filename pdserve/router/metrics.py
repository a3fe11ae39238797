"""Prometheus metrics of one router process: what its requests saw, and its view of the workers.

Each ``Router`` owns a ``RouterMetrics`` with a registry of its own (several routers in one process,
as in tests, do not collide; several router processes each expose theirs). The router calls it at a
few points: ``request_rejected`` (refused before routing), ``request_finished`` (once per routed
request, with its ``RequestMetrics`` and outcome) and ``token_gap`` (once per streamed chunk after
the first: the only per-token cost, one histogram observation and one append to ``recent``, the last
minute's latencies the explorer's live view reads). Worker gauges and preemption counts
are pulled from ``Router.stats`` when scraped (``scrape``), so nothing polls the workers unless
someone reads the metrics.

Outcomes: ``finished`` (ended by EOS, a stop token, a length limit, or a stop string the front door
matched), ``aborted`` (an Abort call, or the client went away), ``failed`` (an error after routing),
``rejected`` (refused before routing: bad input, overload, no worker).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pdserve.messages import RequestMetrics

if TYPE_CHECKING:
    from pdserve.router.router import Router

__all__ = [
    "CONTENT_TYPE_LATEST",
    "FINISH_REASONS",
    "OUTCOMES",
    "RecentLatencies",
    "RouterMetrics",
    "is_kv_transfer_failure",
]

OUTCOMES = ("finished", "aborted", "failed", "rejected")

# How the workers word a failed KV transfer (prefill side: a push failed or the decode worker's reservation
# deadline came too close; decode side: the KV did not all arrive before the deadline).
_KV_FAILURE_MARKERS = ("KV push failed", "KV transfer deadline", "reservation deadline")

disable_created_metrics()  # no *_created series: they double the exposition for no use here

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_BYTES_BUCKETS = tuple(float(1 << n) for n in range(10, 34, 2))  # 1 KiB .. 8 GiB
_COUNT_BUCKETS = tuple(float(n) for n in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000))
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def is_kv_transfer_failure(message: str) -> bool:
    """Whether a worker's error message (or a fallback reason) says a KV transfer failed."""
    return any(marker in message for marker in _KV_FAILURE_MARKERS)


class _Spec(NamedTuple):
    """One metric: the ``RouterMetrics`` attribute holding it, its kind, name, help, labels and buckets."""

    attr: str
    kind: type[Histogram] | type[Counter] | type[Gauge]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_MODE = ("mode",)
_WORKER = ("worker", "role")

# Registered in this order (the exposition's order); docs/operations.md, "Metrics", lists them.
_METRICS = (
    _Spec(
        "ttft",
        Histogram,
        "pdserve_request_ttft_seconds",
        "Router receipt to the first token handed to the client stream (server side)",
        _MODE,
        _LATENCY_BUCKETS,
    ),
    _Spec(
        "itl",
        Histogram,
        "pdserve_request_inter_token_latency_seconds",
        "Gap between consecutive streamed chunks of a request (a chunk holds one token unless the client lags)",
        _MODE,
        _TOKEN_BUCKETS,
    ),
    _Spec(
        "tpot",
        Histogram,
        "pdserve_request_time_per_output_token_seconds",
        "Per finished request with 2+ output tokens: (e2e - ttft) / (output tokens - 1)",
        _MODE,
        _TOKEN_BUCKETS,
    ),
    _Spec("e2e", Histogram, "pdserve_request_e2e_seconds", "Router receipt to the last token", _MODE, _LATENCY_BUCKETS),
    _Spec(
        "queue",
        Histogram,
        "pdserve_request_queue_seconds",
        "Arrival at the prefilling worker to first scheduled",
        _MODE,
        _LATENCY_BUCKETS,
    ),
    _Spec(
        "prefill",
        Histogram,
        "pdserve_request_prefill_seconds",
        "First scheduled to first token sampled, on the prefilling worker",
        _MODE,
        _LATENCY_BUCKETS,
    ),
    _Spec(
        "kv_transfer",
        Histogram,
        "pdserve_kv_transfer_seconds",
        "Disaggregated requests: first token sampled on the prefill worker to all KV on the decode worker",
        buckets=_TOKEN_BUCKETS + (10.0, 30.0),
    ),
    _Spec(
        "kv_transfer_bytes",
        Histogram,
        "pdserve_kv_transfer_bytes",
        "Disaggregated requests: KV bytes moved from the prefill to the decode worker",
        buckets=_BYTES_BUCKETS,
    ),
    _Spec("requests", Counter, "pdserve_requests", "Requests by mode and outcome", ("mode", "outcome")),
    _Spec("errors", Counter, "pdserve_request_errors", "Rejected and failed requests by gRPC status code", ("code",)),
    _Spec(
        "finished",
        Counter,
        "pdserve_requests_finished",
        "Routed requests by how they ended: stop (EOS, stop token or string), length, abort, error",
        ("reason",),
    ),
    _Spec(
        "request_prompt_tokens",
        Histogram,
        "pdserve_request_prompt_tokens",
        "Prompt tokens per routed request",
        _MODE,
        _COUNT_BUCKETS,
    ),
    _Spec(
        "request_generation_tokens",
        Histogram,
        "pdserve_request_generation_tokens",
        "Output tokens per routed request",
        _MODE,
        _COUNT_BUCKETS,
    ),
    _Spec(
        "prefix_cache_queries",
        Counter,
        "pdserve_prefix_cache_queries",
        "Prompt tokens looked up in the serving worker's prefix cache (routed requests)",
        _MODE,
    ),
    _Spec(
        "prefix_cache_hits",
        Counter,
        "pdserve_prefix_cache_hits",
        "Of those, prompt tokens found cached (hit rate = hits / queries)",
        _MODE,
    ),
    _Spec("prompt_tokens", Counter, "pdserve_prompt_tokens", "Prompt tokens of ended requests", _MODE),
    _Spec("output_tokens", Counter, "pdserve_output_tokens", "Output tokens of ended requests", _MODE),
    _Spec(
        "fallbacks",
        Counter,
        "pdserve_fallbacks",
        "Disaggregated requests prefilled on their decode worker instead",
        ("reason",),
    ),
    _Spec(
        "kv_transfer_failures",
        Counter,
        "pdserve_kv_transfer_failures",
        "KV transfers that failed (a fallback or a failed request)",
    ),
    _Spec(
        "preemptions",
        Counter,
        "pdserve_preemptions",
        "Requests preempted by a worker's scheduler (counted from its steps)",
        _WORKER,
    ),
    _Spec("worker_up", Gauge, "pdserve_worker_up", "1 while the worker answers, else 0", _WORKER),
    _Spec("blocks_total", Gauge, "pdserve_worker_kv_blocks_total", "KV blocks of the worker", _WORKER),
    _Spec(
        "blocks_used",
        Gauge,
        "pdserve_worker_kv_blocks_used",
        "KV blocks held by requests (total = used + cached + free)",
        _WORKER,
    ),
    _Spec(
        "blocks_cached",
        Gauge,
        "pdserve_worker_kv_blocks_cached",
        "Unused KV blocks that hold a cached prefix (reusable)",
        _WORKER,
    ),
    _Spec("blocks_free", Gauge, "pdserve_worker_kv_blocks_free", "Unused KV blocks holding nothing cached", _WORKER),
    _Spec(
        "blocks_quarantined",
        Gauge,
        "pdserve_worker_kv_blocks_quarantined",
        "Decode: blocks of withdrawn reservations that a push may still reach (counted in used)",
        _WORKER,
    ),
    _Spec(
        "late_writes",
        Gauge,
        "pdserve_worker_kv_late_writes",
        "Decode, with --verify-kv: freed blocks found changed before their reuse (since the worker started)",
        _WORKER,
    ),
    _Spec(
        "kv_usage",
        Gauge,
        "pdserve_worker_kv_usage_ratio",
        "Fraction of the worker's KV blocks held by requests (used / total; 1 = full)",
        _WORKER,
    ),
    _Spec("running", Gauge, "pdserve_worker_running_requests", "Requests running on the worker", _WORKER),
    _Spec("waiting", Gauge, "pdserve_worker_waiting_requests", "Requests waiting on the worker", _WORKER),
    _Spec(
        "prefill_step_time",
        Histogram,
        "pdserve_worker_prefill_step_seconds",
        "Engine steps that computed prompt tokens (possibly with decode tokens too): duration",
        _WORKER,
        _STEP_BUCKETS,
    ),
    _Spec(
        "decode_step_time",
        Histogram,
        "pdserve_worker_decode_step_seconds",
        "Engine steps that computed decode tokens only: duration",
        _WORKER,
        _STEP_BUCKETS,
    ),
    _Spec("active", Gauge, "pdserve_router_active_requests", "Requests this router is serving"),
    _Spec(
        "queued",
        Gauge,
        "pdserve_router_queued_requests",
        "Requests this router serves that wait for their first token",
    ),
)


class RouterMetrics:
    """The ``pdserve_*`` metrics of one router (names, labels: docs/operations.md, "Metrics"; in ``_METRICS``)."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    kv_transfer: Histogram
    kv_transfer_bytes: Histogram
    requests: Counter
    errors: Counter
    finished: Counter
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prompt_tokens: Counter
    output_tokens: Counter
    fallbacks: Counter
    kv_transfer_failures: Counter
    preemptions: Counter
    worker_up: Gauge
    blocks_total: Gauge
    blocks_used: Gauge
    blocks_cached: Gauge
    blocks_free: Gauge
    blocks_quarantined: Gauge
    late_writes: Gauge
    kv_usage: Gauge
    running: Gauge
    waiting: Gauge
    prefill_step_time: Histogram
    decode_step_time: Histogram
    active: Gauge
    queued: Gauge

    def __init__(self, router_id: str = "router-0") -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.router_id = router_id
        for spec in _METRICS:
            extra: dict[str, Any] = {} if spec.buckets is None else {"buckets": spec.buckets}
            setattr(self, spec.attr, spec.kind(spec.name, spec.help, spec.labels, registry=r, **extra))
        Gauge("pdserve_router_info", "This router's id", ("router",), registry=r).labels(router=router_id).set(1)

        self.recent = RecentLatencies()
        self._itl_by_mode: dict[str, Histogram] = {}
        self._last_step: dict[str, float] = {}  # per worker: start time of the newest step counted
        self._created = time.time()
        self._refresh_lock = asyncio.Lock()

    # ---- called by the router ----------------------------------------------------------------------
    def token_gap(self, seconds: float, mode: str) -> None:
        """One streamed chunk after the first: the time since the previous one. The per-token hook."""
        child = self._itl_by_mode.get(mode)
        if child is None:
            child = self._itl_by_mode[mode] = self.itl.labels(mode=mode)
        child.observe(seconds)
        self.recent.add("itl", mode, seconds)

    def request_rejected(self, code: str, mode: str) -> None:
        """A request refused before it was routed; ``mode`` as requested (or the default)."""
        self.requests.labels(mode=mode, outcome="rejected").inc()
        self.errors.labels(code=code).inc()

    def request_finished(
        self, metrics: RequestMetrics, outcome: str, code: str = "", error: str = "", reason: str = ""
    ) -> None:
        """A routed request ended (once per request). Latency histograms observe ``finished`` ones only.

        ``code`` and ``error`` name the gRPC status and message of a ``failed`` request; ``reason`` is how it
        ended (``FINISH_REASONS``; by default ``stop`` for finished, ``abort`` for aborted, ``error`` for failed).
        """
        mode = metrics.mode
        self.requests.labels(mode=mode, outcome=outcome).inc()
        if reason not in FINISH_REASONS:
            reason = {"finished": "stop", "aborted": "abort"}.get(outcome, "error")
        self.finished.labels(reason=reason).inc()
        self.request_prompt_tokens.labels(mode=mode).observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.labels(mode=mode).observe(metrics.num_output_tokens)
        self.prefix_cache_queries.labels(mode=mode).inc(metrics.num_prompt_tokens)
        self.prefix_cache_hits.labels(mode=mode).inc(metrics.num_cached_tokens)
        self.prompt_tokens.labels(mode=mode).inc(metrics.num_prompt_tokens)
        self.output_tokens.labels(mode=mode).inc(metrics.num_output_tokens)
        if metrics.fallback:
            no_worker = metrics.fallback.startswith("no prefill worker")
            self.fallbacks.labels(reason="no_prefill_worker" if no_worker else "prefill_failed").inc()
        if is_kv_transfer_failure(metrics.fallback) or (outcome == "failed" and is_kv_transfer_failure(error)):
            self.kv_transfer_failures.inc()
        if code:
            self.errors.labels(code=code).inc()
        if outcome != "finished":
            return
        self.ttft.labels(mode=mode).observe(metrics.ttft_s)
        self.recent.add("ttft", mode, metrics.ttft_s)
        self.e2e.labels(mode=mode).observe(metrics.e2e_s)
        self.queue.labels(mode=mode).observe(metrics.queue_s)
        self.prefill.labels(mode=mode).observe(metrics.prefill_s)
        if metrics.num_output_tokens > 1:
            tpot = (metrics.e2e_s - metrics.ttft_s) / (metrics.num_output_tokens - 1)
            self.tpot.labels(mode=mode).observe(tpot)
        if mode == "disaggregated":
            self.kv_transfer.observe(metrics.kv_transfer_s)
            self.kv_transfer_bytes.observe(metrics.kv_transfer_bytes)

    # ---- scraping ----------------------------------------------------------------------------------
    async def refresh(self, router: Router) -> None:
        """Update the worker gauges, step histograms and preemption counts from ``router.stats``.

        Each worker step is counted once, whoever scrapes: the histograms and counters are cumulative, so
        several scrapers read the same series and none resets what another sees.
        """
        async with self._refresh_lock:
            since = min(self._last_step.values(), default=self._created)
            for w in await router.stats(steps_since=since):
                labels = {"worker": w.worker_id, "role": w.role}
                up = w.state == "serving"
                self.worker_up.labels(**labels).set(1 if up else 0)
                if not up:
                    continue
                self.blocks_total.labels(**labels).set(w.blocks_total)
                self.blocks_used.labels(**labels).set(w.blocks_used)
                self.blocks_cached.labels(**labels).set(w.blocks_cached)
                self.blocks_free.labels(**labels).set(w.blocks_free)
                self.blocks_quarantined.labels(**labels).set(w.kv_blocks_quarantined)
                self.late_writes.labels(**labels).set(w.kv_late_writes)
                self.kv_usage.labels(**labels).set(w.blocks_used / w.blocks_total if w.blocks_total else 0.0)
                self.running.labels(**labels).set(w.num_running)
                self.waiting.labels(**labels).set(w.num_waiting)
                last = self._last_step.get(w.worker_id, self._created)
                steps = [s for s in w.steps if s.started > last]  # one engine loop: steps arrive in order
                self.preemptions.labels(**labels).inc(sum(s.num_preempted for s in steps))
                if steps:
                    prefill, decode = self.prefill_step_time.labels(**labels), self.decode_step_time.labels(**labels)
                    for step in steps:
                        (prefill if step.num_prefill_tokens else decode).observe(step.duration_s)
                    self._last_step[w.worker_id] = max(s.started for s in steps)
            self.active.set(len(router.active))
            self.queued.set(router.num_queued)

    async def scrape(self, router: Router) -> bytes:
        """The Prometheus text exposition of this router's registry, refreshed first."""
        await self.refresh(router)
        return generate_latest(self.registry)


class RecentLatencies:
    """The TTFT and ITL samples of the last ``window_s`` seconds, per mode and kind (at most
    ``max_samples`` of each, the newest)."""

    PERCENTILES = (50, 90, 99)

    def __init__(self, window_s: float = 60.0, max_samples: int = 50_000) -> None:
        self.window_s = window_s
        self.max_samples = max_samples
        self._samples: dict[tuple[str, str], tuple[deque[float], deque[float]]] = {}  # (times, seconds)

    def add(self, kind: str, mode: str, seconds: float) -> None:
        """One sample: ``kind`` is "ttft" or "itl"; ``mode`` the resolved one (colocated, disaggregated)."""
        pair = self._samples.get((mode, kind))
        if pair is None:
            pair = self._samples[mode, kind] = (deque(maxlen=self.max_samples), deque(maxlen=self.max_samples))
        pair[0].append(time.monotonic())
        pair[1].append(seconds)

    def percentiles(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{mode: {"ttft"|"itl": {"n": count, "p50": ms, "p90": ms, "p99": ms}}}`` over the window."""
        cutoff = time.monotonic() - self.window_s
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (mode, kind), (times, values) in sorted(self._samples.items()):
            while times and times[0] < cutoff:
                times.popleft()
                values.popleft()
            if not values:
                continue
            ms = np.percentile(np.fromiter(values, float, len(values)) * 1000.0, self.PERCENTILES)  # as bench.metrics
            row = {"n": float(len(values)), **{f"p{p}": float(v) for p, v in zip(self.PERCENTILES, ms, strict=True)}}
            out.setdefault(mode, {})[kind] = row
        return out
