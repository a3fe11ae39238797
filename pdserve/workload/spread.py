"""Repeated runs: every figure's median and spread (min–max), and the differences that exceed it.

A *group* is one configuration run several times (``pdserve bench --repeats N``: one architecture on
N fresh deployments). ``summarize`` gives each figure of each group as ``Spread(median, low, high)``;
``differences`` calls out a difference between two groups only where their spreads do not overlap
(every repeat of one is better than every repeat of the other), and says which is better.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from pdserve.workload.metrics import BenchmarkMetrics


class Figure(NamedTuple):
    """One reported figure: its label, unit, how to read it off the metrics, and which way is better."""

    label: str
    unit: str
    value: Callable[[BenchmarkMetrics], float | None]
    lower_is_better: bool = True


def _latency(attr: str, stat: str) -> Callable[[BenchmarkMetrics], float | None]:
    """The figure ``BenchmarkMetrics.<attr>.<stat>_ms`` (``ttft``, ``p99``: the TTFT p99 in ms)."""
    return lambda m: getattr(getattr(m, attr), f"{stat}_ms")


FIGURES: tuple[Figure, ...] = (
    *(
        Figure(f"{name} {stat}", "ms", _latency(attr, stat))
        for name, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el"))
        for stat in ("mean", "p50", "p99")
    ),
    Figure("req/s", "req/s", lambda m: m.request_throughput, lower_is_better=False),
    Figure("out tok/s", "tok/s", lambda m: m.output_throughput, lower_is_better=False),
    Figure("goodput req/s", "req/s", lambda m: m.request_goodput, lower_is_better=False),
)


class Spread(NamedTuple):
    median: float
    low: float
    high: float
    num_runs: int

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        """Median, min and max of at least one value."""
        return Spread(statistics.median(values), min(values), max(values), len(values))

    def __str__(self) -> str:
        if self.num_runs == 1:
            return f"{self.median:.1f}"
        return f"{self.median:.1f} ({self.low:.1f}–{self.high:.1f})"


def summarize(groups: Mapping[str, Sequence[BenchmarkMetrics]]) -> dict[str, dict[str, Spread]]:
    """``{group: {figure label: Spread}}``; a figure that is None in a run (no SLO: no goodput) is left out."""
    out: dict[str, dict[str, Spread]] = {}
    for group, runs in groups.items():
        figures = {}
        for fig in FIGURES:
            values = [v for v in (fig.value(m) for m in runs) if v is not None]
            if values:
                figures[fig.label] = Spread.of(values)
        out[group] = figures
    return out


class Difference(NamedTuple):
    """``better`` beat ``worse`` on ``figure`` in every repeat: their spreads do not overlap."""

    figure: str
    unit: str
    better: str
    worse: str
    better_spread: Spread
    worse_spread: Spread

    def __str__(self) -> str:
        return (
            f"{self.figure}: {self.better} {self.better_spread} beats {self.worse} {self.worse_spread} {self.unit} "
            "(beyond the spread)"
        )


def differences(summary: Mapping[str, Mapping[str, Spread]]) -> list[Difference]:
    """Every (figure, pair of groups) whose spreads do not overlap, in figure order."""
    names = list(summary)
    out = []
    for fig in FIGURES:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                sa, sb = summary[a].get(fig.label), summary[b].get(fig.label)
                if sa is None or sb is None or not (sa.high < sb.low or sb.high < sa.low):
                    continue
                a_better = (sa.high < sb.low) == fig.lower_is_better
                better, worse = (a, b) if a_better else (b, a)
                out.append(
                    Difference(
                        fig.label, fig.unit, better, worse, summary[better][fig.label], summary[worse][fig.label]
                    )
                )
    return out


def spread_table(summary: Mapping[str, Mapping[str, Spread]]) -> str:
    """One Markdown row per group: every figure as ``median (min–max)``."""
    labels = [f.label for f in FIGURES if any(f.label in s for s in summary.values())]
    lines = [
        "| run | repeats | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for group, figures in summary.items():
        count = max((s.num_runs for s in figures.values()), default=0)
        cells = [str(figures[label]) if label in figures else "-" for label in labels]
        lines.append(f"| {group} | {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
