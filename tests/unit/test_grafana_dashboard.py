"""docs/grafana-dashboard.json: every query names metrics the router exports, with their exported suffixes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdserve.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_series() -> set[str]:
    """The sample names a router's ``/metrics`` can carry (``_total`` counters, histogram parts, gauges)."""
    names = set()
    for family in RouterMetrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_query_names_only_exported_metrics():
    exported = exported_series()
    found = queries()
    assert len(found) >= 18
    for title, expr in found:
        named = re.findall(r"\bpdserve_[a-z0-9_]+", expr)
        assert named, f"{title}: {expr} names no pdserve metric"
        unknown = [name for name in named if name not in exported]
        assert not unknown, f"{title}: {expr} names {unknown}, which the router does not export"


def test_the_dashboard_shows_the_serving_metrics():
    shown = {name for _, expr in queries() for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}
    for name in (
        "pdserve_prefix_cache_hits_total",
        "pdserve_prefix_cache_queries_total",
        "pdserve_worker_kv_usage_ratio",
        "pdserve_requests_finished_total",
        "pdserve_request_prompt_tokens_bucket",
        "pdserve_request_generation_tokens_bucket",
        "pdserve_worker_prefill_step_seconds_bucket",
        "pdserve_worker_decode_step_seconds_bucket",
        "pdserve_request_queue_seconds_bucket",
        "pdserve_request_ttft_seconds_bucket",
        "pdserve_request_inter_token_latency_seconds_bucket",
    ):
        assert name in shown, name
    panel_ids = [p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
