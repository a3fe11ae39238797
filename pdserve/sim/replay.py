"""Trace replay: drive the simulator with a run's recorded step durations instead of the cost model.

What it checks is the *protocol*: the scheduler, the routing, the prefill admission and the KV
handoff, with the cost model taken out. The requests are sent at the run's recorded send times and
instance ``w``'s ``k``-th step lasts as long as the run's ``k``-th step on ``w``, followed by the
loop's recorded time before its next step when that came at once (the durations already hold the
machine's slowdown and the co-run slowdown, so the replay adds neither; the other latencies around the
steps stay the config's medians). Then:

- **step agreement**: the share of steps, position by position on each instance, whose composition
  matches the run's. A real worker's step record (``StepStats``) carries the step's prompt and decode
  token counts, its sequences, the keys attended and the cached tokens read: that signature matches
  only when the same chunks of the same prompts and the same decodes share the step (for prompts of
  different lengths). With the run's per-step chunk lists (a simulated run's ``step_chunks``), the
  composition compared is exactly which request computed how many tokens;
- **latency figures**: TTFT and ITL p50 and p99 of the replay against the run's.

Replaying a simulated run reproduces it exactly (``tests/test_sim_replay.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.workloads import WorkloadRequest
from pdserve.messages import StepStats
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import SimResult, Simulator

FIGURES = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
AGREEMENT_TARGET = 0.95
BUSY_GAP_S = 0.05  # a pause between two steps shorter than this is the loop's own work, not idle time
P50_TOLERANCE = 0.10

Composition = tuple[tuple[str, int], ...]


def step_signature(step: StepStats) -> tuple[int, ...]:
    """What a step record says of its composition: prompt and decode tokens, sequences, keys attended
    (all and by decodes), cached tokens read."""
    return (
        step.num_prefill_tokens,
        step.num_decode_tokens,
        step.num_seqs,
        step.num_context_tokens,
        step.num_decode_context_tokens,
        step.num_kv_read_tokens,
    )


def latency_figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    m = compute_metrics(records)
    return {"TTFT p50": m.ttft.p50_ms, "TTFT p99": m.ttft.p99_ms, "ITL p50": m.itl.p50_ms, "ITL p99": m.itl.p99_ms}


def arrivals_from_records(
    requests: Sequence[WorkloadRequest], records: Sequence[RequestRecord], time_origin: float | None = None
) -> list[WorkloadRequest]:
    """``requests`` sent when the run sent them: arrival offsets from the records' send times, relative
    to ``time_origin`` (default: the first send). Raises ValueError when a request has no record."""
    sent = {r.request_id: r.send_time for r in records}
    missing = [r.request_id for r in requests if r.request_id not in sent]
    if missing:
        raise ValueError(f"replay: no record of request(s) {', '.join(missing[:5])}")
    t0 = min(sent[r.request_id] for r in requests) if time_origin is None else time_origin
    return [dataclasses.replace(r, arrival_offset_s=sent[r.request_id] - t0) for r in requests]


def _by_worker(steps: Sequence[StepStats]) -> dict[str, list[StepStats]]:
    by_worker: dict[str, list[StepStats]] = {}
    for step in steps:
        if not step.worker:
            raise ValueError("replay: every recorded step needs its worker's name")
        by_worker.setdefault(step.worker, []).append(step)
    return {w: sorted(ss, key=lambda s: s.started) for w, ss in by_worker.items()}


def durations_by_worker(steps: Sequence[StepStats]) -> dict[str, list[float]]:
    """Each worker's recorded step durations in the order it ran them. Raises ValueError for a step
    without a worker name."""
    return {w: [s.duration_s for s in ss] for w, ss in _by_worker(steps).items()}


def gaps_by_worker(steps: Sequence[StepStats], busy_within_s: float = BUSY_GAP_S) -> dict[str, list[float | None]]:
    """After each recorded step, the loop's time before the worker's next one when that came within
    ``busy_within_s`` (the loop's own work between steps); None after a longer pause (the worker was idle)
    and after the last step."""
    out: dict[str, list[float | None]] = {}
    for w, ss in _by_worker(steps).items():
        gaps: list[float | None] = []
        for a, b in itertools.pairwise(ss):
            gap = b.started - a.ended
            gaps.append(max(gap, 0.0) if gap < busy_within_s else None)
        out[w] = [*gaps, None]
    return out


@dataclass(frozen=True)
class ReplayReport:
    """A replay against the run it replays."""

    result: SimResult
    num_steps: int  # positions compared: per worker the longer of the two step sequences
    num_matched: int
    unreplayed_steps: int  # replayed steps past a worker's recorded ones (priced by the cost model)
    replayed: dict[str, float]  # FIGURES of the replay, ms
    recorded: dict[str, float]  # FIGURES of the run, ms
    mismatches: tuple[tuple[str, int], ...] = ()  # (worker, position) of the first steps that differ

    @property
    def step_agreement(self) -> float:
        return self.num_matched / self.num_steps if self.num_steps else 1.0

    def error(self, figure: str) -> float:
        real = self.recorded[figure]
        return (self.replayed[figure] - real) / real if real else float("inf")

    @property
    def passed(self) -> bool:
        """Step agreement >= 95 % and TTFT p50 and ITL p50 within 10 % of the run's."""
        p50s = ("TTFT p50", "ITL p50")
        return self.step_agreement >= AGREEMENT_TARGET and all(abs(self.error(f)) <= P50_TOLERANCE for f in p50s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_matched": self.num_matched,
            "step_agreement": self.step_agreement,
            "unreplayed_steps": self.unreplayed_steps,
            "replayed_ms": self.replayed,
            "recorded_ms": self.recorded,
            "passed": self.passed,
            "first_mismatches": [list(m) for m in self.mismatches],
        }


def replay_config(config: SimConfig) -> SimConfig:
    """``config`` for a replay: no slowdown draws and no co-run slowdown (recorded durations hold both)."""
    return dataclasses.replace(config, step_tail=False, co_run_slowdown=0.0)


def replay(
    requests: Sequence[WorkloadRequest],
    records: Sequence[RequestRecord],
    steps: Sequence[StepStats],
    cost_model: CostModel,
    config: SimConfig,
    *,
    mode: str = "colocated",
    num_instances: int = 1,
    num_prefill: int = 1,
    num_decode: int = 1,
    compositions: Sequence[Composition] | None = None,
    time_origin: float | None = None,
) -> ReplayReport:
    """Replay the run that sent ``requests`` (its ``records`` and every worker's ``steps``, named as the
    simulator names instances: ``prefill-0``, ``decode-0``, ...) on that architecture. ``compositions``
    (parallel to ``steps``) compares exact chunk lists instead of step signatures. ``cost_model`` sizes the
    KV (bytes per token for the transfers, the pool's capacity), as in the run, and prices only steps
    beyond the recorded ones; ``time_origin`` is the records' time of the simulator's 0 (default:
    the first send). Raises ValueError on a trace that does not fit the
    architecture (an unknown worker name, steps without names, requests without records)."""
    if compositions is not None and len(compositions) != len(steps):
        raise ValueError("replay: compositions must be parallel to steps")
    cfg = replay_config(config)
    if cfg.kv_link_bw is None or cfg.kv_link_latency_s is None:
        raise ValueError("replay: the config must set kv_link_bw and kv_link_latency_s")
    durations = durations_by_worker(steps)
    gaps = gaps_by_worker(steps)
    sim = Simulator(
        cost_model, cfg, mode, num_instances, num_prefill, num_decode, step_durations=durations, step_gaps=gaps
    )
    result = sim.run(arrivals_from_records(requests, records, time_origin))
    unknown = sorted(set(durations) - set(result.instances))
    if unknown:
        raise ValueError(
            f"replay: the run has workers {', '.join(unknown)} that a {mode} deployment of this size lacks"
        )
    matched, total, mismatches = _agreement(steps, compositions, result)
    return ReplayReport(
        result=result,
        num_steps=total,
        num_matched=matched,
        unreplayed_steps=sim.unreplayed_steps,
        replayed=latency_figures(result.records),
        recorded=latency_figures(records),
        mismatches=tuple(mismatches[:20]),
    )


def _agreement(
    steps: Sequence[StepStats], compositions: Sequence[Composition] | None, result: SimResult
) -> tuple[int, int, list[tuple[str, int]]]:
    recorded: dict[str, list[Any]] = {}
    order = sorted(range(len(steps)), key=lambda i: steps[i].started)
    for i in order:
        key = compositions[i] if compositions is not None else step_signature(steps[i])
        recorded.setdefault(steps[i].worker, []).append(key)
    replayed: dict[str, list[Any]] = {}
    for step, chunks in zip(result.steps, result.step_chunks, strict=True):
        replayed.setdefault(step.worker, []).append(chunks if compositions is not None else step_signature(step))
    matched = total = 0
    mismatches: list[tuple[str, int]] = []
    for worker in sorted(set(recorded) | set(replayed)):
        real, sim = recorded.get(worker, []), replayed.get(worker, [])
        total += max(len(real), len(sim))
        for k, (a, b) in enumerate(zip(real, sim, strict=False)):
            if a == b:
                matched += 1
            else:
                mismatches.append((worker, k))
    return matched, total, mismatches


def replay_simulated(
    result: SimResult,
    requests: Sequence[WorkloadRequest],
    cost_model: CostModel,
    config: SimConfig,
    counts: Mapping[str, int],
) -> ReplayReport:
    """Replay a simulated run (its records, steps and exact compositions) on its own architecture."""
    return replay(
        requests,
        result.records,
        result.steps,
        cost_model,
        config,
        mode=result.mode,
        compositions=result.step_chunks,
        time_origin=0.0,
        **counts,
    )
