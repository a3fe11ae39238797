"""Fit the linear step-time model to measured steps of our own engine (the ``cpu-measured`` profile).

Model (seconds)::

    duration = fixed_overhead + per_prefill_token * prefill_tokens + per_decode_token * decode_tokens
               + per_context_token * context_tokens

where ``context_tokens`` sums, over every token of the step, the keys it attends to
(``bench.sim.cost_model.chunk_context_tokens``). ``fit_linear_profile`` solves it by least
squares (numpy, on relative errors) with every constant kept >= 0 (a coefficient that comes out
negative is fixed at 0 and the rest refitted), trimming steps slowed down by other load on the
machine. ``measure_step_records`` produces the records by driving a real
``engine.LLMEngine`` through a grid of batch shapes with ``engine.step()``, reading
``engine.step_history`` (duration) and ``engine.last_output.chunks`` (the shape) after every step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from pdserve.bench.sim.cost_model import StepShape
from pdserve.bench.sim.profiles import LinearProfile

if TYPE_CHECKING:
    from pdserve.engine import LLMEngine


class MeasuredStep(NamedTuple):
    """One step's shape and its measured duration."""

    num_prefill_tokens: int
    num_decode_tokens: int
    context_tokens: int
    duration_s: float


COEFFICIENTS = ("fixed_overhead_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s")


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of the *relative* error (rows weighted by 1/y: timing noise is proportional to
    the step time), every coefficient >= 0: drop the most negative one and refit until none is."""
    w = 1.0 / np.maximum(y, 1e-12)
    xw, yw = x * w[:, None], y * w
    active = list(range(x.shape[1]))
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


def fit_linear_profile(
    records: Sequence[MeasuredStep | tuple[int, int, int, float]],
    model: str = "bench",
    trim_slow: float | None = 0.5,
    **extra: object,
) -> LinearProfile:
    """Fit the four non-negative constants by least squares on relative errors. Needs >= 4 records.

    ``trim_slow``: noise on a shared CPU only ever makes a step slower, so records more than this
    fraction slower than the current fit are dropped and the fit repeated (a few rounds, keeping at
    least half of the records). ``None`` fits all records once. The quality figures (``r2``,
    ``rms_residual_s``, ``mean_abs_rel_error``) are over the kept records; ``num_records`` counts them.
    Raises ValueError when there are too few records. ``extra`` goes into the profile (e.g. ``notes``).
    """
    if len(records) < 4:
        raise ValueError(f"calibration: need at least 4 step records, got {len(records)}")
    data = np.asarray([tuple(r) for r in records], dtype=float)
    x_all = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]])
    y_all = data[:, 3]
    keep = np.ones(len(data), dtype=bool)
    coef = _nonneg_lstsq(x_all, y_all)
    for _ in range(5 if trim_slow is not None else 0):
        pred = x_all @ coef
        new_keep = (y_all - pred) <= trim_slow * np.maximum(pred, 1e-12)  # type: ignore[operator]
        if new_keep.sum() < max(4, len(data) // 2) or np.array_equal(new_keep, keep):
            break
        keep = new_keep
        coef = _nonneg_lstsq(x_all[keep], y_all[keep])
    x, y = x_all[keep], y_all[keep]
    resid = y - x @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else 1.0
    rel = float(np.mean(np.abs(resid) / np.maximum(y, 1e-12)))
    return LinearProfile(
        model=model,
        **dict(zip(COEFFICIENTS, (float(c) for c in coef), strict=True)),
        num_records=int(keep.sum()),
        rms_residual_s=float(np.sqrt(np.mean(resid**2))),
        r2=r2,
        mean_abs_rel_error=rel,
        **extra,
    )  # type: ignore[arg-type]


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
            decode_contexts=(32,),
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
) -> list[MeasuredStep]:
    """Run a real ``engine.LLMEngine(EngineConfig(model=...))`` through ``grid``; one record per step."""
    from pdserve.engine import SamplingParams

    grid = grid or CalibrationGrid()
    rng = random.Random(seed)
    engine = _calibration_engine(model, grid, seed, torch_threads)
    records: list[MeasuredStep] = []
    deadline = time.monotonic() + grid.time_budget_s

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    def step(keep: bool = True) -> None:
        engine.step()
        out = engine.last_output
        if not keep or out is None or not out.chunks:
            return
        stats = engine.step_history[-1]
        shape = StepShape.from_output(out)
        records.append(MeasuredStep(shape.prefill_tokens, shape.decode_tokens, shape.context_tokens, stats.duration_s))

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
    """Measure, fit, and (when ``out_path`` is given) write the cpu-measured profile JSON."""
    from pdserve.bench.sim.profiles import save_linear_profile

    t0 = time.monotonic()
    records = measure_step_records(model, grid, seed, torch_threads, progress)
    profile = fit_linear_profile(
        records,
        model=model,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        notes=f"{len(records)} steps of engine preset {model!r} measured in {time.monotonic() - t0:.1f} s",
    )
    if out_path:
        save_linear_profile(profile, out_path)
    return profile
