"""The headline figures of ``benchmarks/external_tools.sh``: pdserve bench, aiperf and guidellm on the same traffic.

    python -m external_tools_summary OUT_DIR

reads ``OUT_DIR/pdserve_bench/results.json``, aiperf's ``profile_export_aiperf.json`` (under
``OUT_DIR/aiperf``) and guidellm's ``OUT_DIR/guidellm.json``, and prints one row per tool: completed
requests, mean prompt and output tokens per request (as each tool counted them), request and output
token throughput, TTFT and inter-token latency (mean and p99, ms). A figure a tool does not report is
``-``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple


class Headline(NamedTuple):
    tool: str
    completed: float | None
    prompt_tokens: float | None  # mean per request
    output_tokens: float | None
    requests_per_s: float | None
    output_tok_per_s: float | None
    ttft_mean_ms: float | None
    ttft_p99_ms: float | None
    itl_mean_ms: float | None
    itl_p99_ms: float | None


def _at(data: Any, *path: str | int) -> Any:
    for key in path:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return None
    return data


def pdserve_bench(out: Path) -> Headline | None:
    path = out / "pdserve_bench" / "results.json"
    if not path.is_file():
        return None
    runs = json.loads(path.read_text()).get("runs") or [{}]
    metrics = _find(runs[0], "ttft") or {}
    completed = metrics.get("completed") or 0
    return Headline(
        "pdserve bench",
        completed,
        metrics.get("total_input_tokens", 0) / completed if completed else None,
        metrics.get("total_output_tokens", 0) / completed if completed else None,
        metrics.get("request_throughput"),
        metrics.get("output_throughput"),
        _at(metrics, "ttft", "mean_ms"),
        _at(metrics, "ttft", "p99_ms"),
        _at(metrics, "itl", "mean_ms"),
        _at(metrics, "itl", "p99_ms"),
    )


def _find(data: Any, key: str) -> dict[str, Any] | None:
    """The first dict below ``data`` that has ``key``."""
    if isinstance(data, dict):
        if key in data:
            return data
        for value in data.values():
            found = _find(value, key)
            if found is not None:
                return found
    elif isinstance(data, list):
        for value in data:
            found = _find(value, key)
            if found is not None:
                return found
    return None


def aiperf(out: Path) -> Headline | None:
    paths = sorted((out / "aiperf").rglob("profile_export_aiperf.json"))
    if not paths:
        return None
    doc = json.loads(paths[0].read_text())

    def stat(tag: str, name: str) -> float | None:
        metric = _find(doc, tag)
        value = _at(metric, tag, name) if metric is not None else None
        return float(value) if isinstance(value, (int, float)) else None

    return Headline(
        "aiperf",
        stat("request_count", "avg"),
        stat("input_sequence_length", "avg"),
        stat("output_sequence_length", "avg"),
        stat("request_throughput", "avg"),
        stat("output_token_throughput", "avg"),
        stat("time_to_first_token", "avg"),
        stat("time_to_first_token", "p99"),
        stat("inter_token_latency", "avg"),
        stat("inter_token_latency", "p99"),
    )


def guidellm(out: Path) -> Headline | None:
    path = out / "guidellm.json"
    if not path.is_file():
        return None
    metrics = _at(json.loads(path.read_text()), "benchmarks", 0, "metrics") or {}

    def stat(name: str, kind: str = "mean") -> float | None:
        successful = _at(metrics, name, "successful")
        value = _at(successful, "percentiles", "p99") if kind == "p99" else _at(successful, kind)
        return float(value) if isinstance(value, (int, float)) else None

    return Headline(
        "guidellm",
        _at(metrics, "request_totals", "successful"),
        stat("prompt_token_count"),
        stat("output_token_count"),
        stat("requests_per_second"),
        stat("output_tokens_per_second"),
        stat("time_to_first_token_ms"),
        stat("time_to_first_token_ms", "p99"),
        stat("inter_token_latency_ms"),
        stat("inter_token_latency_ms", "p99"),
    )


def table(rows: list[Headline]) -> str:
    header = ("tool", "done", "prompt tok", "output tok", "req/s", "out tok/s", "TTFT ms", "p99", "ITL ms", "p99")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for row in rows:
        cells = [row.tool] + ["-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row[1:]]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m external_tools_summary OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    rows = [r for r in (pdserve_bench(out), aiperf(out), guidellm(out)) if r is not None]
    if not rows:
        print(f"error: no results under {out}", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
