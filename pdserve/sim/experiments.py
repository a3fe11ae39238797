"""Simulator experiments: the chunk-size sweep and the DistServe-style P:D ratio search.

**Chunk sweep** (the lesson's exercise 1): run one workload at several chunk sizes and report, per
size, P99 ITL (of the ``"stream"`` requests when the workload has them, else of all requests) against
*prefill throughput* = prefill tokens computed / time spent in steps that carry prefill tokens (how
fast prompts advance while they are being prefilled; it grows with the chunk as fixed per-step cost
and the decode share are amortised). The *knee* for an ITL target is the chunk with the highest
prefill throughput whose P99 ITL still meets the target.

**P:D search**: for ``num_gpus`` GPUs (``tp`` per instance), compare colocated (all instances
chunked prefill + decode) with every split into P prefill + D decode instances, disaggregated (every
prompt prefilled remotely) and auto (the router's ``RoutingPolicy`` decides per request). Per config:
goodput (requests/s meeting every SLO, vLLM's definition) at the workload's own rate, and —
DistServe's figure of merit — the highest request rate at which at least ``attainment`` of the
requests meet the SLOs, found by doubling then bisecting the rate (same seed, so the same requests
with arrival gaps scaled by 1/rate), both divided by the number of GPUs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.bench.metrics import SweepPoint, find_knee, prefill_throughput, sweep_point
from pdserve.bench.workloads import WorkloadRequest, WorkloadSpec, build_workload
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import SimResult, simulate

__all__ = [
    "PDRow",
    "SweepPoint",
    "best_row",
    "chunk_sweep",
    "find_knee",
    "max_rate_meeting_slo",
    "pd_configs",
    "pd_search",
    "prefill_throughput",
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
    """One architecture in the P:D search."""

    name: str  # "colocated x4", "1P:3D" or "auto 1P:3D"
    mode: str
    num_prefill: int
    num_decode: int
    num_instances: int
    num_gpus: int
    goodput: float  # req/s meeting the SLOs at the workload's rate
    goodput_per_gpu: float
    slo_attainment: float
    max_rate: float | None  # highest rate with attainment >= target (None when not searched)
    max_rate_per_gpu: float | None
    p99_ttft_ms: float
    p99_tpot_ms: float
    kv_bytes_moved: int

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def pd_configs(num_instances: int, auto: bool = True) -> list[tuple[str, str, int, int]]:
    """``(name, mode, P, D)`` for colocated and every split of ``num_instances`` (P, D >= 1), each split
    disaggregated (``"1P:3D"``) and, with ``auto``, under the router's auto rule (``"auto 1P:3D"``)."""
    rows = [(f"colocated x{num_instances}", "colocated", 0, 0)]
    modes = ("disaggregated", "auto") if auto else ("disaggregated",)
    for mode in modes:
        prefix = "" if mode == "disaggregated" else "auto "
        rows += [(f"{prefix}{p}P:{num_instances - p}D", mode, p, num_instances - p) for p in range(1, num_instances)]
    return rows


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
    """Colocated vs every P:D split of ``num_gpus // tp`` instances, on ``spec``'s workload and SLOs.

    ``search_rate`` (ignored for the interference workload, which has no rate) also finds each
    config's highest SLO-meeting rate. A short trace at a high rate is a burst the system can absorb
    and then drain, which overstates the sustainable rate: each search run therefore uses
    ``max(spec.num_requests, rate * min_duration_s)`` requests. ``requests`` overrides the generated
    workload at the base rate. ``auto`` adds each split under the auto rule. ``progress`` hears a line
    as each configuration starts and ends. Raises ValueError without SLOs or with fewer than 2 instances.
    """
    if not slo_ms:
        raise ValueError("pd search: give SLOs, e.g. --slo ttft=200,tpot=50")
    n = num_gpus // tp
    if n < 2:
        raise ValueError(f"pd search: need at least 2 instances, got {num_gpus} GPUs at tp={tp}")
    cfg = config or SimConfig()
    base = list(requests) if requests is not None else build_workload(spec).requests
    rate_search = search_rate and spec.kind != "interference"
    rows = []
    configs = pd_configs(n, auto)
    started = time.monotonic()
    for i, (name, mode, p, d) in enumerate(configs):
        if progress is not None:
            progress(f"pd search [{i + 1}/{len(configs)}] {name} ... ({time.monotonic() - started:.0f} s so far)")
        result = _run(mode, p, d, n, base, cost_model, cfg, tp, spec.max_concurrency)
        m = result.metrics(dict(slo_ms))
        max_rate = None
        if rate_search:
            cache: dict[float, float] = {}

            def attain(
                rate: float, mode: str = mode, p: int = p, d: int = d, cache: dict[float, float] = cache
            ) -> float:
                if rate not in cache:
                    num = max(spec.num_requests, math.ceil(rate * min_duration_s))
                    reqs = build_workload(replace(spec, rate=rate, num_requests=num)).requests
                    res = _run(mode, p, d, n, reqs, cost_model, cfg, tp, spec.max_concurrency)
                    cache[rate] = res.metrics(dict(slo_ms)).slo_attainment or 0.0
                return cache[rate]

            start = spec.rate if math.isfinite(spec.rate) else 1.0
            max_rate = max_rate_meeting_slo(attain, attainment, start, iterations)
        rows.append(
            PDRow(
                name=name,
                mode=mode,
                num_prefill=p,
                num_decode=d,
                num_instances=n,
                num_gpus=n * tp,
                goodput=m.request_goodput or 0.0,
                goodput_per_gpu=(m.request_goodput or 0.0) / (n * tp),
                slo_attainment=m.slo_attainment or 0.0,
                max_rate=max_rate,
                max_rate_per_gpu=None if max_rate is None else max_rate / (n * tp),
                p99_ttft_ms=m.ttft.p99_ms,
                p99_tpot_ms=m.tpot.p99_ms,
                kv_bytes_moved=result.kv_bytes_moved,
            )
        )
    if progress is not None:
        progress(f"pd search: {len(configs)} configurations in {time.monotonic() - started:.0f} s")
    return rows


def best_row(rows: Sequence[PDRow]) -> PDRow:
    """The config with the highest per-GPU figure of merit (max SLO rate when searched, else goodput)."""
    return max(
        rows,
        key=lambda r: (
            r.max_rate_per_gpu if r.max_rate_per_gpu is not None else r.goodput_per_gpu,
            r.goodput_per_gpu,
        ),
    )
