"""Serving metrics from client-side per-request records, as vLLM's ``bench serve`` defines them.

Definitions (all latencies from the client's clock; one record per request):

- **TTFT**: arrival time of the first output token minus the send time.
- **E2E latency** (vLLM's "E2EL"): arrival time of the last output token minus the send time.
- **TPOT**: ``(e2e - ttft) / (output_tokens - 1)``; only requests with more than one output token
  enter the TPOT statistics. For goodput, a request with one output token counts as TPOT 0.
- **ITL**: every gap between consecutive token arrivals of a request, pooled over all requests.
- Statistics: mean, population std (``numpy.std``), p50/p90/p99 with numpy's default (linear)
  percentile interpolation, and max; reported in milliseconds. An empty sample gives zeros (vLLM
  computes ``np.mean(x or 0)``).
- **Duration**: first send to last token arrival over all records, unless given explicitly.
- **Throughput**: completed requests, output tokens and prompt + output tokens, each per second of
  duration. Only successful requests count.
- **Goodput** (DistServe, as vLLM computes it): successful requests whose TTFT, TPOT and E2E meet every
  given SLO (``metric <= slo``), per second of duration. SLOs are given in milliseconds as
  ``"ttft=200,tpot=50"`` (keys ``ttft``, ``tpot``, ``e2el``).
- **SLO attainment** (DistServe, Sarathi-Serve): the share of *all* requests (a failed one misses)
  meeting every given SLO (``slo_attainment``), and per SLO the share meeting that one alone
  (``ttft_attainment``, ``tpot_attainment``, ``e2el_attainment``). The papers' goodput, the highest
  request rate at which at least 90 % of requests attain, needs a rate search: see ``pdserve.sim.experiments``.

A record with ``ok=True`` but no token timestamps cannot have a TTFT; it counts as failed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from pdserve.messages import StepStats

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds on one clock (wall or virtual).

    ``token_times`` holds the arrival time of every output token, in order. When a streamed message
    carries several tokens, either repeat its time once per token or pass ``num_output_tokens``
    explicitly (ITL then has one gap per message, as in vLLM). ``label`` tags a request class
    (e.g. ``"stream"``/``"long"`` in the interference workload); ``meta`` carries JSON-serialisable
    extras (which worker served it, KV bytes moved, ...).
    """

    request_id: str
    send_time: float
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_output_tokens: int | None = None  # None = len(token_times)
    ok: bool = True
    error: str | None = None
    end_time: float | None = None  # when the response ended (last token or the error); None = last token
    label: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times", tuple(float(t) for t in self.token_times))
        if self.num_output_tokens is None:
            object.__setattr__(self, "num_output_tokens", len(self.token_times))
        if self.num_prompt_tokens < 0 or self.num_output_tokens < 0:  # type: ignore[operator]
            raise ValueError(f"{self.request_id}: token counts must be >= 0")
        if any(b < a for a, b in pairwise(self.token_times)):
            raise ValueError(f"{self.request_id}: token_times must be non-decreasing")

    @property
    def output_tokens(self) -> int:
        return int(self.num_output_tokens)  # type: ignore[arg-type]

    @property
    def succeeded(self) -> bool:
        """ok and at least one token arrived."""
        return self.ok and bool(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.send_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """``(e2e - ttft) / (n - 1)`` for n > 1 output tokens, else None."""
        if not self.token_times or self.output_tokens <= 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in pairwise(t)]

    @property
    def last_time(self) -> float:
        """The latest time this record covers (end_time, last token, or the send time)."""
        times = [self.send_time, *self.token_times[-1:]]
        if self.end_time is not None:
            times.append(self.end_time)
        return max(times)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "send_time": self.send_time,
            "token_times": list(self.token_times),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.output_tokens,
            "ok": self.ok,
            "error": self.error,
            "end_time": self.end_time,
            "label": self.label,
            "meta": dict(self.meta),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RequestRecord:
        return RequestRecord(
            request_id=str(d["request_id"]),
            send_time=float(d["send_time"]),
            token_times=tuple(d.get("token_times", ())),
            num_prompt_tokens=int(d["num_prompt_tokens"]),
            num_output_tokens=d.get("num_output_tokens"),
            ok=bool(d.get("ok", True)),
            error=d.get("error"),
            end_time=d.get("end_time"),
            label=d.get("label", ""),
            meta=dict(d.get("meta") or {}),
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of a sample with numpy's default (linear) interpolation, as every
    statistic here; nan for an empty sample."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency sample, in milliseconds; ``count`` is the sample size."""

    count: int
    mean_ms: float
    std_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @staticmethod
    def of(values_s: Sequence[float]) -> LatencyStats:
        """Stats of a sample given in seconds (numpy defaults: population std, linear percentiles)."""
        x = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        return LatencyStats(
            len(values_s),
            float(np.mean(x)),
            float(np.std(x)),
            float(p50),
            float(p90),
            float(p99),
            float(np.max(x)),
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean_ms": self.mean_ms,
            "std_ms": self.std_ms,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "max_ms": self.max_ms,
        }


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Everything ``compute_metrics`` derives from one run's records."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    slo_ms: Mapping[str, float] = field(default_factory=dict)
    good_completed: int | None = None  # None when no SLO was given
    request_goodput: float | None = None  # good requests / s; None when no SLO was given
    attained: Mapping[str, int] = field(default_factory=dict)  # per SLO key: requests meeting that SLO

    def attainment_of(self, key: str) -> float | None:
        """Share of all requests meeting the ``key`` SLO (``ttft``, ``tpot``, ``e2el``); None when not given."""
        if key not in self.attained:
            return None
        total = self.completed + self.failed
        return self.attained[key] / total if total else 0.0

    @property
    def ttft_attainment(self) -> float | None:
        return self.attainment_of("ttft")

    @property
    def tpot_attainment(self) -> float | None:
        return self.attainment_of("tpot")

    @property
    def slo_attainment(self) -> float | None:
        """Fraction of all requests (failed ones count as missing) that met every SLO."""
        if self.good_completed is None:
            return None
        total = self.completed + self.failed
        return self.good_completed / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "duration_s": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "ttft": self.ttft.to_dict(),
            "tpot": self.tpot.to_dict(),
            "itl": self.itl.to_dict(),
            "e2el": self.e2el.to_dict(),
            "slo_ms": dict(self.slo_ms),
            "good_completed": self.good_completed,
            "request_goodput": self.request_goodput,
            "slo_attainment": self.slo_attainment,
            "ttft_attainment": self.ttft_attainment,
            "tpot_attainment": self.tpot_attainment,
            "e2el_attainment": self.attainment_of("e2el"),
        }


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=200,tpot=50"`` → ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds). Empty/None → ``{}``.

    Raises ValueError on unknown keys, malformed pairs, or non-positive values.
    """
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo: expected key=milliseconds with key in {', '.join(SLO_KEYS)}, got {part!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"slo: {key} must be a number of milliseconds, got {value!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"slo: {key} must be a positive finite number of milliseconds, got {value!r}")
        out[key] = ms
    return out


def meets_slo(record: RequestRecord, slo_ms: Mapping[str, float]) -> bool:
    """True when a successful record meets every SLO (``metric <= slo``); TPOT of a 1-token reply is 0."""
    if not record.succeeded:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(values[k] * 1000.0 <= v for k, v in slo_ms.items())  # type: ignore[operator]


def benchmark_duration(records: Iterable[RequestRecord]) -> float:
    """First send to the last time any record covers (seconds); 0 for no records."""
    records = list(records)
    if not records:
        return 0.0
    return max(r.last_time for r in records) - min(r.send_time for r in records)


def compute_metrics(
    records: Sequence[RequestRecord],
    slo_ms: Mapping[str, float] | str | None = None,
    duration_s: float | None = None,
) -> BenchmarkMetrics:
    """Compute every metric of one run. ``duration_s`` overrides the first-send-to-last-token span.

    Raises ValueError for an unknown SLO key.
    """
    slo = parse_slo(slo_ms) if isinstance(slo_ms, str) or slo_ms is None else dict(slo_ms)
    for key in slo:
        if key not in SLO_KEYS:
            raise ValueError(f"slo: unknown key {key!r} (known: {', '.join(SLO_KEYS)})")
    ok = [r for r in records if r.succeeded]
    duration = benchmark_duration(records) if duration_s is None else float(duration_s)
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2els = [r.e2e for r in ok]
    itls = [gap for r in ok for gap in r.itls]
    total_in = sum(r.num_prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    good = sum(1 for r in ok if meets_slo(r, slo)) if slo else None
    attained = {key: sum(1 for r in ok if meets_slo(r, {key: ms})) for key, ms in slo.items()}
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_s=duration,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out),
        ttft=LatencyStats.of(ttfts),  # type: ignore[arg-type]
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(itls),
        e2el=LatencyStats.of(e2els),  # type: ignore[arg-type]
        slo_ms=slo,
        good_completed=good,
        request_goodput=None if good is None else per_s(good),
        attained=attained,
    )


def itl_values(records: Iterable[RequestRecord], label: str | None = None) -> list[float]:
    """Every ITL gap (seconds) of successful records, optionally of one label only."""
    return [g for r in records if r.succeeded and (label is None or r.label == label) for g in r.itls]


def ttft_values(records: Iterable[RequestRecord], label: str | None = None) -> list[float]:
    """TTFT (seconds) of every successful record, optionally of one label only."""
    return [r.ttft for r in records if r.succeeded and (label is None or r.label == label)]  # type: ignore[misc]


# ---- chunk sweeps ---------------------------------------------------------------------


def prefill_throughput(steps: Iterable[StepStats]) -> float:
    """Prefill tokens per second of the steps that carry prefill tokens (0 when none do)."""
    tokens = busy = 0.0
    for s in steps:
        if s.num_prefill_tokens > 0:
            tokens += s.num_prefill_tokens
            busy += s.duration_s
    return tokens / busy if busy > 0 else 0.0


class SweepPoint(NamedTuple):
    """One chunk size's outcome in a chunk-size sweep (simulated or measured). See ``sweep_point``."""

    chunk_size: int
    p99_itl_ms: float  # P99 of the stream ITLs during long prefills (all ITLs when unlabelled)
    max_itl_ms: float
    p99_itl_all_ms: float  # P99 over every stream ITL of the run
    prefill_throughput_tok_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


def itls_during_prefill(token_times: Iterable[Sequence[float]], windows: Sequence[tuple[float, float]]) -> list[float]:
    """Gaps between consecutive token times of each stream whose later token lands in a window
    ``(arrival, first token]`` of a long prompt: the stalls its prefill causes. The worst one is the
    figure the chunked-prefill benchmarks report (``max(..., default=0.0)``)."""
    return [b - a for times in token_times for a, b in pairwise(times) if any(lo < b <= hi for lo, hi in windows)]


def interference_itls(records: Sequence[RequestRecord]) -> list[float] | None:
    """``itls_during_prefill`` of the successful ``"stream"`` records, the windows running from each
    ``"long"`` record's send time to its first token. None when the records carry no such labels."""
    windows = [(r.send_time, r.token_times[0]) for r in records if r.label == "long" and r.token_times]
    streams = [r for r in records if r.label == "stream" and r.succeeded]
    if not windows or not streams:
        return None
    return itls_during_prefill((r.token_times for r in streams), windows)


def sweep_point(chunk_size: int, records: Sequence[RequestRecord], steps: Iterable[StepStats]) -> SweepPoint:
    """Summarise one run of a chunk sweep.

    ``p99_itl_ms`` is the P99 of ``interference_itls`` when the run has ``"stream"``/``"long"``
    labels (a P99 over the whole run would dilute a stall that hits only a few steps below 1% of
    the gaps, so a prefill done in one giant step could look better than a chunked one), else the
    P99 of all ITLs; ``p99_itl_all_ms`` is always over the whole run. TTFT is of the ``"long"``
    records (all records when unlabelled); prefill throughput is ``prefill_throughput(steps)``.
    """
    streams = [r for r in records if r.label == "stream"] or list(records)
    all_itl = compute_metrics(streams).itl
    window = interference_itls(records)
    focus = LatencyStats.of(window) if window is not None else all_itl
    ttft = compute_metrics([r for r in records if r.label == "long"] or list(records)).ttft
    return SweepPoint(
        chunk_size,
        focus.p99_ms,
        all_itl.max_ms,
        all_itl.p99_ms,
        prefill_throughput(steps),
        ttft.mean_ms,
        ttft.p99_ms,
    )


def find_knee(points: Sequence[SweepPoint], itl_target_ms: float) -> SweepPoint | None:
    """The point with the highest prefill throughput whose P99 ITL meets the target (None if none does)."""
    ok = [p for p in points if p.p99_itl_ms <= itl_target_ms]
    return max(ok, key=lambda p: (p.prefill_throughput_tok_s, p.chunk_size)) if ok else None


def parse_sweep(text: str) -> list[int]:
    """``"chunk=128,256"`` → ``[128, 256]``. Raises ValueError otherwise."""
    key, sep, values = text.partition("=")
    if key.strip() != "chunk" or not sep:
        raise ValueError(f"--sweep: expected chunk=N,N,..., got {text!r}")
    try:
        sizes = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep: chunk sizes must be integers, got {values!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--sweep: give positive chunk sizes, got {values!r}")
    return sizes
