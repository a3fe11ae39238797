"""Fit the per-role linear step-time model to measured steps of our own engine (the ``cpu-measured``
profile), and measure what a deployment adds around the steps.

Model per role (seconds; the regressors are ``cost_model.linear_features``)::

    duration = fixed + a * prefill_tokens + b * decode_tokens + cp * prefill_context
               + cd * decode_keys + r * prefill_kv_read + s[n]   (n = the step's tokens, s[n] = 0 above 8)

Roles (``cost_model.ROLES``) are where a step ran: ``colocated`` (a decode worker of a deployment
without prefill workers: mixed steps), ``prefill`` (a prefill worker: prompts only), ``decode`` (a
decode worker of a disaggregated deployment: decode-only steps, every prompt's KV received) and
``auto-decode`` (a decode worker under ``auto``: local prefills too, fewer KV transfers; its
decode-only steps can run slower relative to the pooled fit than on disaggregated decode workers, so
the two are fitted apart; without records of its own it takes ``decode``'s fit). The same engine does
the same arithmetic everywhere; the roles differ in what else the machine's shared cores run at the
time, which is what a per-role fit captures. ``all`` fits every record; a role that never
exercises a term (a prefill worker never decodes) takes that coefficient from ``all``.

``fit_role`` is a median regression of the relative error with every coefficient >= 0, so the fit is
a shape's typical step, and it keeps what other load on the machine adds (noise only ever makes a step
slower): ``RoleFit.ratio_percentiles`` is the distribution of measured/predicted over every record,
which the simulator resamples per step. ``decode_keys`` (the decodes' keys as the engine pads them)
is not in a step record: ``step_shapes`` reads every decode's context length off the requests' token
times (which step produced each token) and so prices each step's padding exactly.

On top of the per-role fit (which is a step's time *alone*), two things a shared machine adds:
``co_run_slowdown`` ``k``, a step runs ``1 + k`` times slower while the deployment's other worker
runs a step too (two engines on two cores share caches and memory bandwidth; ``fit_co_run_slowdown``,
one number for the machine), and ``machine_slowdown``, the other load's bursts per window, measured
inside each run and taken at the median run's level.
``deployment_latencies`` measures the token delivery latency (a worker's
step end to the client) and the control-call latency (client to worker) from the same runs.

``measure_step_records`` instead drives a real ``engine.LLMEngine`` alone through a grid of batch
shapes (``pdserve sim --calibrate``): no deployment, so only the ``all`` role.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from pdserve.messages import StepStats
from pdserve.sim.cost_model import DEFAULT_BLOCK_SIZE, ROLES, StepShape, linear_features
from pdserve.sim.profiles import BASE_TERMS, RATIO_PERCENTILES, LinearProfile, RoleFit
from pdserve.workload.metrics import RequestRecord

if TYPE_CHECKING:
    from pdserve.engine import LLMEngine

MIN_RECORDS = len(BASE_TERMS) + 2  # a role with fewer records is not fitted on its own (a small-step term
# is free only where its step size occurs)
RunSteps = tuple[str, Sequence[StepStats], Sequence[StepShape], Sequence[float]]  # + shapes, co-run fractions
CO_RUN_GRID = tuple(i / 40 for i in range(41))  # the co-run slowdowns tried: 0, 0.025, ..., 1
HANDOFF_MATCH_S = 0.002  # a step's start or end and a request's timestamp of it (token, scheduling) agree within this


def step_role(worker: str, architecture: str) -> str:
    """The role of a step run by ``worker`` in a deployment of ``architecture``."""
    if worker.startswith("prefill"):
        return "prefill"
    return {"colocated": "colocated", "auto": "auto-decode"}.get(architecture, "decode")


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray, free: list[int], scale: np.ndarray) -> np.ndarray:
    """Least squares over the columns ``free`` with rows scaled by ``scale``, every coefficient >= 0:
    drop the most negative one and refit until none is. Columns not in ``free`` stay 0."""
    xw, yw = x * scale[:, None], y * scale
    active = list(free)
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    return np.maximum(coef, 0.0)


def _median_fit(
    x: np.ndarray, y: np.ndarray, free: list[int], offset: np.ndarray, weight: np.ndarray, rounds: int = 50
) -> np.ndarray:
    """Non-negative coefficients minimising the ``weight``-ed sum of absolute errors relative to the
    *prediction* (``|y - p| / p``: timing noise is proportional to the step time, and so the typical measured
    step is the prediction: median(measured / predicted) = 1 as far as the terms allow), by iteratively
    reweighted least squares. The fit is a shape's typical step, whatever slow outliers the machine adds."""
    target, root = y - offset, np.sqrt(weight)
    coef = _nonneg_lstsq(x, target, free, root / np.maximum(y, 1e-12))
    for _ in range(rounds):
        pred = np.maximum(x @ coef + offset, 1e-9)
        rel = np.abs(y - pred) / pred
        new = _nonneg_lstsq(x, target, free, root / (pred * np.sqrt(np.maximum(rel, 1e-3))))
        if np.allclose(new, coef, rtol=1e-6, atol=1e-12):
            break
        coef = new
    return coef


def kind_weights(shapes: Sequence[StepShape]) -> np.ndarray:
    """One weight per step such that each step kind (``StepShape.kind``) present weighs the same in a fit:
    a role's fit prices its rare prefill-only steps as closely as its thousands of decodes, which share
    their coefficients (each kind is judged on its own, ``validate_sim``'s check 1). Mean weight 1."""
    kinds = [shape.kind for shape in shapes]
    counts = {kind: kinds.count(kind) for kind in set(kinds)}
    return np.asarray([len(kinds) / (len(counts) * counts[kind]) for kind in kinds], dtype=float)


def _shapes(steps: Sequence[StepStats], shapes: Sequence[StepShape] | None) -> Sequence[StepShape]:
    """``shapes`` (one per step) when given, else each step's shape from its record alone."""
    if shapes is None:
        return [StepShape.from_stats(s) for s in steps]
    if len(shapes) != len(steps):
        raise ValueError(f"calibration: {len(shapes)} shapes for {len(steps)} steps")
    return shapes


def fit_role(
    steps: Sequence[StepStats],
    robust: bool = True,
    fallback: RoleFit | None = None,
    shapes: Sequence[StepShape] | None = None,
) -> RoleFit:
    """Fit ``LINEAR_TERMS`` to ``steps`` (at least ``MIN_RECORDS``; raises ValueError otherwise);
    ``shapes`` are the steps' shapes when known better than their records say (``step_shapes``).

    ``robust``: a median regression of the relative error, so the fit is the typical step and the slow
    ones (other load on the machine only ever makes a step slower) land in ``ratio_percentiles``, the
    tail; else plain least squares of the relative error, which the slow steps pull up. Either way each
    step kind weighs the same (``kind_weights``). Terms whose regressor is zero in every record take
    ``fallback``'s coefficient (0 without one).
    """
    if len(steps) < MIN_RECORDS:
        raise ValueError(f"calibration: need at least {MIN_RECORDS} step records, got {len(steps)}")
    shapes = _shapes(steps, shapes)
    x = np.asarray([linear_features(shape) for shape in shapes], dtype=float)
    y = np.asarray([s.duration_s for s in steps], dtype=float)
    absent = [j for j in range(x.shape[1]) if not np.any(x[:, j])]
    fixed = np.zeros(x.shape[1])
    if fallback is not None:
        fixed[absent] = [fallback.coefficients[j] for j in absent]
    free = [j for j in range(x.shape[1]) if j not in absent]
    offset = x @ fixed
    weight = kind_weights(shapes)
    if robust:
        coef = _median_fit(x, y, free, offset, weight) + fixed
    else:
        coef = _nonneg_lstsq(x, y - offset, free, np.sqrt(weight) / np.maximum(y, 1e-12)) + fixed
    pred = np.maximum(x @ coef, 1e-12)
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    rel = np.abs(resid) / np.maximum(y, 1e-12)
    return RoleFit(
        tuple(float(c) for c in coef),
        num_records=len(steps),
        r2=1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else 1.0,
        rms_residual_s=float(np.sqrt(np.mean(resid**2))),
        mean_abs_rel_error=float(np.mean(rel)),
        median_abs_rel_error=float(np.median(rel)),
        ratio_percentiles=tuple(float(v) for v in np.percentile(y / pred, RATIO_PERCENTILES)),
    )


def fit_linear_profile(
    steps_by_role: Mapping[str, Sequence[StepStats]],
    model: str = "bench",
    robust: bool = True,
    shapes_by_role: Mapping[str, Sequence[StepShape]] | None = None,
    **extra: Any,
) -> LinearProfile:
    """``all`` over every record, then each role of ``ROLES`` with at least ``MIN_RECORDS`` records.
    ``shapes_by_role``: the steps' shapes, one per step (else read off the records). ``extra`` goes
    into the profile (latencies, ``notes``, ...)."""
    shapes = {role: _shapes(steps, (shapes_by_role or {}).get(role)) for role, steps in steps_by_role.items()}
    everything = [s for steps in steps_by_role.values() for s in steps]
    roles = {"all": fit_role(everything, robust, shapes=[x for v in shapes.values() for x in v])}
    for role in ROLES:
        steps = steps_by_role.get(role, ())
        if len(steps) >= MIN_RECORDS:
            roles[role] = fit_role(steps, robust, fallback=roles["all"], shapes=shapes[role])
    return LinearProfile(model=model, roles=roles, **extra)


def decode_contexts(steps: Sequence[StepStats], records: Iterable[RequestRecord]) -> list[list[int]]:
    """Per step (in ``steps``' order), the context length of every decode it ran, read off the requests:
    a request's token ``k >= 1`` came from the latest step on its decode worker that ended before the
    client received it, a decode over ``prompt + k`` keys. A step whose list disagrees with its record
    (a token delivered late, past the next step's end) is priced from the record alone (``from_stats``)."""
    ends: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for i, s in enumerate(steps):
        ends[s.worker].append((s.ended, i))
    for v in ends.values():
        v.sort()
    found: list[list[int]] = [[] for _ in steps]
    for r in records:
        worker = r.meta.get("decode_worker")
        if not r.succeeded or worker not in ends:
            continue
        times = [t for t, _ in ends[worker]]
        for k, t in enumerate(r.token_times[1:], start=1):
            j = bisect.bisect_right(times, t)
            if j:
                found[ends[worker][j - 1][1]].append(r.num_prompt_tokens + k)
    return found


def step_shapes(
    steps: Sequence[StepStats], records: Iterable[RequestRecord], block_size: int = DEFAULT_BLOCK_SIZE
) -> list[StepShape]:
    """Every step's shape, its padded decode keys from the decodes' context lengths (``decode_contexts``)."""
    contexts = decode_contexts(steps, records)
    return [StepShape.from_stats(s, c, block_size) for s, c in zip(steps, contexts, strict=True)]


def _sampled_at(ends: list[float], t: float) -> float | None:
    """The end of the step (of the worker whose sorted step ``ends`` are given) that sampled a token its
    client received at ``t``: the latest end before ``t``, or up to ``HANDOFF_MATCH_S`` after it, as a step's
    recorded end (its wall-clock start plus its duration) can fall just after the token it sent, by the time
    another thread held the interpreter between the two clock reads. None before the first step."""
    i = bisect.bisect_right(ends, t + HANDOFF_MATCH_S)
    return ends[i - 1] if i else None


def _busy_between(steps: Sequence[StepStats], lo: float, hi: float) -> bool:
    return any(s.started < hi and s.ended > lo for s in steps)


class Latencies(NamedTuple):
    """What a deployment adds around the steps (seconds; 0.0 and () without data, None for the paths
    between workers when no case measured them)."""

    token_s: float  # median
    control_s: float  # median
    control_percentiles: tuple[float, ...]  # at RATIO_PERCENTILES
    reserve_s: float | None = None  # median: a prefill worker's reservation on the decode worker, round trip
    handoff_s: float | None = None  # median: first token sampled on the prefill worker -> decode step begins


def deployment_latencies(runs: Iterable[tuple[Sequence[StepStats], Sequence[RequestRecord]]]) -> Latencies:
    """The token delivery latency (median), the control-call latency (median and distribution) and the
    paths between a disaggregated deployment's workers (medians), measured on deployments.

    Token latency: for every token a client received, the time since the last step end on the worker
    that produced it (the first token of a remotely prefilled request comes from its prefill worker).
    Control latency: for a locally prefilled request that found its worker idle, from the client's send
    to the worker taking it in: the end of the step that sampled its first token, less the worker's
    own ``prefill_s`` and ``queue_s`` (from its metadata). A worker busy with a step takes a call in
    only after it, which the simulator models by itself, so those requests are left out.
    Reservation round trip: the median of ``recorded_reserve_latencies`` (a prefill worker's ``queue_s``
    where neither worker ran a step meanwhile and no request ahead of it was being admitted).
    Handoff: from the end of the prefill step that sampled a remotely prefilled request's first token to
    the start of the decode step that sampled its second (``second_token_time``), where the decode
    worker ran no step in between (a busy one takes it in only after its step: the simulator's part).
    """
    delays: list[float] = []
    calls: list[float] = []
    handoffs: list[float] = []
    reservations: list[float] = []
    for steps, records in runs:
        by_worker = steps_by_worker(steps)
        ends = step_ends_by_worker(by_worker)
        reservations += recorded_reserve_latencies(steps, records).values()
        for r in records:
            if not r.succeeded or "decode_worker" not in r.meta:
                continue
            prefill_worker = r.meta.get("prefill_worker") or ""
            for k, t in enumerate(r.token_times):
                worker = prefill_worker if k == 0 and prefill_worker else r.meta["decode_worker"]
                end = _sampled_at(ends.get(worker, []), t)
                if end is not None:
                    delays.append(max(0.0, t - end))
            worker = prefill_worker or r.meta["decode_worker"]
            first = _sampled_at(ends.get(worker, []), r.token_times[0])
            if first is None:
                continue
            scheduled = first - r.meta.get("prefill_s", 0.0)
            taken_in = scheduled - r.meta.get("queue_s", 0.0)
            if prefill_worker:
                decode_worker = r.meta["decode_worker"]
                handoff = _handoff(by_worker.get(decode_worker, []), first, r.meta.get("second_token_time") or 0.0)
                if handoff is not None:
                    handoffs.append(handoff)
                continue
            if r.send_time <= taken_in and not _busy_between(by_worker[worker], r.send_time, taken_in):
                calls.append(taken_in - r.send_time)
    token = statistics.median(delays) if delays else 0.0
    reserve = statistics.median(reservations) if reservations else None
    handoff = statistics.median(handoffs) if handoffs else None
    if not calls:
        return Latencies(token, 0.0, (), reserve, handoff)
    table = tuple(float(v) for v in np.percentile(calls, RATIO_PERCENTILES))
    return Latencies(token, statistics.median(calls), table, reserve, handoff)


def steps_by_worker(steps: Iterable[StepStats]) -> dict[str, list[StepStats]]:
    """The steps of each worker, in the order given."""
    by_worker: dict[str, list[StepStats]] = defaultdict(list)
    for s in steps:
        by_worker[s.worker].append(s)
    return by_worker


def step_ends_by_worker(by_worker: dict[str, list[StepStats]]) -> dict[str, list[float]]:
    """Each worker's step end times, sorted (for ``_sampled_at``)."""
    return {w: sorted(s.ended for s in v) for w, v in by_worker.items()}


def recorded_call_latencies(steps: Sequence[StepStats], records: Sequence[RequestRecord]) -> dict[str, float]:
    """Per request whose records show it, the latency of its call from the client to its worker: the send to
    the worker taking it in (``deployment_latencies`` reads it the same way). A prefill worker takes a call
    in on arrival (its ``queue_s`` runs from then); a worker that prefills locally takes one in between its
    steps: for a request that found it idle, that is the call's latency; for one that found it busy, the
    call reached it when the worker says it did (``decode_call_time``), and it took it in after its step."""
    by_worker = steps_by_worker(steps)
    ends = step_ends_by_worker(by_worker)
    out: dict[str, float] = {}
    for r in records:
        if not r.succeeded or "decode_worker" not in r.meta or "queue_s" not in r.meta or "prefill_s" not in r.meta:
            continue
        prefill_worker = r.meta.get("prefill_worker") or ""
        worker = prefill_worker or r.meta["decode_worker"]
        first = _sampled_at(ends.get(worker, []), r.token_times[0])
        if first is None:
            continue
        taken_in = first - r.meta["prefill_s"] - r.meta["queue_s"]
        if r.send_time <= taken_in and (prefill_worker or not _busy_between(by_worker[worker], r.send_time, taken_in)):
            out[r.request_id] = taken_in - r.send_time
        elif not prefill_worker and r.send_time <= (called := r.meta.get("decode_call_time") or 0.0) <= taken_in:
            out[r.request_id] = called - r.send_time
    return out


def recorded_reserve_latencies(steps: Sequence[StepStats], records: Sequence[RequestRecord]) -> dict[str, float]:
    """Per remotely prefilled request whose records show it, its reservation's round trip: its prefill worker's
    ``queue_s`` (taken in to first scheduled) where neither worker ran a step meanwhile and no request ahead of
    it was still being admitted on that prefill worker (reservations go one at a time, in order); then the
    wait is the reservation call, its answer and the prompt's adding (``deployment_latencies`` takes the
    median)."""
    by_worker = steps_by_worker(steps)
    ends = step_ends_by_worker(by_worker)
    admissions: list[tuple[str, float, float, float, str, str]] = []  # (id, taken in, scheduled, queue_s, P, D)
    for r in records:
        prefill = r.meta.get("prefill_worker") or ""
        if not r.succeeded or not prefill or not {"decode_worker", "queue_s", "prefill_s"} <= r.meta.keys():
            continue
        first = _sampled_at(ends.get(prefill, []), r.token_times[0])
        if first is None:
            continue
        scheduled = first - r.meta["prefill_s"]
        queue_s = r.meta["queue_s"]
        admissions.append((r.request_id, scheduled - queue_s, scheduled, queue_s, prefill, r.meta["decode_worker"]))
    out: dict[str, float] = {}
    for i, (rid, lo, hi, queue_s, prefill, decode) in enumerate(admissions):
        others = [(a, b) for j, (_, a, b, _, p, _) in enumerate(admissions) if j != i and p == prefill]
        first_in_line = all(not (a <= lo < b) for a, b in others)
        quiet = not _busy_between(by_worker[prefill], lo, hi - HANDOFF_MATCH_S)  # its own step began at about hi
        if first_in_line and quiet and not _busy_between(by_worker.get(decode, []), lo, hi):
            out[rid] = queue_s
    return out


def recorded_handoff_latencies(steps: Sequence[StepStats], records: Sequence[RequestRecord]) -> dict[str, float]:
    """Per remotely prefilled request whose records show it, its handoff: from the end of the prefill step that
    sampled its first token to the start of the decode step that sampled its second, where the decode worker
    ran no step in between (``deployment_latencies`` reads the same); where it ran one, to the decode call's
    arrival on the decode worker (``decode_call_time``), which took it in after its step."""
    by_worker = steps_by_worker(steps)
    ends = step_ends_by_worker(by_worker)
    out: dict[str, float] = {}
    for r in records:
        prefill_worker = r.meta.get("prefill_worker") or ""
        if not r.succeeded or not prefill_worker or "decode_worker" not in r.meta:
            continue
        first = _sampled_at(ends.get(prefill_worker, []), r.token_times[0])
        if first is None:
            continue
        decode_steps = by_worker.get(r.meta["decode_worker"], [])
        handoff = _handoff(decode_steps, first, r.meta.get("second_token_time") or 0.0)
        called = r.meta.get("decode_call_time") or 0.0
        if handoff is not None:
            out[r.request_id] = handoff
        elif called >= first:
            out[r.request_id] = called - first
    return out


def _handoff(decode_steps: Sequence[StepStats], prefill_end: float, second_token_time: float) -> float | None:
    """The prefill step's end to the start of the decode step that sampled token #2 (ending at
    ``second_token_time``), when the decode worker ran no step in between; else None."""
    if not second_token_time or not decode_steps:
        return None
    step = min(decode_steps, key=lambda s: abs(s.ended - second_token_time))
    if abs(step.ended - second_token_time) > HANDOFF_MATCH_S or step.started < prefill_end:
        return None
    if _busy_between(decode_steps, prefill_end, step.started - 1e-6):
        return None
    return step.started - prefill_end


def step_gap(steps: Iterable[StepStats], busy_within_s: float = 0.05) -> float:
    """Median time between a worker's consecutive steps when the next began within ``busy_within_s``
    (the engine loop's own work between steps; longer gaps are idle time)."""
    by_worker = steps_by_worker(steps)
    gaps = []
    for worker_steps in by_worker.values():
        pairs = itertools.pairwise(sorted(worker_steps, key=lambda s: s.started))
        gaps += [b.started - a.ended for a, b in pairs if b.started - a.ended < busy_within_s]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


class Slowdown(NamedTuple):
    """The machine's measured slowdown (measured over predicted step time), at percentiles 0 ... 100."""

    windows: tuple[float, ...]  # per window of a worker's time, in a run at the median run's level
    runs: tuple[float, ...]  # per run, over all its steps: the run-to-run level


def _window_sums(
    profile: LinearProfile,
    architecture: str,
    steps: Sequence[StepStats],
    shapes: Sequence[StepShape] | None = None,
    co_run: Sequence[float] | None = None,
    *,
    window_s: float,
) -> dict[tuple[str, int], list[float]]:
    """Per (worker, window of ``window_s`` in which steps began): [measured duration, ``profile``'s price times
    the co-run slowdown for the step's ``co_run`` fraction (0 when not given)]; ``shapes`` as in ``_shapes``."""
    shapes = _shapes(steps, shapes)
    fractions = co_run if co_run is not None else [0.0] * len(steps)
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s, shape, f in zip(steps, shapes, fractions, strict=True):
        fit = profile.fit_for(step_role(s.worker, architecture))
        window = sums[s.worker, int(s.started // window_s) if math.isfinite(window_s) else 0]
        window[0] += s.duration_s
        window[1] += fit.predict(linear_features(shape)) * (1 + profile.co_run_slowdown * f)
    return sums


def run_level(
    profile: LinearProfile,
    architecture: str,
    steps: Sequence[StepStats],
    shapes: Sequence[StepShape] | None = None,
    co_run: Sequence[float] | None = None,
) -> float | None:
    """A run's level, as ``machine_slowdown`` measures it for each calibration run: the measured duration of
    all its steps over what ``profile`` predicts for them (each step's role, times the co-run slowdown for its
    ``co_run`` fraction); None when nothing is predicted. How fast the machine ran during that run."""
    sums = _window_sums(profile, architecture, steps, shapes, co_run, window_s=math.inf).values()
    measured, predicted = (sum(v[i] for v in sums) for i in (0, 1))
    return measured / predicted if predicted > 0 else None


def machine_slowdown(
    profile: LinearProfile, runs: Iterable[tuple[str, Sequence[StepStats]] | RunSteps], window_s: float
) -> Slowdown:
    """The machine's slowdown at percentiles 0 ... 100, in two parts. Each run's level: the measured
    duration of all its steps over what ``profile`` (each step's role) predicts. Within a run, per
    ``window_s`` of each worker's time, the steps that began in that window, measured over predicted,
    relative to the run's level; ``windows`` is that, times the median run's level.

    Other load on a shared machine comes and goes over seconds, so whole runs are slow or fast
    together; a simulated run is one typical run (the median level) with the bursts measured inside
    runs, rather than every window drawn from every run, which would price a run at the mean level
    that one slow run pulls up. Short windows see short stalls, long ones the average: ``window_s``
    sets how bursty the simulated machine is (and long steps span several windows, so they see less of
    a burst than short ones). ``runs``: ``(architecture, steps)``, or ``(architecture, steps, shapes,
    co_run_fractions)`` with the steps' shapes and how much of each step other workers ran steps too
    (``co_run_fractions``), which ``profile.co_run_slowdown`` prices."""
    levels: list[float] = []
    relative: list[float] = []
    for arch, steps, *known in runs:
        sums = _window_sums(profile, arch, steps, *cast("list[Any]", known), window_s=window_s)
        measured, predicted = (sum(v[i] for v in sums.values()) for i in (0, 1))
        if predicted <= 0:
            continue
        level = measured / predicted
        levels.append(level)
        relative += [m / p / level for m, p in sums.values() if p > 0]
    if not levels:
        return Slowdown((), ())
    typical = float(np.median(levels))
    windows = tuple(float(v) * typical for v in np.percentile(relative, RATIO_PERCENTILES))
    return Slowdown(windows, tuple(float(v) for v in np.percentile(levels, RATIO_PERCENTILES)))


def co_run_fractions(steps: Sequence[StepStats]) -> list[float]:
    """Per step, how much of it the other workers of its deployment (the other ``worker`` names in
    ``steps``) ran steps too: their overlapping step time over its duration, per other worker, in [0, 1]."""
    by_worker = steps_by_worker(steps)
    others = len(by_worker) - 1
    if others < 1:
        return [0.0] * len(steps)
    starts = {w: sorted(v, key=lambda s: s.started) for w, v in by_worker.items()}
    keys = {w: [s.started for s in v] for w, v in starts.items()}
    out = []
    for s in steps:
        overlap = 0.0
        for w, v in starts.items():
            if w == s.worker:
                continue
            j = max(bisect.bisect_left(keys[w], s.started) - 1, 0)  # the one begun before may overlap
            while j < len(v) and v[j].started < s.ended:
                overlap += max(0.0, min(s.ended, v[j].ended) - max(s.started, v[j].started))
                j += 1
        out.append(min(1.0, overlap / max(s.duration_s, 1e-12) / others))
    return out


class Observed(NamedTuple):
    """One measured step, as the calibration sees it."""

    step: StepStats
    shape: StepShape
    co_run: float  # how much of it other workers ran steps (``co_run_fractions``)
    run: int  # which run it belongs to


def _alone(by_role: Mapping[str, Sequence[Observed]], k: float) -> dict[str, list[StepStats]]:
    """The steps with their durations divided by the co-run slowdown ``1 + k * co_run``."""
    return {
        role: [o.step._replace(duration_s=o.step.duration_s / (1 + k * o.co_run)) for o in v]
        for role, v in by_role.items()
    }


def _role_shapes(by_role: Mapping[str, Sequence[Observed]]) -> dict[str, list[StepShape]]:
    return {role: [o.shape for o in v] for role, v in by_role.items()}


def fit_co_run_slowdown(by_role: Mapping[str, Sequence[Observed]], model: str = "bench") -> float:
    """The co-run slowdown ``k`` of ``CO_RUN_GRID`` under which the per-role fits of the steps' time
    alone, times ``1 + k * co-run fraction``, leave the least mean relative error over every step: one
    number for the machine (two workers on shared cores and memory), 0 when overlap explains nothing."""
    shapes = _role_shapes(by_role)

    def error(k: float) -> float:
        profile = fit_linear_profile(_alone(by_role, k), model, shapes_by_role=shapes)
        total = 0.0
        for role, observed in by_role.items():
            fit = profile.fit_for(role)
            for o in observed:
                predicted = max(fit.predict(linear_features(o.shape)) * (1 + k * o.co_run), 1e-12)
                total += abs(o.step.duration_s - predicted) / predicted
        return total

    return min(CO_RUN_GRID, key=error)


def _observe(
    runs: Sequence[tuple[str, Sequence[StepStats], Sequence[RequestRecord]]], block_size: int
) -> tuple[list[RunSteps], dict[str, list[Observed]]]:
    """Every run's steps with their shapes and co-run fractions, and every step by its role."""
    shaped: list[RunSteps] = [
        (arch, steps, step_shapes(steps, records, block_size), co_run_fractions(steps)) for arch, steps, records in runs
    ]
    by_role: dict[str, list[Observed]] = defaultdict(list)
    for run, (arch, steps, shapes, fractions) in enumerate(shaped):
        for step, shape, f in zip(steps, shapes, fractions, strict=True):
            by_role[step_role(step.worker, arch)].append(Observed(step, shape, f, run))
    return shaped, by_role


def cpu_time_recorded(steps: Iterable[StepStats]) -> bool:
    """Whether every one of ``steps`` carries its CPU time (``cpu_s`` > 0; 0 means not recorded)."""
    steps = list(steps)
    return bool(steps) and all(s.cpu_s > 0 for s in steps)


def calibrate_cpu_time(
    runs: Iterable[tuple[str, Sequence[StepStats], Sequence[RequestRecord]]],
    model: str = "bench",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> LinearProfile | None:
    """The per-role fits and the co-run slowdown of the steps' *CPU time* (``StepStats.cpu_s``, the stepping
    thread's), fitted exactly as ``calibrate_from_runs`` fits their wall time: the shapes and the co-run
    fractions (the other worker's steps overlapping in wall-clock time) are the same. A profile of what a
    shape costs the thread that runs it, without the time other processes held its core: for judging the
    cost model (validate_sim's check 1), not for simulating (no latencies, no machine slowdown). None when
    a step has no CPU time recorded."""
    runs = list(runs)
    if not cpu_time_recorded(s for _, steps, _ in runs for s in steps):
        return None
    _, by_role = _observe(runs, block_size)
    cpu = {role: [o._replace(step=o.step._replace(duration_s=o.step.cpu_s)) for o in v] for role, v in by_role.items()}
    k = fit_co_run_slowdown(cpu, model)
    notes = "CPU time of the stepping thread (cpu_s) per step; for checking the cost model, not for simulating"
    return fit_linear_profile(_alone(cpu, k), model, shapes_by_role=_role_shapes(cpu), co_run_slowdown=k, notes=notes)


def calibrate_from_runs(
    runs: Iterable[tuple[str, Sequence[StepStats], Sequence[RequestRecord]]],
    model: str = "bench",
    window_s: float = 0.1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    **extra: Any,
) -> LinearProfile:
    """The cpu-measured profile from deployment runs ``(architecture, steps, records)``: per-role fits
    of the steps (``step.worker`` names the worker; their shapes by ``step_shapes`` with the
    deployment's ``block_size``), the deployment's latencies and the machine's slowdown per ``window_s``."""
    runs = list(runs)
    shaped, by_role = _observe(runs, block_size)
    k = fit_co_run_slowdown(by_role, model)
    latency = deployment_latencies((steps, records) for _, steps, records in runs)
    profile = fit_linear_profile(
        _alone(by_role, k),
        model,
        shapes_by_role=_role_shapes(by_role),
        co_run_slowdown=k,
        token_latency_s=latency.token_s,
        control_latency_s=latency.control_s,
        control_latency_percentiles=latency.control_percentiles,
        reserve_latency_s=latency.reserve_s,
        handoff_latency_s=latency.handoff_s,
        step_gap_s=statistics.median([step_gap(steps) for _, steps, _ in runs]),
        slowdown_window_s=window_s,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        **extra,
    )
    slowdown = machine_slowdown(profile, shaped, window_s)
    return dataclasses.replace(profile, slowdown_percentiles=slowdown.windows, run_slowdown_percentiles=slowdown.runs)


def describe_profile(profile: LinearProfile, fits_only: bool = False) -> str:
    """A few lines: each role's coefficients, fit quality and measured/predicted tail; the co-run slowdown;
    unless ``fits_only``, the latencies and the machine's slowdown too."""
    units: tuple[tuple[float, str], ...] = ((1e3, "ms"), (1e6, "us/prefill tok"), (1e6, "us/decode tok"))
    units += ((1e9, "ns/prefill ctx"), (1e9, "ns/decode key"), (1e9, "ns/prefill KV read"))
    lines = [f"cpu-measured profile for {profile.model!r} ({profile.notes or 'no notes'}), a step alone:"]
    for role, fit in profile.roles.items():
        base, small = fit.coefficients[: len(units)], fit.coefficients[len(units) :]
        terms = " + ".join(f"{c * k:.3g} {u}" for c, (k, u) in zip(base, units, strict=True))
        r = fit.ratio_percentiles
        tail = f"measured/predicted p50 {r[50]:.2f} p90 {r[90]:.2f} p99 {r[99]:.2f} max {r[100]:.2f}" if r else ""
        lines.append(f"  {role:>9}: {terms}")
        if any(small):
            sizes = ", ".join(f"{n}: {c * 1e3:.3g}" for n, c in enumerate(small, start=1) if c)
            lines.append(f"  {'':>9}  + a step of n tokens, ms: {sizes}")
        lines.append(
            f"  {'':>9}  {fit.num_records} steps, R^2 {fit.r2:.3f}, |rel err| median "
            f"{fit.median_abs_rel_error:.1%} mean {fit.mean_abs_rel_error:.1%}; {tail}"
        )
    if fits_only:
        lines.append(f"  co-run slowdown: x{1 + profile.co_run_slowdown:.3g} while the other worker runs a step too")
        return "\n".join(lines)
    c = profile.control_latency_percentiles
    spread = f" (p90 {c[90] * 1e3:.1f}, p99 {c[99] * 1e3:.1f})" if c else ""
    lines.append(
        f"  token latency {profile.token_latency_s * 1e3:.2f} ms, control latency "
        f"{profile.control_latency_s * 1e3:.2f} ms{spread}, gap between steps {profile.step_gap_s * 1e3:.2f} ms, "
        f"KV link {profile.kv_link_bw / 1e9:.1f} GB/s"
    )
    paths = (("reservation round trip", profile.reserve_latency_s), ("handoff", profile.handoff_latency_s))
    between = [f"{what} {value * 1e3:.2f} ms" for what, value in paths if value is not None]
    if between:
        lines.append(f"  between the workers: {', '.join(between)}")
    lines.append(f"  co-run slowdown: x{1 + profile.co_run_slowdown:.3g} while the other worker runs a step too")
    w = profile.slowdown_percentiles
    if w:
        mean = float(np.mean(np.interp(np.linspace(0, 100, 1001), RATIO_PERCENTILES, w)))
        lines.append(
            f"  machine slowdown per {profile.slowdown_window_s:g} s window: p50 {w[50]:.2f} p90 {w[90]:.2f} "
            f"p99 {w[99]:.2f} max {w[100]:.2f} (mean {mean:.2f})"
        )
    r = profile.run_slowdown_percentiles
    if r:
        lines.append(
            f"  run-to-run level (a run's steps, measured over predicted): min {r[0]:.2f} p50 {r[50]:.2f} "
            f"max {r[100]:.2f}; simulated at the median"
        )
    return "\n".join(lines)


def residuals(
    profile: LinearProfile,
    steps_by_role: Mapping[str, Sequence[StepStats]],
    shapes_by_role: Mapping[str, Sequence[StepShape]] | None = None,
) -> dict[str, list[tuple]]:
    """Per role, ``(predicted, measured)`` seconds of every step: the fit's residuals, for a plot.
    ``shapes_by_role``: the steps' shapes, one per step (else read off the records)."""
    out = {}
    for role, steps in steps_by_role.items():
        fit = profile.fit_for(role)
        shapes = _shapes(steps, (shapes_by_role or {}).get(role))
        out[role] = [(fit.predict(linear_features(x)), s.duration_s) for s, x in zip(steps, shapes, strict=True)]
    return out


@dataclass(frozen=True)
class CalibrationGrid:
    """Batch shapes to measure: for every decode context length and decode batch size, bring that
    many requests into decode, then run one step per prefill size next to them (``repeats`` times),
    plus ``repeats`` decode-only steps. The ramp-up prefills are measured too. First, each of
    ``long_prompts`` is prefilled alone in budget-sized chunks, which spreads chunk start positions
    over long contexts (the attention term). Cover the contexts you will simulate: the fit is
    linear and extrapolates poorly. ``time_budget_s`` stops the measurement early (the records
    gathered so far are kept)."""

    prefill_sizes: tuple[int, ...] = (32, 128, 384)
    decode_batches: tuple[int, ...] = (0, 4, 16)
    decode_contexts: tuple[int, ...] = (64, 512)
    long_prompts: tuple[int, ...] = (2048,)
    repeats: int = 2
    warmup_steps: int = 2
    time_budget_s: float = 40.0

    @staticmethod
    def quick() -> CalibrationGrid:
        """A few seconds on the tiny preset: for tests and smoke runs."""
        return CalibrationGrid(
            prefill_sizes=(16, 64),
            decode_batches=(0, 4),
            decode_contexts=(32, 256),
            long_prompts=(),
            repeats=1,
            warmup_steps=1,
            time_budget_s=20.0,
        )


def _calibration_engine(model: str, grid: CalibrationGrid, seed: int, torch_threads: int | None) -> LLMEngine:
    """An ``LLMEngine`` sized for every step shape of ``grid``, without prefix caching."""
    from pdserve.engine import EngineConfig, LLMEngine

    max_ctx = max(grid.decode_contexts, default=0)
    max_d = max(grid.decode_batches, default=0)
    max_p = max(grid.prefill_sizes, default=1)
    max_long = max(grid.long_prompts, default=0)
    block = 16
    blocks = (
        max_d * (max_ctx + 64 + grid.repeats * (len(grid.prefill_sizes) + 2)) + max(max_p, max_long) + 64
    ) // block + 64
    return LLMEngine(
        EngineConfig(
            model=model,
            seed=seed,
            num_kv_blocks=blocks,
            block_size=block,
            max_num_batched_tokens=max(max_p + max_d, 256),
            max_num_seqs=max(max_d + 2, 8),
            enable_prefix_caching=False,
            torch_threads=torch_threads,
            max_model_len=max(max_ctx, max_p, max_long) + 1024,
        )
    )


def measure_step_records(
    model: str = "bench",
    grid: CalibrationGrid | None = None,
    seed: int = 0,
    torch_threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[StepStats]:
    """Run a real ``engine.LLMEngine(EngineConfig(model=...))`` through ``grid``; its step records."""
    from pdserve.engine import SamplingParams

    grid = grid or CalibrationGrid()
    rng = random.Random(seed)
    engine = _calibration_engine(model, grid, seed, torch_threads)
    records: list[StepStats] = []
    deadline = time.monotonic() + grid.time_budget_s

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    def step(keep: bool = True) -> None:
        engine.step()
        if keep and engine.last_output is not None and engine.last_output.chunks:
            records.append(engine.step_history[-1])

    for _ in range(grid.warmup_steps):  # first steps pay for allocator and kernel warm-up
        engine.add_request(prompt(max(16, min(grid.prefill_sizes, default=16))), SamplingParams(max_tokens=1))
        step(keep=False)
    for n in grid.long_prompts:  # chunked prefill alone: chunk starts from 0 up to n
        rid = engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.get_request(rid) is not None and time.monotonic() <= deadline:
            step()
        if progress:
            progress(f"calibration: {n}-token prompt in chunks: {len(records)} steps measured")
    for ctx in grid.decode_contexts:
        for d in grid.decode_batches:
            if time.monotonic() > deadline:
                return records
            streams = [
                engine.add_request(prompt(ctx), SamplingParams(max_tokens=100_000, ignore_eos=True)) for _ in range(d)
            ]
            for _ in range(10_000):  # ramp-up: prefill the streams until each has its first token
                if not any((r := engine.get_request(s)) is not None and r.num_output_tokens == 0 for s in streams):
                    break
                if time.monotonic() > deadline:
                    return records
                step()
            for _ in range(grid.repeats):
                for p in grid.prefill_sizes:
                    if time.monotonic() > deadline:
                        break
                    engine.add_request(prompt(p), SamplingParams(max_tokens=1, ignore_eos=True))
                    step()
                if d:
                    step()  # decode only
            for s in streams:
                engine.abort(s)
            if progress:
                progress(f"calibration: context {ctx}, {d} decodes: {len(records)} steps measured")
    return records


def calibrate(
    model: str = "bench",
    grid: CalibrationGrid | None = None,
    out_path: str | None = None,
    seed: int = 0,
    torch_threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> LinearProfile:
    """Measure the engine alone, fit (role ``all`` only), and write the profile JSON when ``out_path``."""
    from pdserve.sim.profiles import save_linear_profile

    t0 = time.monotonic()
    records = measure_step_records(model, grid, seed, torch_threads, progress)
    profile = fit_linear_profile(
        {"all": records},
        model=model,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        notes=f"{len(records)} steps of engine preset {model!r} measured alone in {time.monotonic() - t0:.1f} s",
    )
    if out_path:
        save_linear_profile(profile, out_path)
    return profile
