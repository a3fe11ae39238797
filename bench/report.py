"""Results directories: ``results.json``, ``report.md`` and PNG plots, from plain data.

Every function takes plain data (``RequestRecord`` lists, step tuples, floats), so simulated runs and
measured runs of the real deployment go through the same code. ``write_report`` is the one call a
runner needs::

    runs = [RunData("colocated", records_a, steps_a), RunData("disaggregated", records_b, steps_b,
            kv_bytes_moved=n)]
    files = write_report("results/ab", runs, config={...}, slo_ms={"ttft": 200, "tpot": 50}, itl_target_ms=50)

Plots (matplotlib, Agg backend): ITL CDF and TTFT CDF per run; a per-step timeline per run (bar height
= step time, each bar split by its share of prefill vs decode tokens, the ITL target as a line);
throughput vs latency (P99 TTFT and P99 TPOT against output throughput); and, when given, the chunk
sweep (P99 ITL vs prefill throughput with the knee for the ITL target) and the P:D search.
Steps may be ``(start, duration, prefill_tokens, decode_tokens[, instance])`` tuples, the simulator's
``StepRecord`` or the engine's ``StepStats``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from pdserve.bench.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    SweepPoint,
    TimelineStep,
    as_timeline_steps,
    compute_metrics,
    find_knee,
)

PREFILL_COLOR = "#7b3fa0"  # the lesson's purple for prefill compute
DECODE_COLOR = "#3b8bc2"


@dataclass(frozen=True)
class RunData:
    """One run of one architecture: what the client recorded, and optionally the engine's steps.

    ``duration_s`` overrides the metrics' first-send-to-last-token duration (e.g. wall time of a
    measured benchmark). ``meta`` is copied into results.json (mode, worker counts, ...).
    ``series`` groups runs into one line of the throughput-vs-latency plot (e.g. one architecture
    at several request rates); default: the run's name.
    """

    name: str
    records: Sequence[RequestRecord]
    steps: Sequence[Any] = ()
    kv_bytes_moved: int | None = None
    duration_s: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    series: str | None = None

    def metrics(self, slo_ms: Mapping[str, float] | None = None) -> BenchmarkMetrics:
        return compute_metrics(self.records, slo_ms or {}, self.duration_s)


@dataclass(frozen=True)
class ReportFiles:
    """Paths that ``write_report`` wrote."""

    out_dir: str
    results_json: str
    report_md: str
    plots: Mapping[str, str]

    def all_paths(self) -> list[str]:
        return [self.results_json, self.report_md, *self.plots.values()]


# ---- tables ----------------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def markdown_table(rows: Sequence[tuple[str, BenchmarkMetrics, int | None]]) -> str:
    """One Markdown table: a row per run ``(name, metrics, kv_bytes_moved or None)``; latencies in ms."""
    head = [
        "run",
        "ok/failed",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "TPOT mean",
        "TPOT p50",
        "TPOT p99",
        "ITL mean",
        "ITL p50",
        "ITL p99",
        "E2E mean",
        "E2E p50",
        "E2E p99",
        "req/s",
        "out tok/s",
        "total tok/s",
        "goodput req/s",
        "SLO met",
        "KV moved",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for name, m, kv in rows:
        cells = [name, f"{m.completed}/{m.failed}"]
        for s in (m.ttft, m.tpot, m.itl, m.e2el):
            cells += [_fmt(s.mean_ms), _fmt(s.p50_ms), _fmt(s.p99_ms)]
        cells += [
            _fmt(m.request_throughput, 2),
            _fmt(m.output_throughput, 0),
            _fmt(m.total_token_throughput, 0),
            _fmt(m.request_goodput, 2),
            "-" if m.slo_attainment is None else f"{100 * m.slo_attainment:.0f}%",
            _bytes(kv),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- plots -----------------------------------------------------------------------------------------------


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


def timeline_window(steps: Sequence[TimelineStep], max_steps: int) -> list[TimelineStep]:
    """At most ``max_steps`` consecutive steps, centred on the longest one (where the story is)."""
    if len(steps) <= max_steps:
        return list(steps)
    worst = max(range(len(steps)), key=lambda i: steps[i].duration)
    lo = min(max(0, worst - max_steps // 2), len(steps) - max_steps)
    return list(steps[lo : lo + max_steps])


def plot_step_timeline(
    steps: Iterable[Any], path: str, itl_target_ms: float | None = None, title: str = "", max_steps: int = 200
) -> str:
    """The lesson's picture: one bar per step (in order), height = step time, split by the step's share
    of prefill vs decode tokens. Shows a window of ``max_steps`` around the longest step."""
    tl = timeline_window(as_timeline_steps(steps), max_steps)
    fig, ax = plt.subplots(figsize=(9, 4))
    if tl:
        x = np.arange(len(tl))
        dur = np.array([s.duration for s in tl]) * 1000.0
        tokens = np.array([max(1, s.prefill_tokens + s.decode_tokens) for s in tl], dtype=float)
        pre = dur * np.array([s.prefill_tokens for s in tl]) / tokens
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
    """Per-GPU figure of merit per architecture (rows with ``name``, ``goodput_per_gpu`` and optional
    ``max_rate_per_gpu``, e.g. ``bench.sim.experiments.PDRow``)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 4))
    names = [r.name for r in rows]
    x = np.arange(len(rows))
    searched = any(getattr(r, "max_rate_per_gpu", None) is not None for r in rows)
    width = 0.4 if searched else 0.6
    ax.bar(
        x - (width / 2 if searched else 0),
        [r.goodput_per_gpu for r in rows],
        width,
        label="goodput per GPU at the workload's rate",
        color=DECODE_COLOR,
    )
    if searched:
        ax.bar(
            x + width / 2,
            [r.max_rate_per_gpu or 0.0 for r in rows],
            width,
            label="max SLO-meeting rate per GPU",
            color=PREFILL_COLOR,
        )
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("requests/s per GPU")
    ax.set_title("Colocated vs P:D splits")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ---- the results directory ------------------------------------------------------------------------------


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return _jsonable(x.to_dict())
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def write_report(
    out_dir: str,
    runs: Sequence[RunData],
    *,
    config: Mapping[str, Any] | None = None,
    slo_ms: Mapping[str, float] | None = None,
    itl_target_ms: float | None = None,
    title: str = "pdserve benchmark",
    sweep: Sequence[SweepPoint] | None = None,
    pd_rows: Sequence[Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
    extra_plots: Mapping[str, str] | None = None,
) -> ReportFiles:
    """Write results.json, report.md and the plots into ``out_dir`` (created if needed).

    ``runs`` may be empty when only a sweep or a P:D search is reported. ``extra`` is stored in
    results.json as is (must be JSON-serialisable or have ``to_dict``); ``notes`` become bullet lines
    in report.md; ``extra_plots`` (name → path of a PNG already written into ``out_dir``) are listed
    with the others. Returns every path written.
    """
    os.makedirs(out_dir, exist_ok=True)
    slo = dict(slo_ms or {})
    metrics = [(run, run.metrics(slo)) for run in runs]
    plots: dict[str, str] = dict(extra_plots or {})
    ttft_target = slo.get("ttft")
    if runs:
        plots["itl_cdf"] = plot_itl_cdf(
            {r.name: [g for rec in r.records if rec.succeeded for g in rec.itls] for r in runs},
            os.path.join(out_dir, "itl_cdf.png"),
            itl_target_ms,
        )
        plots["ttft_cdf"] = plot_ttft_cdf(
            {
                r.name: [rec.ttft for rec in r.records if rec.succeeded]  # type: ignore[misc]
                for r in runs
            },
            os.path.join(out_dir, "ttft_cdf.png"),
            ttft_target,
        )
        series: dict[str, list[tuple[float, float, float]]] = {}
        for r, m in metrics:
            series.setdefault(r.series or r.name, []).append((m.output_throughput, m.ttft.p99_ms, m.tpot.p99_ms))
        plots["throughput_latency"] = plot_throughput_latency(series, os.path.join(out_dir, "throughput_latency.png"))
        for run in runs:
            steps = as_timeline_steps(run.steps)
            if not steps:
                continue
            instances = list(dict.fromkeys(s.instance for s in steps))
            for inst in instances[:2] if len(instances) > 1 else instances:
                inst_steps = [s for s in steps if s.instance == inst]
                label = f"{run.name} {inst}".strip()
                key = f"timeline_{_slug(label)}"
                plots[key] = plot_step_timeline(
                    inst_steps,
                    os.path.join(out_dir, f"{key}.png"),
                    itl_target_ms,
                    f"Per-step timeline: {label}",
                )
    if sweep:
        plots["chunk_sweep"] = plot_chunk_sweep(sweep, os.path.join(out_dir, "chunk_sweep.png"), itl_target_ms)
    if pd_rows:
        plots["pd_search"] = plot_pd_search(pd_rows, os.path.join(out_dir, "pd_search.png"))

    results = {
        "title": title,
        "config": _jsonable(dict(config or {})),
        "slo_ms": slo,
        "itl_target_ms": itl_target_ms,
        "runs": [
            {
                "name": run.name,
                "series": run.series,
                "meta": _jsonable(dict(run.meta)),
                "kv_bytes_moved": run.kv_bytes_moved,
                "duration_s": run.duration_s,
                "metrics": m.to_dict(),
                "requests": [rec.to_dict() for rec in run.records],
                "steps": [s._asdict() for s in as_timeline_steps(run.steps)],
            }
            for run, m in metrics
        ],
        "chunk_sweep": [p.to_dict() for p in sweep] if sweep else None,
        "chunk_sweep_knee": (
            None if not sweep or itl_target_ms is None else _jsonable(find_knee(sweep, itl_target_ms))
        ),
        "pd_search": _jsonable(list(pd_rows)) if pd_rows else None,
        "extra": _jsonable(dict(extra or {})),
        "plots": {k: os.path.basename(v) for k, v in plots.items()},
    }
    results_json = os.path.join(out_dir, "results.json")
    with open(results_json, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")

    md = [f"# {title}", ""]
    if config:
        md += [
            "Config: " + ", ".join(f"`{k}={_jsonable(v)}`" for k, v in config.items() if not isinstance(v, Mapping)),
            "",
        ]
    if slo:
        md += ["SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items()), ""]
    if runs:
        md += [
            "Latencies in ms. Goodput = requests meeting every SLO per second.",
            "",
            markdown_table([(r.name, m, r.kv_bytes_moved) for r, m in metrics]),
            "",
        ]
    if sweep:
        knee = find_knee(sweep, itl_target_ms) if itl_target_ms is not None else None
        md += [
            "## Chunk size sweep",
            "",
            _table(
                [
                    "chunk",
                    "P99 ITL ms (under long prefills)",
                    "P99 ITL ms (whole run)",
                    "max ITL ms",
                    "prefill tok/s",
                    "mean TTFT ms",
                    "P99 TTFT ms",
                ],
                [
                    [
                        str(p.chunk_size),
                        _fmt(p.p99_itl_ms),
                        _fmt(p.p99_itl_all_ms),
                        _fmt(p.max_itl_ms),
                        _fmt(p.prefill_throughput_tok_s, 0),
                        _fmt(p.mean_ttft_ms),
                        _fmt(p.p99_ttft_ms),
                    ]
                    for p in sweep
                ],
            ),
            "",
        ]
        if itl_target_ms is not None:
            md += [
                f"Knee for a {itl_target_ms:g} ms P99 ITL target: "
                + (f"chunk {knee.chunk_size}." if knee else "no chunk size meets it."),
                "",
            ]
    if pd_rows:
        md += [
            "## P:D search",
            "",
            _table(
                [
                    "config",
                    "GPUs",
                    "goodput req/s",
                    "goodput/GPU",
                    "SLO met",
                    "max rate/GPU",
                    "P99 TTFT ms",
                    "P99 TPOT ms",
                    "KV moved",
                ],
                [
                    [
                        r.name,
                        str(r.num_gpus),
                        _fmt(r.goodput, 2),
                        _fmt(r.goodput_per_gpu, 3),
                        f"{100 * r.slo_attainment:.0f}%",
                        _fmt(r.max_rate_per_gpu, 3),
                        _fmt(r.p99_ttft_ms),
                        _fmt(r.p99_tpot_ms),
                        _bytes(r.kv_bytes_moved),
                    ]
                    for r in pd_rows
                ],
            ),
            "",
        ]
    if notes:
        md += [f"- {n}" for n in notes] + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{k}]({os.path.basename(v)})" for k, v in plots.items()] + [""]
    report_md = os.path.join(out_dir, "report.md")
    with open(report_md, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    return ReportFiles(out_dir, results_json, report_md, plots)


def load_results(path: str) -> tuple[dict[str, Any], list[RunData]]:
    """Read a results.json back: the raw document and its runs as ``RunData``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    runs = [
        RunData(
            r["name"],
            [RequestRecord.from_dict(d) for d in r["requests"]],
            [TimelineStep(**s) for s in r.get("steps", [])],
            r.get("kv_bytes_moved"),
            duration_s=r.get("duration_s"),
            meta=r.get("meta") or {},
            series=r.get("series"),
        )
        for r in doc.get("runs", [])
    ]
    return doc, runs
