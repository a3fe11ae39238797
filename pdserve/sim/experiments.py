"""Simulator experiments: the chunk-size sweep and the DistServe-style P:D ratio search.

**Chunk sweep** (the lesson's exercise 1): run one workload at several chunk sizes and report, per
size, P99 ITL (of the ``"stream"`` requests when the workload has them, else of all requests) against
*prefill throughput* = prefill tokens computed / time spent in steps that carry prefill tokens (how
fast prompts advance while they are being prefilled; it grows with the chunk as fixed per-step cost
and the decode share are amortised). The *knee* for an ITL target is the chunk with the highest
prefill throughput whose P99 ITL still meets the target.

**P:D search**: for ``num_gpus`` GPUs (``tp`` per instance), compare colocated (all instances
chunked prefill + decode, and the same with chunking the other way) with every split into P prefill +
D decode instances, disaggregated (every prompt prefilled remotely) and auto (the router's
``RoutingPolicy`` decides per request). Per config, as DistServe and Sarathi-Serve define it: a
request *attains* when its TTFT and its TPOT (``(e2e - ttft) / (output tokens - 1)``) are within their
SLOs; *goodput* is the highest request rate at which at least ``attainment`` (90 %) of the requests
attain, found by doubling then bisecting the rate (same seed, so the same requests with arrival gaps
scaled by 1/rate), divided by the number of GPUs. The attainments (all SLOs, TTFT alone, TPOT alone)
and vLLM's goodput (attaining requests per second) are also given at the workload's own rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import SimResult, simulate
from pdserve.workload.generator import WorkloadRequest, WorkloadSpec, build_workload
from pdserve.workload.metrics import SweepPoint, find_knee, prefill_throughput, sweep_point

__all__ = [
    "Architecture",
    "PDRow",
    "SweepPoint",
    "best_row",
    "chunk_sweep",
    "config_for",
    "find_knee",
    "max_rate_meeting_slo",
    "pd_architectures",
    "pd_configs",
    "pd_search",
    "prefill_throughput",
    "rank_rows",
    "search_goodput",
    "sweep_point",
]


def chunk_sweep(
    requests: Sequence[WorkloadRequest],
    cost_model: CostModel,
    chunk_sizes: Sequence[int],
    config: SimConfig | None = None,
    num_instances: int = 1,
    max_concurrency: int | None = None,
) -> list[SweepPoint]:
    """Colocated runs of ``requests`` at every chunk size (token budget = chunk + max_num_seqs)."""
    base = config or SimConfig()
    points = []
    for chunk in chunk_sizes:
        cfg = replace(base, chunk_size=chunk, enable_chunked_prefill=True, max_num_batched_tokens=None)
        result = simulate(requests, cost_model, cfg, num_instances=num_instances, max_concurrency=max_concurrency)
        points.append(sweep_point(chunk, result.records, result.steps))
    return points


@dataclass(frozen=True)
class PDRow:
    """One architecture in the P:D search (or one ``--goodput`` architecture).

    ``goodput`` is the papers' (DistServe's): the highest request rate at which at least the target
    share of requests attain every SLO, found by a rate search; ``None`` when not searched. The
    attainments and ``request_goodput`` (vLLM's: requests meeting every SLO per second) are at the
    workload's own rate."""

    name: str  # "colocated x4", "colocated x4 unchunked", "1P:3D" or "auto 1P:3D"
    mode: str
    num_prefill: int
    num_decode: int
    num_instances: int
    num_gpus: int
    chunked: bool
    goodput: float | None  # req/s: highest rate with attainment >= target (None when not searched)
    goodput_per_gpu: float | None
    slo_attainment: float
    ttft_attainment: float
    tpot_attainment: float
    request_goodput: float  # req/s meeting the SLOs at the workload's rate
    request_goodput_per_gpu: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    kv_bytes_moved: int

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Architecture:
    """One deployment to search: ``mode`` over ``num_instances`` (``num_prefill`` + ``num_decode`` when
    disaggregated or auto), chunked prefill on or off on its instances."""

    name: str
    mode: str
    num_prefill: int
    num_decode: int
    num_instances: int
    chunked: bool


def pd_configs(num_instances: int, auto: bool = True) -> list[tuple[str, str, int, int]]:
    """``(name, mode, P, D)`` for colocated and every split of ``num_instances`` (P, D >= 1), each split
    disaggregated (``"1P:3D"``) and, with ``auto``, under the router's auto rule (``"auto 1P:3D"``)."""
    rows = [(f"colocated x{num_instances}", "colocated", 0, 0)]
    modes = ("disaggregated", "auto") if auto else ("disaggregated",)
    for mode in modes:
        prefix = "" if mode == "disaggregated" else "auto "
        rows += [(f"{prefix}{p}P:{num_instances - p}D", mode, p, num_instances - p) for p in range(1, num_instances)]
    return rows


def pd_architectures(num_instances: int, chunked: bool = True, auto: bool = True) -> list[Architecture]:
    """Every ``pd_configs`` entry with the engine's chunking setting (``chunked``), plus colocated with
    chunking the other way (named ``"colocated xN unchunked"`` or ``"colocated xN chunked"``)."""
    archs = [
        Architecture(name, mode, p, d, num_instances, chunked) for name, mode, p, d in pd_configs(num_instances, auto)
    ]
    other = "chunked" if not chunked else "unchunked"
    archs.insert(1, Architecture(f"colocated x{num_instances} {other}", "colocated", 0, 0, num_instances, not chunked))
    return archs


def config_for(arch: Architecture, config: SimConfig) -> SimConfig:
    """``config`` with ``arch``'s chunking: turning it off drops the chunk cap (a whole prompt per step)."""
    if arch.chunked == config.enable_chunked_prefill:
        return config
    if arch.chunked:
        return replace(config, enable_chunked_prefill=True)
    return replace(config, enable_chunked_prefill=False, chunk_size=None)


def _run(
    mode: str,
    p: int,
    d: int,
    n: int,
    requests: Sequence[WorkloadRequest],
    cost_model: CostModel,
    config: SimConfig,
    tp: int,
    max_concurrency: int | None,
) -> SimResult:
    return simulate(
        requests,
        cost_model,
        config,
        mode=mode,
        num_instances=n,
        num_prefill=max(p, 1),
        num_decode=max(d, 1),
        tp=tp,
        max_concurrency=max_concurrency,
    )


def max_rate_meeting_slo(
    run_at: Callable[[float], float],
    attainment: float,
    start_rate: float,
    iterations: int = 6,
    max_doublings: int = 12,
) -> float:
    """Largest rate with ``run_at(rate) >= attainment``: double from ``start_rate`` until it fails (or
    halve until it holds), then bisect ``iterations`` times. 0.0 when even ``start_rate / 2**12`` fails."""
    lo, hi = 0.0, start_rate
    if run_at(hi) >= attainment:
        lo = hi
        for _ in range(max_doublings):
            hi = lo * 2
            if run_at(hi) < attainment:
                break
            lo = hi
        else:
            return lo
    else:
        for _ in range(max_doublings):
            hi_candidate = hi / 2
            if run_at(hi_candidate) >= attainment:
                lo = hi_candidate
                break
            hi = hi_candidate
        else:
            return 0.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if run_at(mid) >= attainment:
            lo = mid
        else:
            hi = mid
    return lo


def search_goodput(
    arch: Architecture,
    spec: WorkloadSpec,
    cost_model: CostModel,
    slo_ms: Mapping[str, float],
    config: SimConfig | None = None,
    tp: int = 1,
    attainment: float = 0.9,
    search_rate: bool = True,
    iterations: int = 6,
    requests: Sequence[WorkloadRequest] | None = None,
    min_duration_s: float = 0.0,
) -> PDRow:
    """``arch`` on ``spec``'s workload: the attainments at the workload's rate and, with ``search_rate``
    (ignored for the interference workload, which has no rate), its goodput: the highest rate at which
    at least ``attainment`` of the requests attain every SLO (``max_rate_meeting_slo``; the same seed at
    every rate, so the same requests with arrival gaps scaled). A short trace at a high rate is a burst
    the system absorbs and drains, which overstates the sustainable rate: each search run therefore uses
    ``max(spec.num_requests, rate * min_duration_s)`` requests. ``requests`` overrides the generated
    workload at the base rate. Raises ValueError without SLOs."""
    if not slo_ms:
        raise ValueError("goodput: give SLOs, e.g. --slo ttft=200,tpot=50")
    if not 0 < attainment <= 1:
        raise ValueError(f"goodput: the attainment target must be in (0, 1], got {attainment}")
    cfg = config_for(arch, config or SimConfig())
    base = list(requests) if requests is not None else build_workload(spec).requests
    n, p, d = arch.num_instances, arch.num_prefill, arch.num_decode
    result = _run(arch.mode, p, d, n, base, cost_model, cfg, tp, spec.max_concurrency)
    m = result.metrics(dict(slo_ms))
    goodput = None
    if search_rate and spec.kind != "interference":
        cache: dict[float, float] = {}

        def attain(rate: float) -> float:
            if rate not in cache:
                num = max(spec.num_requests, math.ceil(rate * min_duration_s))
                reqs = build_workload(replace(spec, rate=rate, num_requests=num)).requests
                res = _run(arch.mode, p, d, n, reqs, cost_model, cfg, tp, spec.max_concurrency)
                cache[rate] = res.metrics(dict(slo_ms)).slo_attainment or 0.0
            return cache[rate]

        start = spec.rate if math.isfinite(spec.rate) else 1.0
        goodput = max_rate_meeting_slo(attain, attainment, start, iterations)
    gpus = n * tp
    return PDRow(
        name=arch.name,
        mode=arch.mode,
        num_prefill=p,
        num_decode=d,
        num_instances=n,
        num_gpus=gpus,
        chunked=arch.chunked,
        goodput=goodput,
        goodput_per_gpu=None if goodput is None else goodput / gpus,
        slo_attainment=m.slo_attainment or 0.0,
        ttft_attainment=m.ttft_attainment if m.ttft_attainment is not None else 1.0,
        tpot_attainment=m.tpot_attainment if m.tpot_attainment is not None else 1.0,
        request_goodput=m.request_goodput or 0.0,
        request_goodput_per_gpu=(m.request_goodput or 0.0) / gpus,
        p99_ttft_ms=m.ttft.p99_ms,
        p99_tpot_ms=m.tpot.p99_ms,
        kv_bytes_moved=result.kv_bytes_moved,
    )


def pd_search(
    spec: WorkloadSpec,
    cost_model: CostModel,
    num_gpus: int,
    slo_ms: Mapping[str, float],
    config: SimConfig | None = None,
    tp: int = 1,
    attainment: float = 0.9,
    search_rate: bool = True,
    iterations: int = 6,
    requests: Sequence[WorkloadRequest] | None = None,
    min_duration_s: float = 0.0,
    auto: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[PDRow]:
    """Colocated (chunked and unchunked) vs every P:D split of ``num_gpus // tp`` instances, on
    ``spec``'s workload and SLOs, in ``pd_architectures`` order (``rank_rows`` sorts them); each row
    as ``search_goodput`` makes it. ``auto`` adds each split under the auto rule. ``progress`` hears a
    line as each configuration starts, and one at the end. Raises ValueError without SLOs or with fewer
    than 2 instances."""
    if not slo_ms:
        raise ValueError("pd search: give SLOs, e.g. --slo ttft=200,tpot=50")
    n = num_gpus // tp
    if n < 2:
        raise ValueError(f"pd search: need at least 2 instances, got {num_gpus} GPUs at tp={tp}")
    cfg = config or SimConfig()
    base = list(requests) if requests is not None else build_workload(spec).requests
    archs = pd_architectures(n, cfg.enable_chunked_prefill, auto)
    rows = []
    started = time.monotonic()
    for i, arch in enumerate(archs):
        if progress is not None:
            progress(f"pd search [{i + 1}/{len(archs)}] {arch.name} ... ({time.monotonic() - started:.0f} s so far)")
        rows.append(
            search_goodput(
                arch, spec, cost_model, slo_ms, cfg, tp, attainment, search_rate, iterations, base, min_duration_s
            )
        )
    if progress is not None:
        progress(f"pd search: {len(archs)} configurations in {time.monotonic() - started:.0f} s")
    return rows


def _merit(row: PDRow) -> tuple[float, float]:
    return (
        row.goodput_per_gpu if row.goodput_per_gpu is not None else row.request_goodput_per_gpu,
        row.request_goodput_per_gpu,
    )


def rank_rows(rows: Sequence[PDRow]) -> list[PDRow]:
    """Best first: by goodput per GPU (the papers' figure; vLLM's goodput per GPU at the workload's rate
    when not searched), ties by vLLM's goodput per GPU; stable otherwise."""
    return sorted(rows, key=_merit, reverse=True)


def best_row(rows: Sequence[PDRow]) -> PDRow:
    """The config with the highest per-GPU figure of merit (``rank_rows``' first)."""
    return rank_rows(rows)[0]
