"""Validate the simulator against the real system on this machine.

1. Measure: one deployment per architecture (colocated: 2 decode workers; disaggregated and auto:
   1 prefill + 1 decode worker; no prefix caching, and each repeat's token ids shifted, so that neither
   the workers' caches nor the router's prefix view treat a repeat differently from the first run),
   warmed up, serves each validation workload ``--repeats`` times (3), and between two
   repeats each *calibration* workload (the same kinds, other requests: another seed each time). Every
   request's client timestamps and every worker's steps are kept (``measured.json``), each step with the
   worker's latest pace probe (``engine.pace_probe``, every 0.5 s). A run whose client sent a request
   more than ``LATE_SEND_S`` behind its schedule ran while the machine stood still: it is measured again.
2. Calibrate the ``cpu-measured`` profile from the calibration runs only: per role (colocated, prefill,
   decode worker) a linear step-time fit with separate prefill and decode terms (the typical step
   alone; decode attention priced by the keys the engine's padding makes it read, each decode's context
   read off the requests' token times), the slowdown while both workers run steps at once, the
   machine's slowdown per 0.1 s window inside a run at the median run's level (the tail that other
   load on 2 shared cores adds; the simulator replays a draw of it, shared by all workers), the token
   delivery and control-call latencies, the reservation's round trip and the prefill-to-decode handoff
   between a disaggregated deployment's workers, and the engine loop's gap between steps (``sim.calibrate``).
3. Three checks, each able to catch its own kind of error, on the *validation* runs only:

   - **check 1, cost model per step, out of sample**: every validation step priced by its role's fit
     (times the co-run slowdown for how much another worker ran meanwhile); per role (colocated,
     prefill, decode) and step kind (prefill-only, decode-only, mixed) with at least 30 steps, the
     median of measured/predicted and the median and p90 absolute relative error. Pass: median ratio
     within ±5 % and median error ≤ 10 %. On three clocks: the steps' CPU time (``StepStats.cpu_s``, the
     stepping thread's; every worker runs 1 torch thread) priced at the calibration runs' pace as the
     workers' probes measured it around each step (``sim.pace``), against a fit of the calibration
     steps' CPU time so priced; their CPU time as measured against a fit of the calibration runs' CPU
     time; their wall-clock time against the ``cpu-measured`` profile's fit. The verdict is the first
     clock's the steps recorded (the machine's pace, and the time other processes held a worker's core,
     are not properties of the step's shape); the simulator itself uses the wall-clock profile;
   - **check 2, protocol by trace replay** (``sim.replay``): each validation run replayed with its own
     recorded step durations and send times (and each request's call latency and handoff where its
     records show them); the step agreement (share of steps, position by position
     per worker, whose composition matches) and TTFT p50 and ITL p50 of the replay against the run.
     Pass: agreement ≥ 95 % and both p50s within 10 %, for every run;
   - **check 3, end to end**: each workload on each architecture simulated ``--sim-runs`` times (one
     seed of the slowdown draws each); the median of each figure against the median of the measured
     repeats. Pass: p50 figures within 10 % or inside the measured spread (min–max), p99 within 20 % or
     inside the spread. Beside it, not counted in the verdict: each figure simulated at the measured
     repeats' own levels (how fast the machine ran in each, ``simulated_at_levels``), and the levels.

    flock -x /tmp/pdserve-ray.lock python benchmarks/validate_sim.py [--repeats 3] [--out results/validate]
    python benchmarks/validate_sim.py --measured results/validate/measured.json   # re-simulate, no Ray

Writes ``validation.md``, ``checks.json``, ``measured.json``, ``profile.json`` and (when the steps carry
their CPU time) ``profile_cpu.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from pdserve.messages import Mode, StepStats
from pdserve.transport_config import TRANSPORTS
from pdserve.workload.generator import TOKEN_ID_HIGH, WorkloadRequest, WorkloadSpec, build_workload
from pdserve.workload.metrics import RequestRecord, compute_metrics

ARCHITECTURES = tuple(Mode)
FIGURES = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
TOLERANCE = 0.10  # check 3: p50 figures
P99_TOLERANCE = 0.20  # check 3: p99 figures
MIN_STEPS = 30  # check 1: a role x kind with fewer validation steps is not judged
RATIO_TOLERANCE = 0.05  # check 1: median measured/predicted within 1 +- this
STEP_ERROR_TOLERANCE = 0.10  # check 1: median absolute relative error
# check 1's clocks, the verdict's first: the steps' CPU time at the reference pace of the workers' probes, their
# CPU time as measured, their wall-clock time (each one the verdict when the steps record it and not the one before)
CLOCKS = ("paced", "cpu", "wall")
TABLE_MIN_STEPS = 5  # check 1's same-shape table: a shape needs this many calibration steps to have an entry
TABLE_SLACK = 0.01  # check 1 against the table: the model's median error at most the table's plus this
PACE_PROBE_INTERVAL_S = 0.5  # the workers time their pace probe this often (s; about 2 ms each: 0.4 % of a core)
# A run whose client sent a request this far behind its schedule ran while the whole machine stood still (on a
# VM, the host's doing: no process ran, the client included); it is measured again, at most REMEASURE_LIMIT times
LATE_SEND_S = 0.5
REMEASURE_LIMIT = 2


class Run(NamedTuple):
    """One measured run of one workload on one architecture."""

    purpose: str  # "calibration" or "validation"
    workload: str
    architecture: str
    repeat: int
    records: list[RequestRecord]
    steps: list[StepStats]
    load: float  # 1-minute load average when the run ended
    discarded: tuple[float, ...] = ()  # the send lateness (s) of each attempt measured again (``send_lateness``)

    def to_dict(self) -> dict[str, Any]:
        d = self._asdict()
        d["records"] = [r.to_dict() for r in self.records]
        d["steps"] = [s._asdict() for s in self.steps]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Run:
        records = [RequestRecord.from_dict(r) for r in d["records"]]
        steps = [StepStats(**s) for s in d["steps"]]
        discarded = tuple(d.get("discarded", ()))
        return Run(d["purpose"], d["workload"], d["architecture"], d["repeat"], records, steps, d["load"], discarded)


def send_lateness(requests: Sequence[WorkloadRequest], records: Sequence[RequestRecord]) -> float:
    """How far behind its schedule the client sent its latest request, in seconds: each record's send time
    against its request's arrival offset, from the run's start (the earliest send less its offset). A few
    milliseconds on a working machine; seconds when the machine stood still and nothing ran."""
    offsets = {q.request_id: q.arrival_offset_s for q in requests}
    sent = [(r.send_time, offsets[r.request_id]) for r in records if r.request_id in offsets]
    if not sent:
        return 0.0
    start = min(t - offset for t, offset in sent)
    return max(t - offset - start for t, offset in sent)


def calibration_seed(args: argparse.Namespace, repeat: int) -> int:
    """The seed of the calibration workloads measured after validation repeat ``repeat``."""
    return args.seed + 1000 * (repeat + 1)


def run_requests(args: argparse.Namespace, run: Run) -> list[WorkloadRequest]:
    """The requests ``run`` sent: its repeat of the validation workload, or the calibration workload of its
    seed (as ``measure_all`` plans them)."""
    if run.purpose == "validation":
        return workloads(args, args.seed, repeat=run.repeat)[run.workload]
    return workloads(args, calibration_seed(args, run.repeat))[run.workload]


MEASUREMENT_ARGUMENTS = (
    "model",
    "transport",
    "chunk",
    "repeats",
    "streams",
    "stream_output",
    "long_prompts",
    "long_len",
    "long_period",
    "random_requests",
    "rate",
    "seed",
)  # what a measurement was made with: a re-check simulates the workloads the runs served


def measured_arguments(args: argparse.Namespace, measured: dict[str, Any]) -> argparse.Namespace:
    """``args`` with the measurement's own settings (``MEASUREMENT_ARGUMENTS``, from its ``measured.json``) in
    place of the command line's: a re-check of runs measured under other defaults simulates what they served."""
    taken = {k: measured[k] for k in MEASUREMENT_ARGUMENTS if k in measured and measured[k] != getattr(args, k)}
    if taken:
        print("re-checking with the measurement's settings: " + ", ".join(f"{k}={v}" for k, v in taken.items()))
    return argparse.Namespace(**{**vars(args), **taken})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench", choices=["tiny", "bench"])
    p.add_argument("--transport", default="nixl", choices=TRANSPORTS)
    p.add_argument("--chunk", type=int, default=256, help="token budget per step (max_num_batched_tokens)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each workload and architecture")
    p.add_argument("--streams", type=int, default=10)
    p.add_argument("--stream-output", type=int, default=64)
    p.add_argument("--long-prompts", type=int, default=40, help="interference: long prompts (with the streams, >= 50)")
    p.add_argument("--long-len", type=int, default=512)
    p.add_argument(
        "--long-period",
        type=float,
        default=0.7,
        help="interference: seconds between long prompts (the default keeps a prefill worker below saturation)",
    )
    p.add_argument("--random-requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measured", default=None, help="a measured.json to re-simulate (no deployment is started)")
    p.add_argument("--no-tail", action="store_true", help="simulate without the measured step-time tail")
    p.add_argument(
        "--tie-window-ms",
        type=float,
        default=None,
        help="check 2: an admission this close to a step boundary joins the step its worker recorded (0: off; "
        "default: the calibration's control-call latency range, p1 to p99)",
    )
    p.add_argument("--sim-runs", type=int, default=9, help="simulated runs per figure (seeds; the median is compared)")
    p.add_argument("--out", default=os.path.join("results", "validate"))
    return p


def workloads(args: argparse.Namespace, seed: int, repeat: int = 0) -> dict[str, list[WorkloadRequest]]:
    """The two validation workloads (the calibration ones use another seed). ``repeat`` > 0 shifts every
    token id: the same lengths and arrival times, but prompts the router has not seen, so that its prefix
    view (which remembers what it sent where, caching or not) does not route a repeat differently."""
    interference = WorkloadSpec(
        kind="interference",
        num_requests=args.long_prompts,
        num_streams=args.streams,
        stream_prompt_len=64,
        stream_output_len=args.stream_output,
        long_prompt_len=args.long_len,
        long_output_len=8,
        long_period_s=args.long_period,
        long_start_s=0.5,
        seed=seed,
    )
    random_spec = WorkloadSpec(
        kind="random",
        num_requests=args.random_requests,
        rate=args.rate,
        seed=seed,
        prompt_len_mean=256,
        prompt_len_max=1024,
        output_len_mean=40,
        output_len_max=96,
    )
    built = {"interference": build_workload(interference).requests, "random": build_workload(random_spec).requests}
    return {name: [shift_tokens(r, 37 * repeat) for r in reqs] for name, reqs in built.items()}


def shift_tokens(request: WorkloadRequest, offset: int) -> WorkloadRequest:
    """The same request with every token id moved by ``offset`` (mod the byte vocabulary)."""
    if not offset:
        return request
    ids = [(t + offset) % TOKEN_ID_HIGH for t in request.prompt_token_ids]
    return dataclasses.replace(request, prompt_token_ids=ids)


def bench_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """``pdserve bench``'s arguments for the deployments: 2 workers of 1 torch thread, this chunk, no
    prefix caching (the repeats send the same prompts again)."""
    from pdserve.bench.runner import build_parser as bench_parser

    argv = ["--model", args.model, "--prefill-workers", "1", "--decode-workers", "1", "--transport", args.transport]
    argv += ["--max-num-batched-tokens", str(args.chunk), "--torch-threads", "1", "--no-progress", "--warmup", "6"]
    argv += ["--no-prefix-caching"]  # a repeat must not find the previous repeat's prompts in the cache
    argv += ["--pace-probe-interval-s", str(PACE_PROBE_INTERVAL_S)]  # the machine's pace beside every step
    return bench_parser().parse_args(argv)


def measure_all(args: argparse.Namespace, say: Any = print) -> list[Run]:
    """Every measured run: per architecture one deployment, warmed up, then the validation workloads
    ``args.repeats`` times each, and between two repeats the calibration workloads (another seed each
    time), so that calibration and validation sample the same stretch of the machine's load."""
    from pdserve.bench.runner import deployed, engine_config, measure, warmup_requests

    bench_args = bench_arguments(args)
    engine = engine_config(bench_args)
    validation = [workloads(args, args.seed, repeat=i) for i in range(args.repeats)]
    calibration = [workloads(args, calibration_seed(args, k)) for k in range(max(1, args.repeats - 1))]
    runs: list[Run] = []
    for arch in ARCHITECTURES:
        with deployed(arch, bench_args, engine) as (address, _):
            warm = warmup_requests(bench_args.warmup, args.seed)
            plan = []
            for i in range(args.repeats):
                plan += [("validation", name, i, reqs) for name, reqs in validation[i].items()]
                if i < len(calibration):  # between the repeats: calibration and validation share the load
                    plan += [("calibration", name, i, reqs) for name, reqs in calibration[i].items()]
            for purpose, name, repeat, requests in plan:
                discarded: list[float] = []
                while True:
                    run = measure(address, requests, None, warmup=warm, progress=False)
                    warm = []
                    late = send_lateness(requests, run.records)
                    if late <= LATE_SEND_S or len(discarded) >= REMEASURE_LIMIT:
                        break
                    discarded.append(late)
                    say(
                        f"  {arch:>13} {purpose:>11} {name:>12} #{repeat}: the client sent a request {late:.1f} s "
                        "behind schedule (the machine stood still): measuring it again"
                    )
                load = os.getloadavg()[0]
                runs.append(Run(purpose, name, arch, repeat, run.records, run.steps, load, tuple(discarded)))
                failed = sum(1 for r in run.records if not r.succeeded)
                say(f"  {arch:>13} {purpose:>11} {name:>12} #{repeat}: {run.duration_s:5.1f} s, {failed} failed")
    return runs


def validation_runs(runs: Sequence[Run], workload: str, architecture: str) -> list[Run]:
    return [r for r in runs if r.purpose == "validation" and (r.workload, r.architecture) == (workload, architecture)]


def figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    m = compute_metrics(records)
    return {"TTFT p50": m.ttft.p50_ms, "TTFT p99": m.ttft.p99_ms, "ITL p50": m.itl.p50_ms, "ITL p99": m.itl.p99_ms}


class Row(NamedTuple):
    """One figure: simulated, the measured median and spread, and the verdict."""

    workload: str
    architecture: str
    figure: str
    simulated: float
    median: float
    low: float
    high: float
    at_level: float | None = None  # simulated with each repeat's own level (``simulated_at_levels``)
    levels: tuple[float, ...] = ()  # the measured repeats' levels (``run_level_of``)
    values: tuple[float, ...] = ()  # the measured repeats' figures, in repeat order

    @property
    def error(self) -> float:
        return self._error(self.simulated)

    @property
    def inside_spread(self) -> bool:
        return self.low <= self.simulated <= self.high

    @property
    def tolerance(self) -> float:
        return P99_TOLERANCE if self.figure.endswith("p99") else TOLERANCE

    @property
    def ok(self) -> bool:
        return self._passes(self.simulated)

    @property
    def error_at_level(self) -> float | None:
        return None if self.at_level is None else self._error(self.at_level)

    @property
    def ok_at_level(self) -> bool | None:
        """The same verdict for the figure simulated at the repeats' own levels; None when not simulated."""
        return None if self.at_level is None else self._passes(self.at_level)

    def _error(self, simulated: float) -> float:
        return (simulated - self.median) / self.median if self.median else float("inf")

    def _passes(self, simulated: float) -> bool:
        return abs(self._error(simulated)) <= self.tolerance or self.low <= simulated <= self.high

    def held_out(self) -> tuple[float, float] | None:
        """The rerun baseline of this figure (``rerun_baseline``): the share of the measured repeats that pass
        this figure's verdict against the other repeats (their median and spread), each held out in turn,
        and the share of those same references the simulated figure passes. None with fewer than 3 repeats."""
        if len(self.values) < 3:
            return None
        repeat = simulated = 0
        for i, value in enumerate(self.values):
            others = self.values[:i] + self.values[i + 1 :]
            reference = self._replace(median=statistics.median(others), low=min(others), high=max(others))
            repeat += reference._passes(value)
            simulated += reference._passes(self.simulated)
        return repeat / len(self.values), simulated / len(self.values)


def rerun_baseline(rows: Sequence[Row]) -> tuple[float, float] | None:
    """Check 3 against what the machine allows: over every figure, how many a measured repeat passes when it
    is taken as the prediction and judged against the other repeats (each held out in turn; averaged), and
    how many the simulated figures pass against those same references. A simulator that passes as many as a
    rerun of the real system predicts the figures as well as they can be measured here. None without 3
    repeats of every figure."""
    each = [r.held_out() for r in rows]
    if not each or any(e is None for e in each):
        return None
    return sum(e[0] for e in each if e), sum(e[1] for e in each if e)


def compare(args: argparse.Namespace, runs: Sequence[Run], profile: Any, say: Any = print) -> list[Row]:
    """Simulate every validation workload on every architecture; one Row per figure."""
    from pdserve.bench.runner import engine_config
    from pdserve.sim.config import SimConfig
    from pdserve.sim.cost_model import LinearCostModel
    from pdserve.sim.profiles import get_model

    engine = engine_config(bench_arguments(args))
    config = SimConfig.from_engine_config(engine, **profile.sim_settings(), step_tail=not args.no_tail)
    cost = LinearCostModel(profile, get_model(args.model))
    rows = []
    for name, requests in workloads(args, args.seed).items():
        for arch in ARCHITECTURES:
            sim = simulated_figures(requests, cost, config, arch, args.sim_runs)
            repeats = validation_runs(runs, name, arch)
            levels = tuple(v for v in (run_level_of(r, profile, engine.block_size) for r in repeats) if v is not None)
            at_level = simulated_at_levels(requests, cost, config, arch, levels, profile, args.sim_runs)
            measured = [figures(r.records) for r in repeats]
            for key in FIGURES:
                values = [m[key] for m in measured]
                median, low, high = statistics.median(values), min(values), max(values)
                level_figure = None if at_level is None else at_level[key]
                rows.append(Row(name, arch, key, sim[key], median, low, high, level_figure, levels, tuple(values)))
            say(
                f"{name:>12} {arch:>13}: "
                + "  ".join(f"{r.figure} {r.simulated:6.1f}/{r.median:6.1f}" for r in rows[-4:])
            )
    return rows


def simulated_figures(
    requests: Sequence[WorkloadRequest], cost: Any, config: Any, architecture: str, runs: int
) -> dict[str, float]:
    """Each figure's median over ``runs`` simulated runs of ``requests``, one per seed of the machine's
    slowdown draws (``SimConfig.seed`` 0, 1, ...): the simulated side of the comparison is, like the
    measured one, the median of repeats, not one draw of the machine's bursts."""
    results = [
        simulated_run(requests, cost, dataclasses.replace(config, seed=seed), architecture) for seed in range(runs)
    ]
    return {key: statistics.median(r[key] for r in results) for key in FIGURES}


def simulated_run(requests: Sequence[WorkloadRequest], cost: Any, config: Any, architecture: str) -> dict[str, float]:
    """The figures of one simulated run of ``requests`` on ``architecture``, as validate_sim deploys it
    (colocated: 2 instances; else 1 prefill + 1 decode instance)."""
    from pdserve.sim.simulator import simulate

    counts = {"num_instances": 2} if architecture == "colocated" else {"num_prefill": 1, "num_decode": 1}
    return figures(simulate(requests, cost, config, mode=architecture, **counts).records)


def run_level_of(run: Run, profile: Any, block_size: int) -> float | None:
    """How fast the machine ran during ``run``: its steps' measured duration over ``profile``'s price of
    them (``sim.calibrate.run_level``, each step's shape and co-run fraction as check 1 reads them)."""
    from pdserve.sim.calibrate import co_run_fractions, run_level, step_shapes

    shapes = step_shapes(run.steps, run.records, block_size)
    return run_level(profile, run.architecture, run.steps, shapes, co_run_fractions(run.steps))


def simulated_at_levels(
    requests: Sequence[WorkloadRequest],
    cost: Any,
    config: Any,
    architecture: str,
    levels: Sequence[float],
    profile: Any,
    runs: int,
) -> dict[str, float] | None:
    """Each figure's median over simulated runs of ``requests`` at the measured repeats' own ``levels``: for
    each level, ``runs`` // len(levels) seeds (at least one) of the machine's slowdown draws with the
    per-window slowdowns rescaled from the calibration's median run level to that level. The simulator's
    end-to-end error once the machine's pace during each measured run is known; None without slowdown
    draws to rescale (``--no-tail``, or a profile without a measured tail) or without levels.

    Check 3 prices every run at the calibration runs' median level, so a repeat that happened to run 10 %
    faster than the calibration runs (a shared machine's pace drifts over tens of seconds) misses by
    that much whatever the simulator does; at its own level it misses only by what the simulator gets
    wrong: protocol, per-shape prices, the tail within a run. A level is one number per run, so a
    wrong relation between the step kinds, or a wrong protocol, still shows."""
    from pdserve.sim.profiles import quantile_at

    typical = quantile_at(profile.run_slowdown_percentiles, 0.5, 0.0)
    if not (levels and typical > 0 and config.step_tail and config.slowdown_percentiles):
        return None
    results = []
    for level in levels:
        windows = tuple(w * level / typical for w in config.slowdown_percentiles)
        for seed in range(max(1, runs // len(levels))):
            at = dataclasses.replace(config, slowdown_percentiles=windows, seed=seed)
            results.append(simulated_run(requests, cost, at, architecture))
    return {key: statistics.median(r[key] for r in results) for key in FIGURES}


def probe_reference(runs: Sequence[Run]) -> float | None:
    """The calibration runs' median pace probe (``sim.pace.reference_pace``): the pace the profiles fitted on
    them hold; None unless every step of every run carries a probe timing."""
    from pdserve.sim.pace import pace_recorded, reference_pace

    if not pace_recorded(s for r in runs for s in r.steps):
        return None
    return reference_pace(s for r in runs if r.purpose == "calibration" for s in r.steps)


def at_probe_pace(runs: Sequence[Run], reference: float) -> list[Run]:
    """``runs`` with every step's CPU time priced at the ``reference`` pace (``sim.pace.at_reference_pace``)."""
    from pdserve.sim.pace import at_reference_pace

    return [r._replace(steps=at_reference_pace(r.steps, reference)) for r in runs]


class StepCheckRow(NamedTuple):
    """Check 1 for one role x step kind over the validation runs, on one clock."""

    role: str
    kind: str
    num_steps: int
    median_ratio: float  # measured / predicted
    median_error: float  # |measured - predicted| / predicted
    p90_error: float
    clock: str = "wall"  # "wall": duration_s against the wall-clock fit; "cpu": cpu_s against the CPU-time fit
    # the steps whose shape the calibration runs hold at least TABLE_MIN_STEPS times: the median error there
    # of the same-shape table (each step priced at its shape's median in the calibration runs) and the model's
    table_steps: int = 0
    table_error: float = math.nan
    model_table_error: float = math.nan
    table_ratio: float = math.nan  # the table's median measured/predicted there (the runs' level against calibration)

    @property
    def judged(self) -> bool:
        return self.num_steps >= MIN_STEPS

    @property
    def ok(self) -> bool:
        return abs(self.median_ratio - 1) <= RATIO_TOLERANCE and self.median_error <= STEP_ERROR_TOLERANCE

    @property
    def ok_against_table(self) -> bool:
        """The criterion bounded by the machine's own spread: the median ratio within ±5 % and the median
        error ≤ 10 %, each unless, on the steps the same-shape table prices (at least ``MIN_STEPS``), the
        table was as far off (its ratio from 1, its error) to within ``TABLE_SLACK``: no function of the
        shape alone did better out of sample."""
        tabled = self.table_steps >= MIN_STEPS
        if abs(self.median_ratio - 1) > RATIO_TOLERANCE and not (
            tabled and abs(self.median_ratio - 1) <= abs(self.table_ratio - 1) + TABLE_SLACK
        ):
            return False
        if self.median_error <= STEP_ERROR_TOLERANCE:
            return True
        return tabled and self.model_table_error <= self.table_error + TABLE_SLACK


def check_steps(runs: Sequence[Run], profile: Any, block_size: int, clock: str = "wall") -> list[StepCheckRow]:
    """Check 1 on one clock: every validation step priced by its role's fit times ``1 + k * co-run fraction``
    (the co-run fraction from the steps' wall-clock overlap either way). ``clock`` "wall": each step's
    ``duration_s`` against ``profile``, the wall-clock fit; "cpu": its ``cpu_s`` against ``profile``, the
    CPU-time fit (``sim.calibrate.calibrate_cpu_time``); no rows when a validation step has no CPU time."""
    import numpy as np

    from pdserve.sim.calibrate import cpu_time_recorded
    from pdserve.sim.cost_model import linear_features

    if clock not in ("cpu", "wall"):
        raise ValueError(f"check 1: clock must be cpu or wall, got {clock!r}")
    validation = [r for r in runs if r.purpose == "validation"]
    if clock == "cpu" and (profile is None or not cpu_time_recorded(s for r in validation for s in r.steps)):
        return []

    def measured(step: StepStats) -> float:
        return step.cpu_s if clock == "cpu" else step.duration_s

    table = same_shape_table([r for r in runs if r.purpose == "calibration"], profile, block_size, measured)
    ratios: dict[tuple[str, str], list[float]] = {}
    tabled: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (model's ratio, table's ratio)
    for step, shape, co_run, role in shaped_steps(validation, block_size):
        factor = 1 + profile.co_run_slowdown * co_run
        ratio = measured(step) / max(profile.fit_for(role).predict(linear_features(shape)) * factor, 1e-12)
        ratios.setdefault((role, shape.kind), []).append(ratio)
        entry = table.get(shape_key(role, shape))
        if entry is not None:
            tabled.setdefault((role, shape.kind), []).append((ratio, measured(step) / (entry * factor)))
    rows = []
    from pdserve.sim.cost_model import ROLES, STEP_KINDS

    for role in ROLES:
        for kind in STEP_KINDS:
            values = np.asarray(ratios.get((role, kind), []))
            if not len(values):
                continue
            errors = np.abs(values - 1)
            pairs = np.asarray(tabled.get((role, kind), [])).reshape(-1, 2)
            rows.append(
                StepCheckRow(
                    role,
                    kind,
                    len(values),
                    float(np.median(values)),
                    float(np.median(errors)),
                    float(np.percentile(errors, 90)),
                    clock,
                    len(pairs),
                    float(np.median(np.abs(pairs[:, 1] - 1))) if len(pairs) else math.nan,
                    float(np.median(np.abs(pairs[:, 0] - 1))) if len(pairs) else math.nan,
                    float(np.median(pairs[:, 1])) if len(pairs) else math.nan,
                )
            )
    return rows


def shape_key(role: str, shape: Any) -> tuple[Any, ...]:
    """Which steps the same-shape table takes as one shape: the same role and token counts, and the decode
    keys, the prefill context and the cached prefix read each in the same 10 % band (attention is a part
    of a step's time: 10 % more keys cost a few per cent more)."""

    def band(x: int) -> int:
        return int(math.log1p(x) / math.log(1.1))

    return (
        role,
        shape.prefill_tokens,
        shape.decode_tokens,
        band(shape.decode_keys),
        band(shape.prefill_context_tokens),
        band(shape.prefill_kv_read_tokens),
    )


def same_shape_table(
    calibration: Sequence[Run], profile: Any, block_size: int, measured: Any
) -> dict[tuple[Any, ...], float]:
    """The best a function of the step's shape alone could do, fitted out of sample: per ``shape_key``
    seen at least ``TABLE_MIN_STEPS`` times in the calibration runs, the median of ``measured(step)`` there,
    taken alone (divided by the co-run slowdown as the fit is)."""
    seen: dict[tuple[Any, ...], list[float]] = {}
    for step, shape, co_run, role in shaped_steps(calibration, block_size):
        seen.setdefault(shape_key(role, shape), []).append(measured(step) / (1 + profile.co_run_slowdown * co_run))
    return {k: statistics.median(v) for k, v in seen.items() if len(v) >= TABLE_MIN_STEPS}


def shaped_steps(runs: Sequence[Run], block_size: int) -> Iterator[tuple[StepStats, Any, float, str]]:
    """Every step of ``runs`` with its shape (``sim.calibrate.step_shapes``), its co-run fraction and its role."""
    from pdserve.sim.calibrate import co_run_fractions, step_role, step_shapes

    for run in runs:
        shapes = step_shapes(run.steps, run.records, block_size)
        for step, shape, co_run in zip(run.steps, shapes, co_run_fractions(run.steps), strict=True):
            yield step, shape, co_run, step_role(step.worker, run.architecture)


def check_steps_at_pace(runs: Sequence[Run], block_size: int, model: str) -> list[StepCheckRow]:
    """Check 1 on the steps' CPU time priced at the calibration runs' probed pace (clock "paced"): every
    step of every run at the reference pace (``at_probe_pace``), the CPU-time profile fitted again on the
    calibration runs so priced, and the validation runs checked against it. No rows without probes or
    CPU time."""
    from pdserve.sim.calibrate import calibrate_cpu_time

    reference = probe_reference(runs)
    if reference is None:
        return []
    paced = at_probe_pace(runs, reference)
    calibration = [(r.architecture, r.steps, r.records) for r in paced if r.purpose == "calibration"]
    profile = calibrate_cpu_time(calibration, model=model, block_size=block_size)
    return [row._replace(clock="paced") for row in check_steps(paced, profile, block_size, clock="cpu")]


def verdict_rows(step_rows: Sequence[StepCheckRow]) -> list[StepCheckRow]:
    """The rows check 1's verdict is taken on, the first clock of ``CLOCKS`` the steps recorded: their CPU
    time at the probes' reference pace (the same shape costs more CPU time on a shared machine while
    its other guests are busy; the probe measures that apart from the steps), their CPU time (a step's
    wall-clock time also holds the time other processes held its core, which is not a property of its
    shape), else the wall clock."""
    for clock in CLOCKS:
        rows = [r for r in step_rows if r.clock == clock]
        if rows:
            return rows
    return []


class ReplayRow(NamedTuple):
    """Check 2 for one validation run."""

    workload: str
    architecture: str
    repeat: int
    report: Any  # sim.replay.ReplayReport
    tie_window_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.report.passed)


def check_replay(args: argparse.Namespace, runs: Sequence[Run], profile: Any) -> list[ReplayRow]:
    """Check 2: every validation run replayed with its own step durations and send times."""
    from pdserve.bench.runner import engine_config
    from pdserve.sim.config import SimConfig
    from pdserve.sim.cost_model import LinearCostModel
    from pdserve.sim.profiles import get_model
    from pdserve.sim.replay import default_tie_window, replay

    engine = engine_config(bench_arguments(args))
    config = SimConfig.from_engine_config(engine, **profile.sim_settings())
    cost = LinearCostModel(profile, get_model(args.model))
    rows = []
    window = default_tie_window(config) if args.tie_window_ms is None else max(0.0, args.tie_window_ms / 1e3)
    for run in runs:
        if run.purpose != "validation":
            continue
        requests = run_requests(args, run)
        instances = 2 if run.architecture == "colocated" else 1
        report = replay(
            requests,
            run.records,
            run.steps,
            cost,
            config,
            mode=run.architecture,
            num_instances=instances,
            num_prefill=1,
            num_decode=1,
            tie_window_s=window,
        )
        rows.append(ReplayRow(run.workload, run.architecture, run.repeat, report, window))
    return rows


CLOCK_NAMES = {"paced": "CPU time at the probes' pace", "cpu": "CPU time", "wall": "wall clock"}


def step_table(rows: Sequence[StepCheckRow]) -> str:
    """Check 1's table: per role x step kind the columns of every clock recorded (``CLOCKS``), each with its
    verdict; the verdict that counts is the first clock's (``verdict_rows``)."""
    by_clock = {c: {(r.role, r.kind): r for r in rows if r.clock == c} for c in CLOCKS}
    shown = [c for c in CLOCKS if by_clock[c]]
    judged = shown[0] if shown else "wall"
    judged_on = CLOCK_NAMES[judged]
    columns = "median measured/predicted | median error | p90 error | verdict | "
    head = "".join(f"{CLOCK_NAMES[c]}: {columns}" for c in shown)
    lines = [
        f"| role | step kind | steps | {head}"
        f"same-shape table ({judged_on}): steps, its median ratio and error, the model's error there | "
        "against the table |",
        "|---|---|---:|" + "---:|---:|---:|---|" * len(shown) + "---|---|",
    ]

    def cells(r: StepCheckRow | None, counts: bool) -> str:
        if r is None:
            return "not recorded | – | – | –"
        verdict = ("pass" if r.ok else "**fail**") if r.judged else f"not judged (< {MIN_STEPS} steps)"
        if r.judged and not counts:
            verdict = f"({verdict})"
        return f"{r.median_ratio:.3f} | {r.median_error:.1%} | {r.p90_error:.1%} | {verdict}"

    def against_table(r: StepCheckRow | None) -> str:
        if r is None or not r.table_steps:
            return "no same-shape steps | –"
        verdict = ("pass" if r.ok_against_table else "**fail**") if r.judged else "not judged"
        return f"{r.table_steps}, {r.table_ratio:.3f}, {r.table_error:.1%}, {r.model_table_error:.1%} | {verdict}"

    keys = list(dict.fromkeys(k for c in shown for k in by_clock[c]))
    for key in keys:
        first = next(by_clock[c][key] for c in shown if key in by_clock[c])
        row = " | ".join(cells(by_clock[c].get(key), c == judged) for c in shown)
        lines.append(
            f"| {first.role} | {first.kind} | {first.num_steps} | {row} | {against_table(by_clock[judged].get(key))} |"
        )
    reasons = {
        "paced": " (the same shape costs more CPU time while a shared machine's other guests are busy: each step's "
        "CPU time is priced at the calibration runs' pace, as the workers' probe measured it around the step, "
        "and the CPU-time profile fitted again on the calibration steps so priced)",
        "cpu": " (a step's wall-clock time also holds the time other processes held its core, which is not a "
        "property of its shape)",
        "wall": ": the steps carry no CPU time",
    }
    note = f"The verdict is taken on {judged_on}{reasons[judged]}" + (
        "; the verdicts in parentheses do not count." if len(shown) > 1 else "."
    )
    note += (
        " The same-shape table prices each validation step at the median of the calibration runs' steps of "
        f"its shape (at least {TABLE_MIN_STEPS} of them): the best a function of the shape alone did out of "
        "sample. Against the table, a row passes with its median ratio within ±5 % and its median error ≤ 10 %, "
        f"each unless the table was as far off on the steps it prices (to within {TABLE_SLACK:.0%})."
    )
    return "\n".join(lines) + "\n\n" + note


def replay_table(rows: Sequence[ReplayRow]) -> str:
    lines = [
        "| workload | architecture | repeat | steps | step agreement | TTFT p50 replay/real ms | "
        "ITL p50 replay/real ms | verdict | routed as the real router did | "
        "admissions: at the timeline's step / moved to the recorded one (max ms) / off by more |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        rep = r.report
        lines.append(
            f"| {r.workload} | {r.architecture} | {r.repeat} | {rep.num_steps} | {rep.step_agreement:.1%} | "
            f"{rep.replayed['TTFT p50']:.1f}/{rep.recorded['TTFT p50']:.1f} | "
            f"{rep.replayed['ITL p50']:.1f}/{rep.recorded['ITL p50']:.1f} | {'pass' if r.ok else '**fail**'} | "
            f"{rep.routing_agreement:.0%} | {_alignment_cell(rep.alignment)} |"
        )
    note = (
        "The replay serves each request on the workers the run served it on; the last column is the share the "
        "routing policy, on the replay's view, would have sent there itself (requests sent within a millisecond "
        "can reach the real router in another order). The last one counts the requests' admissions (a prompt "
        "or its remote KV queued on a worker, blocks reserved on the decode worker) against the step counts the "
        "workers recorded: those the replayed timeline put within the tie window "
        f"({1e3 * (rows[0].tie_window_s if rows else 0.0):.1f} ms: the calibration's control-call latencies, p1 "
        "to p99, unless --tie-window-ms says otherwise) of the recorded step boundary joined the recorded step."
    )
    return "\n".join(lines) + "\n\n" + note


def _alignment_cell(alignment: dict[str, float]) -> str:
    if not alignment.get("events"):
        return "not recorded"
    a = alignment
    return f"{a['on_time']:.0f} / {a['moved']:.0f} ({a['moved_max_ms']:.1f}) / {a['off']:.0f}"


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | architecture | figure | simulated ms | measured ms (median) | measured spread | error | "
        "verdict | simulated at the repeats' levels: ms, error, verdict |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        within = f"within {r.tolerance:.0%}"
        verdict = within if abs(r.error) <= r.tolerance else ("inside spread" if r.inside_spread else "**miss**")
        at_level = "–"
        if r.at_level is not None:
            at_level = f"{r.at_level:.1f}, {r.error_at_level:+.0%}, {'pass' if r.ok_at_level else '**miss**'}"
        lines.append(
            f"| {r.workload} | {r.architecture} | {r.figure} | {r.simulated:.1f} | {r.median:.1f} | "
            f"{r.low:.1f}–{r.high:.1f} | {r.error:+.0%} | {verdict} | {at_level} |"
        )
    paces = {(r.workload, r.architecture): r.levels for r in rows if r.levels}
    if paces:
        each = "; ".join(f"{w} {a} {' / '.join(f'{v:.2f}' for v in levels)}" for (w, a), levels in paces.items())
        lines.append(
            "\nEach measured repeat's level, its steps' measured time over the profile's price of them (the "
            f"simulated runs above are priced at the calibration runs' median level): {each}."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pdserve.sim.calibrate import calibrate_cpu_time, calibrate_from_runs, describe_profile
    from pdserve.sim.profiles import save_linear_profile

    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    if args.measured:
        with open(args.measured, encoding="utf-8") as f:
            doc = json.load(f)
        runs = [Run.from_dict(d) for d in doc["runs"]]
        args = measured_arguments(args, doc.get("args", {}))
    else:
        import ray

        print("measuring: one deployment per architecture, calibration then validation runs ...", flush=True)
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            runs = measure_all(args)
        finally:
            ray.shutdown()
        doc = {"args": vars(args), "measured_s": time.monotonic() - t0, "runs": [r.to_dict() for r in runs]}
        with open(os.path.join(args.out, "measured.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f)
    from pdserve.bench.runner import engine_config

    calibration = [(r.architecture, r.steps, r.records) for r in runs if r.purpose == "calibration"]
    block_size = engine_config(bench_arguments(args)).block_size
    notes = "in place: the calibration runs of validate_sim"
    profile = calibrate_from_runs(calibration, model=args.model, block_size=block_size, notes=notes)
    save_linear_profile(profile, os.path.join(args.out, "profile.json"))
    plot_residuals(args, runs, profile)
    print(describe_profile(profile), flush=True)
    cpu_profile = calibrate_cpu_time(calibration, model=args.model, block_size=block_size)
    if cpu_profile is None:
        print("the steps carry no CPU time: check 1 on wall-clock time only", flush=True)
    else:
        save_linear_profile(cpu_profile, os.path.join(args.out, "profile_cpu.json"))
        print(describe_profile(cpu_profile, fits_only=True), flush=True)
    step_rows = check_steps_at_pace(runs, block_size, args.model)
    step_rows += check_steps(runs, cpu_profile, block_size, clock="cpu") + check_steps(runs, profile, block_size)
    replay_rows = check_replay(args, runs, profile)
    rows = compare(args, runs, profile)
    return report(args, runs, (step_rows, replay_rows, rows), doc.get("measured_s", 0.0), time.monotonic() - t0)


def plot_residuals(args: argparse.Namespace, runs: Sequence[Run], profile: Any) -> str:
    """``fit_residuals.png``: measured against predicted step time of every calibration step, per role."""
    from pdserve.bench.runner import engine_config
    from pdserve.sim.calibrate import residuals, step_role, step_shapes
    from pdserve.sim.cost_model import StepShape
    from pdserve.workload.plots import plot_fit_residuals

    block_size = engine_config(bench_arguments(args)).block_size
    by_role: dict[str, list[StepStats]] = {}
    shapes: dict[str, list[StepShape]] = {}
    for r in runs:
        if r.purpose == "calibration":
            for s, shape in zip(r.steps, step_shapes(r.steps, r.records, block_size), strict=True):
                by_role.setdefault(step_role(s.worker, r.architecture), []).append(s)
                shapes.setdefault(step_role(s.worker, r.architecture), []).append(shape)
    return plot_fit_residuals(residuals(profile, by_role, shapes), os.path.join(args.out, "fit_residuals.png"))


def check_summary(step_rows: Sequence[StepCheckRow], replay_rows: Sequence[ReplayRow], rows: Sequence[Row]) -> dict:
    """Each check's pass count and verdict; check 1's on the first clock recorded (``verdict_rows``), with
    the other clocks' counts beside it (``other_clock_passed``: the next clock's); check 3's with the counts
    simulated at the repeats' own levels."""
    counted = verdict_rows(step_rows)
    judged = [r for r in counted if r.judged]
    clock = counted[0].clock if counted else "wall"
    others = {
        c: sum(r.ok for r in step_rows if r.clock == c and r.judged)
        for c in CLOCKS
        if c != clock and any(r.clock == c and r.judged for r in step_rows)
    }
    return {
        "check 1 (cost model per step)": {
            "passed": sum(r.ok for r in judged),
            "of": len(judged),
            "ok": bool(judged) and all(r.ok for r in judged),
            "clock": clock,
            "other_clock_passed": next(iter(others.values()), None),
            "other_clocks_passed": others,
            "passed_against_table": sum(r.ok_against_table for r in judged),
        },
        "check 2 (trace replay)": {
            "passed": sum(r.ok for r in replay_rows),
            "of": len(replay_rows),
            "ok": bool(replay_rows) and all(r.ok for r in replay_rows),
        },
        "check 3 (end to end)": {
            "passed": sum(r.ok for r in rows),
            "of": len(rows),
            "ok": all(r.ok for r in rows),
            "passed_at_levels": sum(bool(r.ok_at_level) for r in rows)
            if rows and all(r.at_level is not None for r in rows)
            else None,
            "rerun_baseline": rerun_baseline(rows),
        },
    }


def _verdict_note(verdict: dict[str, Any]) -> str:
    """Check 1's verdict line: which clock it was judged on, and the other clocks' counts; check 3's: the
    count at the repeats' own levels and the rerun baseline (``rerun_baseline``)."""
    if verdict.get("passed_at_levels") is not None or verdict.get("rerun_baseline") is not None:
        notes = []
        if verdict.get("passed_at_levels") is not None:
            notes.append(f"{verdict['passed_at_levels']} of {verdict['of']} simulated at the repeats' own levels")
        if verdict.get("rerun_baseline") is not None:
            repeat, simulated = verdict["rerun_baseline"]
            notes.append(
                f"against two repeats, each third held out in turn: a measured repeat passes {repeat:.1f} of "
                f"{verdict['of']}, the simulated figures {simulated:.1f}"
            )
        return f" ({'; '.join(notes)})"
    if "clock" not in verdict:
        return ""
    judged_on = CLOCK_NAMES[verdict["clock"]]
    others = verdict.get("other_clocks_passed") or {}
    if not others:
        return f" on {judged_on}" + (" (no CPU time recorded)" if verdict["clock"] == "wall" else "")
    each = [f"{n} of {verdict['of']} on {CLOCK_NAMES[c]}" for c, n in others.items()]
    table = verdict.get("passed_against_table")
    if table is not None:
        each.append(f"{table} of {verdict['of']} against the same-shape table")
    return f" on {judged_on} ({'; '.join(each)})"


def stood_still_note(args: argparse.Namespace, runs: Sequence[Run]) -> str:
    """Which runs were measured again because the machine stood still, and which runs kept show it still
    (the client sent a request more than ``LATE_SEND_S`` behind its schedule; in a measurement made before
    the runs were checked for it, or one measured again ``REMEASURE_LIMIT`` times)."""
    again = [(r, late) for r in runs for late in r.discarded]
    kept = [(r, send_lateness(run_requests(args, r), r.records)) for r in runs]
    stood = [(r, late) for r, late in kept if late > LATE_SEND_S]

    def name(r: Run) -> str:
        return f"{r.purpose} {r.workload} {r.architecture} #{r.repeat}"

    note = (
        f"Runs whose client sent a request more than {LATE_SEND_S:g} s behind its schedule (the machine stood "
        f"still) are measured again: {len(again)}"
        + (" (" + "; ".join(f"{name(r)}, {late:.1f} s" for r, late in again) + ")" if again else "")
        + f". Largest lateness of the runs kept: {max((late for _, late in kept), default=0.0) * 1e3:.0f} ms"
    )
    if stood:
        note += "; **kept although the machine stood still**: " + "; ".join(
            f"{name(r)}, {late:.1f} s" for r, late in stood
        )
    return note + "."


def report(
    args: argparse.Namespace,
    runs: Sequence[Run],
    checks: tuple[Sequence[StepCheckRow], Sequence[ReplayRow], Sequence[Row]],
    measured_s: float,
    total_s: float,
) -> int:
    """Write ``validation.md`` and ``checks.json``; 0 when all three checks pass, else 1."""
    step_rows, replay_rows, rows = checks
    summary = check_summary(step_rows, replay_rows, rows)
    loads = [r.load for r in runs]
    context = (
        f"load average during the runs {min(loads):.1f}–{max(loads):.1f} (median {statistics.median(loads):.1f}) "
        f"on {os.cpu_count()} cores; measured in {measured_s:.0f} s, {total_s:.0f} s in all"
    )
    context += "\n\n" + stood_still_note(args, runs)
    verdicts = "\n".join(
        f"- {name}: {v['passed']} of {v['of']} pass{_verdict_note(v)}: **{'pass' if v['ok'] else 'fail'}**"
        for name, v in summary.items()
    )
    text = (
        f"## Check 1: cost model per step (validation runs)\n\n{step_table(step_rows)}\n\n"
        f"## Check 2: protocol by trace replay\n\n{replay_table(replay_rows)}\n\n"
        f"## Check 3: end to end\n\n{table(rows)}\n\n## Verdicts\n\n{verdicts}\n\n{context}\n"
    )
    with open(os.path.join(args.out, "validation.md"), "w", encoding="utf-8") as f:
        f.write(f"# Simulator vs measured ({args.model}, chunk budget {args.chunk}, {args.transport})\n\n{text}")
    doc = {
        "summary": summary,
        "check1": [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r._asdict().items()}
            for r in step_rows
        ],
        "check2": [{**r._asdict(), "report": r.report.to_dict()} for r in replay_rows],
        "check3": [r._asdict() for r in rows],
    }
    with open(os.path.join(args.out, "checks.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print("\n" + text)
    return 0 if all(v["ok"] for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
