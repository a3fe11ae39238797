"""Simulator experiments: the chunk-size sweep and the DistServe-style P:D ratio search.

**Chunk sweep** (the lesson's exercise 1): run one workload at several chunk sizes and report, per
size, P99 ITL (of the ``"stream"`` requests when the workload has them, else of all requests) against
*prefill throughput* = prefill tokens computed / time spent in steps that carry prefill tokens (how
fast prompts advance while they are being prefilled; it grows with the chunk as fixed per-step cost
and the decode share are amortised). The *knee* for an ITL target is the chunk with the highest
prefill throughput whose P99 ITL still meets the target.

**Goodput** (DistServe's and Sarathi-Serve's definitions): a request *attains* when its TTFT and its TPOT
(``(e2e - ttft) / (output tokens - 1)``) are within their SLOs; *goodput* is the highest request rate at
which at least ``attainment`` (90 %) of the requests attain, found by doubling then bisecting the rate (the
same requests of one seed with arrival gaps scaled by 1/rate), per GPU. With several seeds (other
workload draws), a configuration's goodput is their mean and its spread their range.

**P:D search** (``pd_search``) over deployments of at most ``num_gpus`` GPUs, in DistServe's way: first
every *instance shape* alone, each at its rate limit (``shape_goodputs``): a prefill instance of every
TP x PP and chunking (whole prompts, or chunks of each searched budget) under the TTFT SLO; a decode
instance of every TP under the TPOT SLO; a colocated instance of every TP and chunk budget, and with
whole prompts under the prefill-first policy (vLLM v0's), under both; each over a quarter of the minimum
duration of the deployments' runs and two bisections less. A family of shapes (a role with one pipeline
depth and one chunking) tries its TP degrees in ascending order and stops at the first that gives less
goodput per GPU than the one before. Replicas of a shape add their rates, so every disaggregated placement of at most
``num_gpus`` GPUs (P prefill and D decode instances of any two shapes) is predicted to sustain
``min(P * prefill goodput, D * decode goodput)``. Then the best predicted placements, the best colocated
shapes (one instance: replicas add their rates) and the best placement under the router's auto rule
are simulated whole, each with the rate search for every seed: those are the ranked rows, with spread.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import SimResult, count_speed, simulate, speed_tally
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
class Architecture:
    """One deployment: ``mode`` over ``num_instances`` (``num_prefill`` + ``num_decode`` when disaggregated or
    auto), each role's parallelism, and its engines' settings where they differ from the base config's:
    ``chunked`` (chunked prefill on the colocated and decode instances), ``budget`` (their token budget),
    ``scheduling`` (their policy), ``prefill_chunked`` and ``prefill_budget`` (the prefill instances')."""

    name: str
    mode: str
    num_prefill: int
    num_decode: int
    num_instances: int
    chunked: bool
    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    budget: int | None = None
    scheduling: str | None = None
    prefill_chunked: bool | None = None
    prefill_budget: int | None = None

    @property
    def num_gpus(self) -> int:
        if self.mode == "colocated":
            return self.num_instances * self.decode_tp
        return self.num_prefill * self.prefill_tp * self.prefill_pp + self.num_decode * self.decode_tp


@dataclass(frozen=True)
class PDRow:
    """One architecture's goodput (a P:D search row, or one ``--goodput`` architecture).

    ``goodput`` is the papers' (DistServe's): the highest request rate at which at least the target share of
    requests attain every SLO, found by a rate search, the mean over ``num_seeds`` workload draws (their range:
    ``goodput_min``, ``goodput_max``); ``None`` when not searched. ``predicted_goodput``: what the instance
    shapes alone predicted (a P:D search's disaggregated rows). The attainments and ``request_goodput``
    (vLLM's: requests meeting every SLO per second) are at the workload's own rate, first seed."""

    name: str  # "colocated x4 tp1 chunk 512", "2P(tp2):1D(tp1) whole prompts", "auto 1P:3D"
    mode: str
    num_prefill: int
    num_decode: int
    num_instances: int
    num_gpus: int
    chunked: bool
    goodput: float | None
    goodput_per_gpu: float | None
    slo_attainment: float
    ttft_attainment: float
    tpot_attainment: float
    request_goodput: float
    request_goodput_per_gpu: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    kv_bytes_moved: int
    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    num_seeds: int = 1
    goodput_min: float | None = None
    goodput_max: float | None = None
    predicted_goodput: float | None = None

    @property
    def spread_per_gpu(self) -> tuple[float, float] | None:
        """``(lowest, highest)`` goodput per GPU over the seeds, None when not searched."""
        if self.goodput_min is None or self.goodput_max is None:
            return None
        return self.goodput_min / self.num_gpus, self.goodput_max / self.num_gpus

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


CostModels = Callable[[int, int], CostModel]
"""``(tp, pp) -> CostModel``: the cost model of an instance of that parallelism (``Simulation.cost_model_for``)."""


def _cost_models(cost: CostModel | CostModels) -> CostModels:
    """A factory from a cost model (every shape priced alike: its own) or a factory."""
    if hasattr(cost, "step_time"):
        model = cast("CostModel", cost)
        return lambda tp, pp: model
    return cast("CostModels", cost)


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


def _engine_settings(config: SimConfig, chunked: bool, budget: int | None, scheduling: str | None) -> SimConfig:
    values: dict[str, Any] = {}
    if chunked != config.enable_chunked_prefill:
        values["enable_chunked_prefill"] = chunked
        if not chunked:
            values["chunk_size"] = None
    if budget is not None:
        values.update(max_num_batched_tokens=budget, chunk_size=None)
    if scheduling is not None and scheduling != config.scheduling:
        values["scheduling"] = scheduling
    return replace(config, **values) if values else config


def config_for(arch: Architecture, config: SimConfig) -> SimConfig:
    """``config`` with ``arch``'s colocated or decode instances' settings: turning chunking off drops the chunk
    cap (a whole prompt per step); a budget replaces the config's."""
    return _engine_settings(config, arch.chunked, arch.budget, arch.scheduling)


def prefill_config_for(arch: Architecture, config: SimConfig) -> SimConfig | None:
    """The prefill instances' settings when they differ from ``config_for``'s, else None."""
    if arch.prefill_chunked is None and arch.prefill_budget is None:
        return None
    chunked = arch.chunked if arch.prefill_chunked is None else arch.prefill_chunked
    return _engine_settings(config, chunked, arch.prefill_budget, None)


def _run(
    arch: Architecture,
    requests: Sequence[WorkloadRequest],
    cost_models: CostModels,
    config: SimConfig,
    max_concurrency: int | None,
) -> SimResult:
    return simulate(
        requests,
        cost_models(arch.decode_tp, 1),
        config_for(arch, config),
        mode=arch.mode,
        num_instances=arch.num_instances,
        num_prefill=max(arch.num_prefill, 1),
        num_decode=max(arch.num_decode, 1),
        tp=arch.decode_tp,
        max_concurrency=max_concurrency,
        prefill_cost_model=cost_models(arch.prefill_tp, arch.prefill_pp) if arch.mode != "colocated" else None,
        prefill_tp=arch.prefill_tp,
        prefill_pp=arch.prefill_pp if arch.mode != "colocated" else 1,
        prefill_config=prefill_config_for(arch, config),
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


def refine_rate(run_at: Callable[[float], float], attainment: float, guess: float, iterations: int = 5) -> float:
    """``max_rate_meeting_slo`` near a known answer (another seed's): bisect ``[0.8 * guess, 1.25 * guess]``
    ``iterations`` times when the answer lies there, else search from the bracket's end."""
    if guess <= 0:
        return max_rate_meeting_slo(run_at, attainment, 1.0, iterations)
    lo, hi = 0.8 * guess, 1.25 * guess
    if run_at(lo) < attainment:
        return max_rate_meeting_slo(run_at, attainment, lo / 2, iterations)
    if run_at(hi) >= attainment:
        return max_rate_meeting_slo(run_at, attainment, hi, iterations)
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
    cost_model: CostModel | CostModels,
    slo_ms: Mapping[str, float],
    config: SimConfig | None = None,
    tp: int | None = None,
    attainment: float = 0.9,
    search_rate: bool = True,
    iterations: int = 6,
    requests: Sequence[WorkloadRequest] | None = None,
    min_duration_s: float = 0.0,
    seeds: Sequence[int] | None = None,
    start_rate: float | None = None,
) -> PDRow:
    """``arch`` on ``spec``'s workload: the attainments at the workload's rate and, with ``search_rate``
    (ignored for the interference workload, which has no rate), its goodput for each of ``seeds`` (default:
    the spec's seed alone): the highest rate at which at least ``attainment`` of the requests attain every
    SLO (``max_rate_meeting_slo`` from ``start_rate``, default the spec's rate; the same requests of a seed at
    every rate, arrival gaps scaled). A short trace at a high rate is a burst the system absorbs and drains,
    which overstates the sustainable rate: each search run therefore uses ``max(spec.num_requests, rate *
    min_duration_s)`` requests. ``requests`` overrides the generated workload at the base rate.
    ``cost_model`` is one model for every instance or a ``(tp, pp) -> CostModel`` factory. ``tp`` (when
    given) sets the architecture's TP for every role. Raises ValueError without SLOs."""
    if not slo_ms:
        raise ValueError("goodput: give SLOs, e.g. --slo ttft=200,tpot=50")
    if not 0 < attainment <= 1:
        raise ValueError(f"goodput: the attainment target must be in (0, 1], got {attainment}")
    if tp is not None:
        arch = replace(arch, prefill_tp=tp, decode_tp=tp)
    costs = _cost_models(cost_model)
    cfg = config or SimConfig()
    base = list(requests) if requests is not None else build_workload(spec).requests
    result = _run(arch, base, costs, cfg, spec.max_concurrency)
    m = result.metrics(dict(slo_ms))
    goodputs: list[float] = []
    if search_rate and spec.kind != "interference":
        start = start_rate or (spec.rate if math.isfinite(spec.rate) else 1.0)
        for seed in seeds if seeds is not None else (spec.seed,):
            cache: dict[float, float] = {}

            def attain(rate: float, seed: int = seed, cache: dict[float, float] = cache) -> float:
                if rate not in cache:
                    num = max(spec.num_requests, math.ceil(rate * min_duration_s))
                    reqs = build_workload(replace(spec, rate=rate, num_requests=num, seed=seed)).requests
                    res = _run(arch, reqs, costs, cfg, spec.max_concurrency)
                    cache[rate] = res.metrics(dict(slo_ms)).slo_attainment or 0.0
                return cache[rate]

            if goodputs:  # later seeds: near the first's answer
                goodputs.append(refine_rate(attain, attainment, goodputs[0], max(iterations - 1, 3)))
            else:
                goodputs.append(max_rate_meeting_slo(attain, attainment, start, iterations))
    goodput = sum(goodputs) / len(goodputs) if goodputs else None
    gpus = result.num_gpus
    return PDRow(
        name=arch.name,
        mode=arch.mode,
        num_prefill=arch.num_prefill,
        num_decode=arch.num_decode,
        num_instances=arch.num_instances,
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
        prefill_tp=arch.prefill_tp,
        prefill_pp=arch.prefill_pp,
        decode_tp=arch.decode_tp,
        num_seeds=len(goodputs),
        goodput_min=min(goodputs) if goodputs else None,
        goodput_max=max(goodputs) if goodputs else None,
    )


# ---- the P:D search -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchSpace:
    """What ``pd_search`` tries: the TP degrees (of every role), the prefill pipeline depths, the token
    budgets (chunk sizes) of chunked instances, the seeds of the verified rows, how many of the best predicted
    disaggregated placements and colocated shapes to verify, and whether auto variants are verified too."""

    tps: tuple[int, ...] = (1, 2, 4, 8)
    prefill_pps: tuple[int, ...] = (1, 2)
    budgets: tuple[int, ...] = (512, 2048)
    seeds: tuple[int, ...] = (0, 1, 2)
    verify_disaggregated: int = 3
    verify_colocated: int = 2
    auto: bool = True

    def __post_init__(self) -> None:
        if not self.tps or not self.seeds or not self.budgets or not self.prefill_pps:
            raise ValueError("pd search: give at least one TP degree, pipeline depth, budget and seed")
        if min(self.tps + self.prefill_pps + self.budgets) < 1:
            raise ValueError("pd search: TP degrees, pipeline depths and budgets must be >= 1")


@dataclass(frozen=True)
class ShapeGoodput:
    """One instance shape alone at its rate limit (``shape_goodputs``): req/s one instance sustains."""

    role: str  # "prefill", "decode" or "colocated"
    tp: int
    pp: int
    label: str  # its engine settings: "whole prompts", "chunk 512", "chunk 512 prefill-first", ...
    goodput: float
    arch: Architecture

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


def _feasible(costs: CostModels, tp: int, pp: int) -> bool:
    try:
        costs(tp, pp).kv_capacity_tokens()
    except ValueError:
        return False
    return True


class _Task(NamedTuple):
    """One configuration to rate-search: what ``search_goodput`` needs beyond the search's shared context."""

    label: str
    arch: Architecture
    spec: WorkloadSpec
    slo_ms: dict[str, float]
    seeds: tuple[int, ...] | None = None
    start_rate: float | None = None


# the search's shared context (cost models, config, attainment, iterations, minimum duration), set before the
# tasks run: a forked worker inherits it (the cost models need not pickle)
_CONTEXT: tuple[CostModels, SimConfig, float, int, float] | None = None


def _run_task(task: _Task) -> tuple[PDRow, tuple[int, int, float]]:
    assert _CONTEXT is not None
    costs, config, attainment, iterations, min_duration_s = _CONTEXT
    with speed_tally() as tally:
        row = search_goodput(
            task.arch, task.spec, costs, task.slo_ms, config, None, attainment, True, iterations, None,
            min_duration_s, task.seeds, task.start_rate,
        )  # fmt: skip
    return row, (tally.num_runs, tally.num_steps, tally.wall_s)


def _run_tasks(
    tasks: Sequence[_Task],
    context: tuple[CostModels, SimConfig, float, int, float],
    jobs: int,
    progress: Callable[[str], None] | None,
) -> list[PDRow]:
    """Every task's row, in order: in this process, or on ``jobs`` forked worker processes."""
    global _CONTEXT
    _CONTEXT = context
    try:
        if jobs <= 1 or len(tasks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            rows = []
            for task in tasks:
                if progress is not None:
                    progress(task.label)
                rows.append(_run_task(task)[0])
            return rows
        out: list[PDRow | None] = [None] * len(tasks)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
            for future in as_completed(futures):
                i = futures[future]
                row, speed = future.result()
                count_speed(*speed)
                out[i] = row
                if progress is not None:
                    progress(f"{tasks[i].label}: done")
        return [row for row in out if row is not None]
    finally:
        _CONTEXT = None


def shape_goodputs(
    spec: WorkloadSpec,
    costs: CostModels,
    num_gpus: int,
    slo_ms: Mapping[str, float],
    config: SimConfig,
    space: SearchSpace,
    attainment: float,
    iterations: int,
    min_duration_s: float,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> list[ShapeGoodput]:
    """Every instance shape of at most ``num_gpus`` GPUs (less one for a disaggregated role, which needs a
    partner) at its rate limit, first seed: prefill instances under the TTFT SLO (replies of one token: a
    prefill instance's work ends at the first token) next to ample decode instances; decode instances under
    the TPOT SLO next to ample prefill instances; colocated instances under every SLO. Shapes whose weights do
    not fit, or whose TP does not divide the model, are left out."""
    ttft = {k: v for k, v in slo_ms.items() if k == "ttft"} or dict(slo_ms)
    tpot = {k: v for k, v in slo_ms.items() if k in ("tpot", "itl")} or dict(slo_ms)
    budget = config.token_budget(0)
    budgets = tuple(dict.fromkeys((budget, *space.budgets)))
    prefill_variants = [("whole prompts", False, None)] + [(f"chunk {b}", True, b) for b in budgets]
    colocated_variants: list[tuple[str, bool, int | None, str]] = [(f"chunk {b}", True, b, "mixed") for b in budgets]
    colocated_variants.append(("prefill-first", False, None, "prefill-first"))
    fit = sorted(tp for tp in space.tps if tp <= num_gpus and _feasible(costs, tp, 1))
    helper_tp = max(fit, default=1)  # the ample other side: its largest shape
    one_token = replace(spec, output_len_mean=1, output_len_sigma=0.0, output_len_max=1)

    def shape(family: tuple[str, int, str], tp: int) -> tuple[ShapeGoodput, _Task] | None:
        """The shape of ``family`` (role, pp, label) at ``tp`` and its task, None when it does not fit."""
        role, pp, label = family
        if role == "prefill":
            if tp * pp > num_gpus - 1 or not _feasible(costs, tp, pp):
                return None
            chunked, b = next((c, x) for name, c, x in prefill_variants if name == label)
            arch = Architecture(
                f"1P(tp{tp}pp{pp}):4D {label}", "disaggregated", 1, 4, 5, True, tp, pp, helper_tp,
                prefill_chunked=chunked, prefill_budget=b,
            )  # fmt: skip
            task = _Task(f"pd search: prefill instance tp{tp} pp{pp}, {label}", arch, one_token, ttft)
        elif role == "decode":
            if tp > num_gpus - 1:
                return None
            arch = Architecture(f"8P:1D(tp{tp})", "disaggregated", 8, 1, 9, True, helper_tp, 1, tp)
            task = _Task(f"pd search: decode instance tp{tp}", arch, spec, tpot)
        else:
            chunked, b, policy = next((c, x, pol) for name, c, x, pol in colocated_variants if name == label)
            arch = Architecture(f"colocated x1 tp{tp} {label}", "colocated", 0, 0, 1, chunked, tp, 1, tp, b, policy)
            task = _Task(f"pd search: colocated instance tp{tp}, {label}", arch, spec, dict(slo_ms))
        return ShapeGoodput(role, tp, pp, label, 0.0, arch), task

    # every family of shapes grows its TP degree while that raises its goodput per GPU (past the point where
    # it stops, the extra GPUs only add communication: a larger TP is then not tried)
    families = [("prefill", pp, label) for pp in space.prefill_pps for label, _, _ in prefill_variants]
    families += [("decode", 1, "")] + [("colocated", 1, label) for label, *_ in colocated_variants]
    frontier = {family: list(fit) for family in families}
    best: dict[tuple[str, int, str], float] = {}
    out: list[ShapeGoodput] = []
    while frontier:
        batch: list[tuple[tuple[str, int, str], ShapeGoodput, _Task]] = []
        for family, tps in list(frontier.items()):
            while tps:
                candidate = shape(family, tps.pop(0))
                if candidate is not None:
                    batch.append((family, *candidate))
                    break
            if not tps:
                del frontier[family]
        if not batch:
            break
        context = (costs, config, attainment, iterations, min_duration_s)
        rows = _run_tasks([task for _, _, task in batch], context, jobs, progress)
        for (family, tried, _), row in zip(batch, rows, strict=True):
            result = replace(tried, goodput=row.goodput or 0.0)
            out.append(result)
            per_gpu = result.goodput / result.num_gpus
            if per_gpu <= best.get(family, -1.0):
                frontier.pop(family, None)
            best[family] = max(per_gpu, best.get(family, -1.0))
    return out


@dataclass(frozen=True)
class Placement:
    """A disaggregated placement composed of two shapes and its predicted goodput (req/s)."""

    prefill: ShapeGoodput
    decode: ShapeGoodput
    num_prefill: int
    num_decode: int
    predicted: float

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill.num_gpus + self.num_decode * self.decode.num_gpus

    def architecture(self, mode: str = "disaggregated") -> Architecture:
        p, d = self.prefill, self.decode
        shape = f"{self.num_prefill}P(tp{p.tp}" + (f"pp{p.pp}" if p.pp > 1 else "") + f"):{self.num_decode}D(tp{d.tp})"
        name = ("auto " if mode == "auto" else "") + f"{shape} {p.label}"
        return Architecture(
            name, mode, self.num_prefill, self.num_decode, self.num_prefill + self.num_decode, True,
            p.tp, p.pp, d.tp, prefill_chunked=p.arch.prefill_chunked, prefill_budget=p.arch.prefill_budget,
        )  # fmt: skip


def placements(shapes: Sequence[ShapeGoodput], num_gpus: int) -> list[Placement]:
    """Every disaggregated placement of at most ``num_gpus`` GPUs (P prefill instances of one shape, D decode
    instances of one shape, P, D >= 1), predicted ``min(P * prefill goodput, D * decode goodput)``, best per
    GPU first (ties: fewer GPUs)."""
    prefills = [s for s in shapes if s.role == "prefill" and s.goodput > 0]
    decodes = [s for s in shapes if s.role == "decode" and s.goodput > 0]
    out = []
    for p in prefills:
        for d in decodes:
            for n_p in range(1, (num_gpus - d.num_gpus) // p.num_gpus + 1):
                for n_d in range(1, (num_gpus - n_p * p.num_gpus) // d.num_gpus + 1):
                    out.append(Placement(p, d, n_p, n_d, min(n_p * p.goodput, n_d * d.goodput)))
    return sorted(out, key=lambda x: (-x.predicted / x.num_gpus, x.num_gpus))


def pd_search(
    spec: WorkloadSpec,
    cost_model: CostModel | CostModels,
    num_gpus: int,
    slo_ms: Mapping[str, float],
    config: SimConfig | None = None,
    attainment: float = 0.9,
    iterations: int = 5,
    min_duration_s: float = 0.0,
    space: SearchSpace | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> list[PDRow]:
    """The P:D search (module docstring) over deployments of at most ``num_gpus`` GPUs: the verified rows
    (the best predicted disaggregated placements, the best colocated shapes as one instance, since replicas
    add their rates, and the best placements under auto), each with the rate search for every seed of
    ``space``, best per GPU first. ``jobs`` > 1 runs the configurations on that many forked processes.
    ``progress`` hears a line per simulated configuration and one at the end. Raises ValueError without SLOs,
    with fewer than 2 GPUs, or when no shape fits."""
    if not slo_ms:
        raise ValueError("pd search: give SLOs, e.g. --slo ttft=200,tpot=50")
    if num_gpus < 2:
        raise ValueError(f"pd search: need at least 2 GPUs, got {num_gpus}")
    costs = _cost_models(cost_model)
    cfg = config or SimConfig()
    space = space or SearchSpace()
    started = time.monotonic()
    shapes = shape_goodputs(
        spec,
        costs,
        num_gpus,
        slo_ms,
        cfg,
        space,
        attainment,
        max(iterations - 1, 3),
        min_duration_s / 2,
        progress,
        jobs,
    )
    if not shapes:
        raise ValueError(f"pd search: no instance shape of at most {num_gpus} GPUs fits the model")
    candidates: list[tuple[Architecture, float | None]] = []
    seen: set[tuple[int, int, int, int, int, str]] = set()
    for placement in placements(shapes, num_gpus):
        p, d = placement.prefill, placement.decode
        key = (p.tp, p.pp, d.tp, placement.num_prefill, placement.num_decode, p.label)
        if key in seen:
            continue
        seen.add(key)
        candidates.append((placement.architecture(), placement.predicted))
        if len(candidates) == space.verify_disaggregated:
            break
    verified_placements = [arch for arch, _ in candidates]
    colocated = sorted((s for s in shapes if s.role == "colocated"), key=lambda s: -s.goodput / s.num_gpus)
    for shape in colocated[: space.verify_colocated]:  # one instance: replicas add their rates
        candidates.append((replace(shape.arch, name=f"colocated tp{shape.tp} {shape.label}"), shape.goodput))
    if space.auto:
        for arch in verified_placements[:1]:
            candidates.append((replace(arch, name="auto " + arch.name, mode="auto"), None))
    tasks = [
        _Task(f"pd search [{i + 1}/{len(candidates)}] {arch.name}", arch, spec, dict(slo_ms), space.seeds, predicted)
        for i, (arch, predicted) in enumerate(candidates)
    ]
    rows = _run_tasks(tasks, (costs, cfg, attainment, iterations, min_duration_s), jobs, progress)
    rows = [replace(row, predicted_goodput=predicted) for row, (_, predicted) in zip(rows, candidates, strict=True)]
    if progress is not None:
        progress(
            f"pd search: {len(shapes)} instance shapes and {len(rows)} deployments in "
            f"{time.monotonic() - started:.0f} s"
        )
    return rank_rows(rows)


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
