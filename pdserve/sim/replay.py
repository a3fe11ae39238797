"""Trace replay: drive the simulator with a run's recorded step durations instead of the cost model.

What it checks is the *protocol*: the scheduler, the routing, the prefill admission and the KV
handoff, with the cost model taken out. The requests are sent at the run's recorded send times and
instance ``w``'s ``k``-th step lasts as long as the run's ``k``-th step on ``w``, followed by the
loop's recorded time before its next step when that came at once (the durations already hold the
machine's slowdown and the co-run slowdown, so the replay adds neither). A request whose records show
when its call reached its worker (a prefill worker takes every call in on arrival; a colocated worker
that was idle took it at once; a busy one says when the call came, ``decode_call_time``) reaches that
worker after its recorded call latency, and one whose records show when its decode call reached the
decode worker (the idle worker's next step, or the busy one's ``decode_call_time``) is handed over
after its recorded handoff, and one whose reservation found both workers idle takes its recorded
round trip; the other latencies around the steps stay the config's medians. Where the records give each
worker's step count when it took a request in (its prompt or its remote KV queued, its blocks reserved:
``decode_queued_step``, ``decode_reserved_step``, ``prefill_queued_step``, against the steps' ``step_index``), an
admission the replayed timeline puts within ``tie_window_s`` of the step boundary the run put it behind (by
default the range of the config's measured control-call latencies, p1 to p99, else 5 ms) joins the step the
run recorded: a latency measured to a few milliseconds cannot tell which side of
a boundary it fell, the record can. One further off stays where the timeline puts it, and shows as the
steps that differ; ``alignment`` counts both. Each request is served by
the workers that served it (a burst of requests sent within a millisecond can reach the real router in
another order, and so on other workers); how often the routing policy would have chosen others is
reported, ``routing_agreement``. Then:

- **step agreement**: the share of steps, position by position on each instance, whose composition
  matches the run's. A real worker's step record (``StepStats``) carries the step's prompt and decode
  token counts, its sequences, the keys attended and the cached tokens read: that signature matches
  only when the same chunks of the same prompts and the same decodes share the step (for prompts of
  different lengths). With the run's per-step chunk lists (a simulated run's ``step_chunks``), the
  composition compared is exactly which request computed how many tokens;
- **latency figures**: TTFT and ITL p50 and p99 of the replay against the run's.

Replaying a simulated run reproduces it exactly (``tests/unit/test_sim_replay.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.messages import StepStats
from pdserve.sim.calibrate import recorded_call_latencies, recorded_handoff_latencies, recorded_reserve_latencies
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import ADMISSION_EVENTS, SimResult, Simulator
from pdserve.workload.generator import WorkloadRequest
from pdserve.workload.metrics import RequestRecord, compute_metrics

FIGURES = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
AGREEMENT_TARGET = 0.95
TIE_WINDOW_S = 0.005  # without measured call latencies: how close to a step boundary an admission is a tie
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
    num_requests: int = 0
    rerouted: int = 0  # requests the routing policy, on the replay's view, would have sent elsewhere
    alignment: dict[str, float] = dataclasses.field(default_factory=dict)  # AlignmentTally.to_dict()

    @property
    def routing_agreement(self) -> float:
        """The share of requests the routing policy routed as the real router did (the replay then follows
        the recorded routes: a burst of requests can reach the real router in another order than sent)."""
        return 1 - self.rerouted / self.num_requests if self.num_requests else 1.0

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
            "routing_agreement": self.routing_agreement,
            "replayed_ms": self.replayed,
            "recorded_ms": self.recorded,
            "passed": self.passed,
            "first_mismatches": [list(m) for m in self.mismatches],
            "alignment": self.alignment,
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
    tie_window_s: float | None = None,
) -> ReplayReport:
    """Replay the run that sent ``requests`` (its ``records`` and every worker's ``steps``, named as the
    simulator names instances: ``prefill-0``, ``decode-0``, ...) on that architecture. ``compositions``
    (parallel to ``steps``) compares exact chunk lists instead of step signatures. ``cost_model`` sizes the
    KV (bytes per token for the transfers, the pool's capacity), as in the run, and prices only steps
    beyond the recorded ones; ``time_origin`` is the records' time of the simulator's 0 (default:
    the first send); ``tie_window_s`` (0: off; default ``default_tie_window``) how close to a step boundary an
    admission joins the step its record names. Raises ValueError on a trace that does not fit the
    architecture (an unknown worker name, steps without names, requests without records)."""
    if compositions is not None and len(compositions) != len(steps):
        raise ValueError("replay: compositions must be parallel to steps")
    cfg = replay_config(config)
    if cfg.kv_link_bw is None or cfg.kv_link_latency_s is None:
        raise ValueError("replay: the config must set kv_link_bw and kv_link_latency_s")
    durations = durations_by_worker(steps)
    gaps = gaps_by_worker(steps)
    calls = recorded_call_latencies(steps, records)
    sim = Simulator(
        cost_model,
        cfg,
        mode,
        num_instances,
        num_prefill,
        num_decode,
        step_durations=durations,
        step_gaps=gaps,
        call_latencies=calls,
        handoff_latencies=recorded_handoff_latencies(steps, records),
        routes=recorded_routes(records),
        reserve_latencies=recorded_reserve_latencies(steps, records),
        admission_steps=recorded_admission_steps(records, steps),
        tie_window_s=default_tie_window(config) if tie_window_s is None else tie_window_s,
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
        num_requests=len(requests),
        rerouted=sim.rerouted,
        alignment=sim.alignment.to_dict(),
    )


def recorded_admission_steps(
    records: Sequence[RequestRecord], steps: Sequence[StepStats]
) -> dict[tuple[str, str], tuple[str, int]]:
    """Per request and admission event (``ADMISSION_EVENTS``) whose record gives the worker's step count then,
    ``(worker, that count from the worker's first recorded step of the run)``: the position of the first step
    it could join among that worker's steps. Steps without ``step_index`` count from 0 (a simulated run's)."""
    first: dict[str, int] = {}
    for step in steps:
        index = max(step.step_index, 0)
        first[step.worker] = min(first.get(step.worker, index), index)
    out: dict[tuple[str, str], tuple[str, int]] = {}
    for r in records:
        for event in ADMISSION_EVENTS:
            count = r.meta.get(f"{event}_step")
            worker = str(r.meta.get("prefill_worker" if event.startswith("prefill") else "decode_worker") or "")
            if count is None or int(count) < 0 or worker not in first:
                continue
            out[(r.request_id, event)] = (worker, int(count) - first[worker])
    return out


def default_tie_window(config: SimConfig) -> float:
    """How far apart ``config``'s measured control-call latencies lie (p1 to p99): a replayed call cannot be
    placed closer than that to a step boundary. ``TIE_WINDOW_S`` without them."""
    spread = config.control_latency_percentiles
    return float(spread[99] - spread[1]) if len(spread) == 101 else TIE_WINDOW_S


def recorded_routes(records: Sequence[RequestRecord]) -> dict[str, tuple[str, str]]:
    """Per request whose record names its workers, ``(decode worker, prefill worker or "")``."""
    return {
        r.request_id: (str(r.meta["decode_worker"]), str(r.meta.get("prefill_worker") or ""))
        for r in records
        if r.meta.get("decode_worker")
    }


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


@dataclass(frozen=True)
class RecordedRun:
    """One run of a results file, ready to replay: the architecture, the requests it sent (regenerated
    from the file's workload settings), its records and steps, and, for a simulated run, its simulator
    settings (``None`` for a measured run: the replay then takes the caller's)."""

    name: str
    mode: str
    counts: dict[str, int]
    requests: list[WorkloadRequest]
    records: list[RequestRecord]
    steps: list[StepStats]
    sim_config: SimConfig | None
    time_origin: float | None
    cost_model: str | None = None  # a simulated run's cost model (``CostModel.name``)


def load_recorded_runs(path: str) -> list[RecordedRun]:
    """The runs of a ``results.json`` (or of the directory holding one) that ``pdserve sim`` or
    ``pdserve bench`` wrote with ``--out``: every request's send and token times, every worker's steps,
    the architecture and the workload settings. Raises ValueError for a file that is missing, is not such
    a document, or whose runs lack what a replay needs (steps with worker names, a generated workload
    whose prompts match the records)."""
    import json
    import os

    from pdserve.workload.report import load_results

    file = os.path.join(path, "results.json") if os.path.isdir(path) else path
    try:
        doc, runs = load_results(file)
    except FileNotFoundError:
        raise ValueError(f"--replay: {file}: no such file") from None
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--replay: {file}: not a results.json of pdserve sim or pdserve bench ({e})") from None
    config = doc.get("config") or {}
    spec = _workload_spec(config, file)
    measured = isinstance(config.get("workload"), str)
    output_cap = config.get("max_output") if measured else None  # pdserve bench --max-output
    out = []
    for run in runs:
        if not run.steps:
            raise ValueError(f"--replay: {file}: run {run.name!r} kept no steps (recorded with --no-steps?)")
        meta = dict(run.meta)
        simulated = "sim" in meta and "mode" in meta
        if simulated:
            mode = str(meta["mode"])
            counts = (
                {"num_instances": int(meta["num_instances"])}
                if mode == "colocated"
                else {"num_prefill": int(meta["num_prefill"]), "num_decode": int(meta["num_decode"])}
            )
        elif "architecture" in meta:
            mode = str(meta["architecture"])
            prefill, decode = int(meta.get("prefill_workers") or 0), int(meta.get("decode_workers") or 1)
            counts = (
                {"num_instances": decode} if mode == "colocated" else {"num_prefill": prefill, "num_decode": decode}
            )
        else:
            raise ValueError(f"--replay: {file}: run {run.name!r} does not say its architecture")
        requests = _regenerated(spec, run.records, file, run.name, output_cap)
        sim_config = _sim_config(meta) if simulated else None
        origin = 0.0 if simulated else None  # a simulated run's clock starts at the workload's 0
        out.append(
            RecordedRun(
                run.name,
                mode,
                counts,
                requests,
                list(run.records),
                list(run.steps),
                sim_config,
                origin,
                str(meta["cost_model"]) if simulated and "cost_model" in meta else None,
            )
        )
    if not out:
        raise ValueError(f"--replay: {file}: no runs in it")
    return out


def _workload_spec(config: Mapping[str, Any], file: str) -> Any:
    """The workload settings of a results document: ``pdserve sim``'s spec, or ``pdserve bench``'s arguments."""
    import argparse
    import math

    from pdserve.workload.generator import WorkloadSpec, workload_spec_from_args

    workload = config.get("workload")
    try:
        if isinstance(workload, dict):
            values = {k: v for k, v in workload.items() if k in WorkloadSpec.__dataclass_fields__}
            if values.get("rate") == "inf":
                values["rate"] = math.inf
            return WorkloadSpec(**values)
        if isinstance(workload, str):
            args = argparse.Namespace(**config)
            if args.rate == "inf":
                args.rate = math.inf
            return workload_spec_from_args(args, workload, default_requests=64)  # pdserve bench's default
    except (TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"--replay: {file}: its workload settings cannot be read ({e})") from None
    raise ValueError(f"--replay: {file}: it does not record its workload's settings")


def _regenerated(
    spec: Any, records: Sequence[RequestRecord], file: str, name: str, output_cap: int | None
) -> list[WorkloadRequest]:
    from pdserve.workload.generator import build_workload

    if spec.kind == "sharegpt":
        raise ValueError(f"--replay: {file}: a sharegpt workload cannot be regenerated from its settings")
    requests = build_workload(spec).requests
    if output_cap:
        requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, int(output_cap))) for r in requests]
    lengths = {r.request_id: r.num_prompt_tokens for r in records}
    if {r.request_id for r in requests} != set(lengths) or any(
        lengths[r.request_id] != r.num_prompt_tokens for r in requests
    ):
        raise ValueError(
            f"--replay: {file}: run {name!r}: the workload regenerated from the file's settings is not the one "
            "recorded (other request ids or prompt lengths)"
        )
    return requests


def _sim_config(meta: Mapping[str, Any]) -> SimConfig:
    """A simulated run's ``SimConfig`` (its KV pool and token budget as the run sized them)."""
    recorded = dict(meta["sim"])
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in SimConfig.__dataclass_fields__
    }
    values["num_kv_blocks"] = meta.get("num_kv_blocks", values.get("num_kv_blocks"))
    values["max_num_batched_tokens"] = meta.get("max_num_batched_tokens", values.get("max_num_batched_tokens"))
    return SimConfig(**values)
