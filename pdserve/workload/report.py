"""Results directories: ``results.json``, ``report.md`` and PNG plots, from plain data.

Every function takes plain data (``RequestRecord`` lists, ``StepStats`` lists, floats), so simulated
runs and measured runs of the real deployment go through the same code. ``write_report`` is the one call a
runner needs::

    runs = [RunData("colocated", records_a, steps_a), RunData("disaggregated", records_b, steps_b,
            kv_bytes_moved=n)]
    files = write_report("results/ab", runs, config={...}, slo_ms={"ttft": 200, "tpot": 50}, itl_target_ms=50)

The plots are ``bench.plots``': ITL and TTFT CDFs, throughput vs latency and a per-step timeline of
each run's instances (the first two), and, when given, the chunk sweep and the P:D search.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdserve.messages import StepStats
from pdserve.workload.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    SweepPoint,
    compute_metrics,
    find_knee,
    itl_values,
    ttft_values,
)
from pdserve.workload.plots import (
    plot_chunk_sweep,
    plot_itl_cdf,
    plot_pd_search,
    plot_step_timeline,
    plot_throughput_latency,
    plot_ttft_cdf,
)
from pdserve.workload.spread import Spread, differences, spread_table, summarize


@dataclass(frozen=True)
class RunData:
    """One run of one architecture: what the client recorded, and optionally the engine's steps.

    ``duration_s`` overrides the metrics' first-send-to-last-token duration (e.g. wall time of a
    measured benchmark). ``meta`` is copied into results.json (mode, worker counts, ...).
    ``series`` groups runs into one line of the throughput-vs-latency plot (e.g. one architecture
    at several request rates); default: the run's name. Runs with the same ``group`` are repeats of
    one configuration: the report adds each figure's median and spread, and the differences between
    groups that exceed the spread (``bench.spread``); the CDF plots pool a group's repeats.
    """

    name: str
    records: Sequence[RequestRecord]
    steps: Sequence[StepStats] = ()
    kv_bytes_moved: int | None = None
    duration_s: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    series: str | None = None
    group: str | None = None

    def metrics(self, slo_ms: Mapping[str, float] | None = None) -> BenchmarkMetrics:
        return compute_metrics(self.records, slo_ms or {}, self.duration_s)


@dataclass(frozen=True)
class ReportContent:
    """Everything one report shows; ``metrics`` pairs each run with its figures, ``plots`` maps a
    plot's name to its PNG. Raises ValueError for a non-positive ITL target."""

    title: str
    config: Mapping[str, Any]
    slo_ms: Mapping[str, float]
    itl_target_ms: float | None
    metrics: Sequence[tuple[RunData, BenchmarkMetrics]]
    sweep: Sequence[SweepPoint] | None = None
    pd_rows: Sequence[Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    notes: Sequence[str] = ()
    plots: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.itl_target_ms is not None and not self.itl_target_ms > 0:
            raise ValueError(f"report: itl_target_ms must be > 0, got {self.itl_target_ms}")

    @property
    def repeats(self) -> dict[str, list[tuple[RunData, BenchmarkMetrics]]]:
        """The runs by group (a run without a group is its own), when some group has several; else {}."""
        groups: dict[str, list[tuple[RunData, BenchmarkMetrics]]] = {}
        for run, m in self.metrics:
            groups.setdefault(run.group or run.name, []).append((run, m))
        return groups if any(len(g) > 1 for g in groups.values()) else {}

    def spread(self) -> dict[str, dict[str, Spread]]:
        return summarize({g: [m for _, m in runs] for g, runs in self.repeats.items()})


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


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


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
        "TTFT met",
        "TPOT met",
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
            _pct(m.slo_attainment),
            _pct(m.ttft_attainment),
            _pct(m.tpot_attainment),
            _bytes(kv),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


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
    content = ReportContent(
        title,
        dict(config or {}),
        slo,
        itl_target_ms,
        [(run, run.metrics(slo)) for run in runs],
        sweep,
        pd_rows,
        dict(extra or {}),
        list(notes),
    )
    content = replace(content, plots={**(extra_plots or {}), **write_plots(out_dir, content)})
    results_json = os.path.join(out_dir, "results.json")
    with open(results_json, "w", encoding="utf-8") as f:
        json.dump(results_document(content), f, indent=1, default=str)
        f.write("\n")
    report_md = os.path.join(out_dir, "report.md")
    with open(report_md, "w", encoding="utf-8") as f:
        f.write(report_markdown(content))
    return ReportFiles(out_dir, results_json, report_md, content.plots)


def write_plots(out_dir: str, content: ReportContent) -> dict[str, str]:
    """Every plot of a report: CDFs, throughput vs latency and per-step timelines of the runs, and the
    sweep and P:D search when given. Returns name → path."""
    plots: dict[str, str] = {}
    metrics, sweep, itl_target_ms = content.metrics, content.sweep, content.itl_target_ms
    runs = [run for run, _ in metrics]
    if runs:
        pooled: dict[str, list[RequestRecord]] = {}  # a group's repeats pooled into one curve
        for r in runs:
            pooled.setdefault(r.group or r.name, []).extend(r.records)
        plots["itl_cdf"] = plot_itl_cdf(
            {name: itl_values(recs) for name, recs in pooled.items()},
            os.path.join(out_dir, "itl_cdf.png"),
            itl_target_ms,
        )
        plots["ttft_cdf"] = plot_ttft_cdf(
            {name: ttft_values(recs) for name, recs in pooled.items()},
            os.path.join(out_dir, "ttft_cdf.png"),
            content.slo_ms.get("ttft"),
        )
        series: dict[str, list[tuple[float, float, float]]] = {}
        for r, m in metrics:
            series.setdefault(r.series or r.group or r.name, []).append(
                (m.output_throughput, m.ttft.p99_ms, m.tpot.p99_ms)
            )
        plots["throughput_latency"] = plot_throughput_latency(series, os.path.join(out_dir, "throughput_latency.png"))
    for run in runs:
        plots.update(_timeline_plots(out_dir, run, itl_target_ms))
    if sweep:
        plots["chunk_sweep"] = plot_chunk_sweep(sweep, os.path.join(out_dir, "chunk_sweep.png"), itl_target_ms)
    if content.pd_rows:
        plots["pd_search"] = plot_pd_search(content.pd_rows, os.path.join(out_dir, "pd_search.png"))
    return plots


def _timeline_plots(out_dir: str, run: RunData, itl_target_ms: float | None) -> dict[str, str]:
    """A per-step timeline of a run's instance, or of its first two when it has several."""
    steps = sorted(run.steps, key=lambda s: s.started)
    instances = list(dict.fromkeys(s.worker for s in steps))
    plots = {}
    for inst in instances[:2]:
        label = f"{run.name} {inst}".strip()
        key = f"timeline_{_slug(label)}"
        plots[key] = plot_step_timeline(
            [s for s in steps if s.worker == inst],
            os.path.join(out_dir, f"{key}.png"),
            itl_target_ms,
            f"Per-step timeline: {label}",
        )
    return plots


def results_document(content: ReportContent) -> dict[str, Any]:
    """The content of results.json: every request and step of every run, with the figures."""
    sweep, itl_target_ms, pd_rows = content.sweep, content.itl_target_ms, content.pd_rows
    return {
        "title": content.title,
        "config": _jsonable(dict(content.config)),
        "slo_ms": dict(content.slo_ms),
        "itl_target_ms": itl_target_ms,
        "runs": [
            {
                "name": run.name,
                "series": run.series,
                "group": run.group,
                "meta": _jsonable(dict(run.meta)),
                "kv_bytes_moved": run.kv_bytes_moved,
                "duration_s": run.duration_s,
                "metrics": m.to_dict(),
                "requests": [rec.to_dict() for rec in run.records],
                "steps": [s._asdict() for s in run.steps],
            }
            for run, m in content.metrics
        ],
        "chunk_sweep": [p.to_dict() for p in sweep] if sweep else None,
        "chunk_sweep_knee": (
            None if not sweep or itl_target_ms is None else _jsonable(find_knee(sweep, itl_target_ms))
        ),
        "pd_search": _jsonable(list(pd_rows)) if pd_rows else None,
        "repeats": {g: {k: v._asdict() for k, v in figs.items()} for g, figs in content.spread().items()} or None,
        "differences": [str(d) for d in differences(content.spread())] if content.repeats else None,
        "extra": _jsonable(dict(content.extra)),
        "plots": {k: os.path.basename(v) for k, v in content.plots.items()},
    }


def report_markdown(content: ReportContent) -> str:
    """The content of report.md: config, SLOs, the comparison table, the sweep and P:D tables, notes, plots."""
    config, slo_ms, metrics, sweep = content.config, content.slo_ms, content.metrics, content.sweep
    itl_target_ms, pd_rows, notes, plots = content.itl_target_ms, content.pd_rows, content.notes, content.plots
    md = [f"# {content.title}", ""]
    if config:
        md += [
            "Config: " + ", ".join(f"`{k}={_jsonable(v)}`" for k, v in config.items() if not isinstance(v, Mapping)),
            "",
        ]
    if slo_ms:
        md += ["SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo_ms.items()), ""]
    if metrics:
        md += [
            "Latencies in ms. Goodput = requests meeting every SLO per second.",
            "",
            markdown_table([(r.name, m, r.kv_bytes_moved) for r, m in metrics]),
            "",
        ]
    if content.repeats:
        md += repeats_markdown(content.spread())
    if sweep:
        md += ["## Chunk size sweep", "", sweep_table(sweep), ""]
        if itl_target_ms is not None:
            knee = find_knee(sweep, itl_target_ms)
            md += [
                f"Knee for a {itl_target_ms:g} ms P99 ITL target: "
                + (f"chunk {knee.chunk_size}." if knee else "no chunk size meets it."),
                "",
            ]
    if pd_rows:
        md += ["## P:D search", "", pd_search_table(pd_rows), ""]
    if notes:
        md += [f"- {n}" for n in notes] + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{k}]({os.path.basename(v)})" for k, v in plots.items()] + [""]
    return "\n".join(md)


def repeats_markdown(summary: dict[str, dict[str, Spread]]) -> list[str]:
    """The median-and-spread table of repeated runs, and the differences beyond the spread."""
    found = differences(summary)
    md = ["## Median and spread over repeats", "", "Each figure: median (min–max) over the repeats.", ""]
    md += [spread_table(summary), "", "Differences between runs that exceed the spread (every repeat better):", ""]
    md += [f"- {d}" for d in found] or ["- none: every difference is within the spread of the repeats"]
    return [*md, ""]


def sweep_table(sweep: Sequence[SweepPoint]) -> str:
    """One Markdown row per chunk size of a sweep."""
    head = [
        "chunk",
        "P99 ITL ms (under long prefills)",
        "P99 ITL ms (whole run)",
        "max ITL ms",
        "prefill tok/s",
        "mean TTFT ms",
        "P99 TTFT ms",
    ]
    rows = [
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
    ]
    return _table(head, rows)


def pd_search_table(pd_rows: Sequence[Any]) -> str:
    """One Markdown row per configuration of a P:D search (``sim.experiments.PDRow``), in the given order."""
    head = [
        "config",
        "GPUs",
        "goodput req/s",
        "goodput/GPU",
        "SLO met",
        "TTFT met",
        "TPOT met",
        "P99 TTFT ms",
        "P99 TPOT ms",
        "KV moved",
    ]
    rows = [
        [
            r.name,
            str(r.num_gpus),
            _fmt(r.goodput, 2),
            _fmt(r.goodput_per_gpu, 3),
            _pct(r.slo_attainment),
            _pct(r.ttft_attainment),
            _pct(r.tpot_attainment),
            _fmt(r.p99_ttft_ms),
            _fmt(r.p99_tpot_ms),
            _bytes(r.kv_bytes_moved),
        ]
        for r in pd_rows
    ]
    return _table(head, rows)


def load_results(path: str) -> tuple[dict[str, Any], list[RunData]]:
    """Read a results.json back: the raw document and its runs as ``RunData``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    runs = [
        RunData(
            r["name"],
            [RequestRecord.from_dict(d) for d in r["requests"]],
            [StepStats(**s) for s in r.get("steps", [])],
            r.get("kv_bytes_moved"),
            duration_s=r.get("duration_s"),
            meta=r.get("meta") or {},
            series=r.get("series"),
            group=r.get("group"),
        )
        for r in doc.get("runs", [])
    ]
    return doc, runs
