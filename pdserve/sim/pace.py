"""The machine's pace during a measured run, from the workers' pace probes (``engine.pace_probe``).

A worker with the probe on times one fixed kernel every so often between its steps and every step
carries the latest timing (``StepStats.pace_s``). The kernel never changes, so its time moves with the
machine alone: the other guests of a shared VM, the host's caches and memory bandwidth. This module
turns those timings into the pace at each step (the median of the worker's probes around it) and prices
steps at one reference pace (``at_reference_pace``: a step that ran while the probe took 10 % longer is
counted 10 % cheaper).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence

from pdserve.messages import StepStats

PACE_SMOOTH_S = 3.0  # a step's pace: the median of its worker's probes within this many seconds either side


def pace_recorded(steps: Iterable[StepStats]) -> bool:
    """Whether every one of ``steps`` carries a probe timing (``pace_s`` > 0; 0 means the probe was off)."""
    steps = list(steps)
    return bool(steps) and all(s.pace_s > 0 for s in steps)


def probe_samples(steps: Iterable[StepStats]) -> dict[str, list[tuple[float, float]]]:
    """Each worker's probe timings as ``(time, seconds)``, in time order: a step whose ``pace_s`` differs from
    its worker's previous step's carries a new probe, taken after that previous step; its time is the
    step's start (the probe lies in the gap before it)."""
    by_worker: dict[str, list[StepStats]] = {}
    for s in steps:
        if s.pace_s > 0:
            by_worker.setdefault(s.worker, []).append(s)
    samples: dict[str, list[tuple[float, float]]] = {}
    for worker, ws in by_worker.items():
        ws.sort(key=lambda s: s.started)
        out = samples.setdefault(worker, [])
        last = None
        for s in ws:
            if s.pace_s != last:
                out.append((s.started, s.pace_s))
                last = s.pace_s
    return samples


def reference_pace(steps: Iterable[StepStats]) -> float:
    """The median probe timing over ``steps`` (each probe once): the pace a profile fitted on them holds."""
    values = [v for samples in probe_samples(steps).values() for _, v in samples]
    if not values:
        raise ValueError("no step carries a pace probe (pace_s): run the workers with a pace probe interval")
    return statistics.median(values)


def _pace_near(samples: list[tuple[float, float]], times: list[float], t: float, smooth_s: float) -> float:
    lo, hi = bisect.bisect_left(times, t - smooth_s), bisect.bisect_right(times, t + smooth_s)
    if hi > lo:
        return statistics.median(v for _, v in samples[lo:hi])
    i = min(max(bisect.bisect_left(times, t), 0), len(times) - 1)  # none that close: the nearest one
    if i > 0 and abs(times[i - 1] - t) < abs(times[i] - t):
        i -= 1
    return samples[i][1]


def step_paces(steps: Sequence[StepStats], smooth_s: float = PACE_SMOOTH_S) -> list[float]:
    """Each step's pace, in order: the median of its worker's probes timed within ``smooth_s`` of its start
    (the nearest one when none is); 0.0 for a step whose worker has no probe."""
    samples = probe_samples(steps)
    times = {w: [t for t, _ in s] for w, s in samples.items()}
    return [
        _pace_near(samples[s.worker], times[s.worker], s.started, smooth_s) if s.worker in samples else 0.0
        for s in steps
    ]


def at_reference_pace(steps: Sequence[StepStats], reference: float, smooth_s: float = PACE_SMOOTH_S) -> list[StepStats]:
    """``steps`` with their CPU time (``cpu_s``) priced at the ``reference`` pace: times ``reference`` over
    the step's own pace (``step_paces``). Steps without a probe are returned as they are."""
    if not reference > 0:
        raise ValueError(f"reference pace must be > 0, got {reference!r}")
    return [
        s._replace(cpu_s=s.cpu_s * reference / pace) if pace > 0 else s
        for s, pace in zip(steps, step_paces(steps, smooth_s), strict=True)
    ]
