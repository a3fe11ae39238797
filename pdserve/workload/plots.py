"""The benchmark plots (matplotlib, Agg backend), from plain data; each function writes one PNG and
returns its path.

ITL and TTFT CDFs per run; a per-step timeline (bar height = step time, each bar split by its share of
prefill vs decode tokens, the ITL target as a line); throughput against latency; the chunk sweep (P99 ITL
against prefill throughput, the knee for the ITL target marked); the P:D search. Steps are
``pdserve.messages.StepStats``, measured or simulated.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pdserve.messages import StepStats
from pdserve.workload.metrics import SweepPoint, find_knee

PREFILL_COLOR = "#7b3fa0"  # the lesson's purple for prefill compute
DECODE_COLOR = "#3b8bc2"


def _save(fig: Any, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdf(
    samples_s: Mapping[str, Sequence[float]],
    path: str,
    title: str,
    xlabel: str,
    target_ms: float | None = None,
) -> str:
    """Empirical CDF per series (values in seconds, plotted in ms); a dashed line at ``target_ms``."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in samples_s.items():
        if not len(values):
            continue
        x = np.sort(np.asarray(values, dtype=float)) * 1000.0
        y = np.arange(1, len(x) + 1) / len(x)
        ax.step(x, y, where="post", label=f"{name} (n={len(x)})")
    if target_ms is not None:
        ax.axvline(target_ms, color="red", linestyle="--", linewidth=1, label=f"target {target_ms:g} ms")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_itl_cdf(itl_s: Mapping[str, Sequence[float]], path: str, target_ms: float | None = None) -> str:
    """ITL CDF per architecture (every inter-token gap, seconds)."""
    return plot_cdf(itl_s, path, "Inter-token latency", "ITL (ms)", target_ms)


def plot_ttft_cdf(ttft_s: Mapping[str, Sequence[float]], path: str, target_ms: float | None = None) -> str:
    """TTFT CDF per architecture (seconds)."""
    return plot_cdf(ttft_s, path, "Time to first token", "TTFT (ms)", target_ms)


def timeline_window(steps: Sequence[StepStats], max_steps: int) -> list[StepStats]:
    """At most ``max_steps`` consecutive steps, centred on the longest one (where the story is)."""
    if len(steps) <= max_steps:
        return list(steps)
    worst = max(range(len(steps)), key=lambda i: steps[i].duration_s)
    lo = min(max(0, worst - max_steps // 2), len(steps) - max_steps)
    return list(steps[lo : lo + max_steps])


def plot_step_timeline(
    steps: Iterable[StepStats], path: str, itl_target_ms: float | None = None, title: str = "", max_steps: int = 200
) -> str:
    """The lesson's picture: one bar per step (in order), height = step time, split by the step's share
    of prefill vs decode tokens. Shows a window of ``max_steps`` around the longest step."""
    tl = timeline_window(sorted(steps, key=lambda s: s.started), max_steps)
    fig, ax = plt.subplots(figsize=(9, 4))
    if tl:
        x = np.arange(len(tl))
        dur = np.array([s.duration_s for s in tl]) * 1000.0
        tokens = np.array([max(1, s.num_prefill_tokens + s.num_decode_tokens) for s in tl], dtype=float)
        pre = dur * np.array([s.num_prefill_tokens for s in tl]) / tokens
        ax.bar(x, pre, width=0.85, color=PREFILL_COLOR, label="prefill tokens' share")
        ax.bar(x, dur - pre, width=0.85, bottom=pre, color=DECODE_COLOR, label="decode tokens' share")
    if itl_target_ms is not None:
        ax.axhline(itl_target_ms, color="red", linestyle="--", linewidth=1, label=f"ITL target {itl_target_ms:g} ms")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title or "Per-step timeline")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput_latency(series: Mapping[str, Sequence[tuple[float, float, float]]], path: str) -> str:
    """Latency against throughput: per series, points ``(output tok/s, P99 TTFT ms, P99 TPOT ms)``
    (several points per series, e.g. a rate sweep, are joined by a line)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in series.items():
        pts = sorted(pts)
        xs = [p[0] for p in pts]
        for ax, idx in zip(axes, (1, 2), strict=True):
            ax.plot(xs, [p[idx] for p in pts], marker="o", label=name)
    for ax, what in zip(axes, ("P99 TTFT (ms)", "P99 TPOT (ms)"), strict=True):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput vs latency")
    return _save(fig, path)


def plot_chunk_sweep(points: Sequence[SweepPoint], path: str, itl_target_ms: float | None = None) -> str:
    """P99 ITL against prefill throughput, one point per chunk size; the knee for the target is marked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sorted(points, key=lambda p: p.chunk_size)
    ax.plot(
        [p.prefill_throughput_tok_s for p in pts],
        [p.p99_itl_ms for p in pts],
        marker="o",
        color=PREFILL_COLOR,
    )
    for p in pts:
        ax.annotate(
            str(p.chunk_size),
            (p.prefill_throughput_tok_s, p.p99_itl_ms),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    if itl_target_ms is not None:
        ax.axhline(itl_target_ms, color="red", linestyle="--", linewidth=1, label=f"ITL target {itl_target_ms:g} ms")
        knee = find_knee(pts, itl_target_ms)
        if knee is not None:
            ax.scatter(
                [knee.prefill_throughput_tok_s],
                [knee.p99_itl_ms],
                s=160,
                facecolors="none",
                edgecolors="red",
                linewidths=2,
                zorder=5,
                label=f"knee: chunk {knee.chunk_size}",
            )
    ax.set_xlabel("prefill throughput (tok/s of prefill-carrying steps)")
    ax.set_ylabel("P99 ITL (ms)")
    ax.set_title("Chunk size sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_pd_search(rows: Sequence[Any], path: str) -> str:
    """Per-GPU figures of merit per architecture (rows with ``name``, ``request_goodput_per_gpu`` and
    ``goodput_per_gpu``, None when not searched, e.g. ``sim.experiments.PDRow``)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 4))
    names = [r.name for r in rows]
    x = np.arange(len(rows))
    searched = any(getattr(r, "goodput_per_gpu", None) is not None for r in rows)
    width = 0.4 if searched else 0.6
    ax.bar(
        x - (width / 2 if searched else 0),
        [r.request_goodput_per_gpu for r in rows],
        width,
        label="SLO-attaining req/s per GPU at the workload's rate",
        color=DECODE_COLOR,
    )
    if searched:
        ax.bar(
            x + width / 2,
            [r.goodput_per_gpu or 0.0 for r in rows],
            width,
            label="goodput per GPU (rate search)",
            color=PREFILL_COLOR,
        )
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("requests/s per GPU")
    ax.set_title("Colocated vs P:D splits")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_fit_residuals(points: Mapping[str, Sequence[tuple[float, float]]], path: str) -> str:
    """Measured against predicted step time per role (``(predicted_s, measured_s)`` pairs, log-log): the
    calibration fit's residuals. On the diagonal the fit is exact; above it a step ran slower."""
    fig, ax = plt.subplots(figsize=(6.5, 5))
    lo, hi = float("inf"), 0.0
    for role, pts in points.items():
        if not pts:
            continue
        x = np.array([p[0] for p in pts]) * 1000.0
        y = np.array([p[1] for p in pts]) * 1000.0
        ax.scatter(x, y, s=8, alpha=0.5, label=f"{role} (n={len(pts)})")
        lo, hi = min(lo, x.min(), y.min()), max(hi, x.max(), y.max())
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title("Step-time fit: residuals per role")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)
