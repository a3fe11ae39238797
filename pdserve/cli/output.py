"""How the command line prints a request's metadata: aligned ``key: value`` lines, each value with its unit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.messages import RequestMetrics

# (label, RequestMetrics field, unit): "ms" prints seconds as milliseconds, "bytes" picks B/KiB/MiB/GiB
_METADATA_LINES: tuple[tuple[str, str, str], ...] = (
    ("request", "request_id", ""),
    ("mode", "mode", ""),
    ("router", "router", ""),
    ("prefill worker", "prefill_worker", ""),
    ("decode worker", "decode_worker", ""),
    ("fallback", "fallback", ""),
    ("prompt tokens", "num_prompt_tokens", "tokens"),
    ("cached tokens", "num_cached_tokens", "tokens"),
    ("output tokens", "num_output_tokens", "tokens"),
    ("time to first token", "ttft_s", "ms"),
    ("queue", "queue_s", "ms"),
    ("prefill", "prefill_s", "ms"),
    ("KV transfer", "kv_transfer_s", "ms"),
    ("KV transferred", "kv_transfer_bytes", "bytes"),
    ("end to end", "e2e_s", "ms"),
)
_SKIPPED_WHEN_LOCAL = {"prefill_s", "kv_transfer_s", "kv_transfer_bytes"}  # no KV moved: nothing to report


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; plain bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_value(value: Any, unit: str) -> str:
    """One value with its unit: seconds as ``"177.4 ms"``, byte counts as ``"2.0 MiB"``, counts as ``"12 tokens"``."""
    if unit == "ms":
        return f"{value * 1000:.1f} ms"
    if unit == "bytes":
        return format_bytes(value)
    if unit:
        return f"{value} {unit}"
    return str(value)


def format_fields(pairs: Iterable[tuple[str, str]], indent: str = "") -> str:
    """``key: value`` lines with the values aligned in one column."""
    rows = list(pairs)
    width = max((len(k) for k, _ in rows), default=0) + 1
    return "\n".join(f"{indent}{(k + ':').ljust(width)} {v}" for k, v in rows)


def metadata_fields(metrics: RequestMetrics | None, finish_reason: str | None) -> list[tuple[str, str]]:
    """The printable ``(label, value)`` pairs of one request: its finish reason, then every metadata
    field with a value (empty names, and the KV transfer of a request that moved none, are left out)."""
    pairs = [("finish reason", finish_reason or "none")]
    if metrics is None:
        return pairs
    moved = bool(metrics.prefill_worker) or metrics.kv_transfer_bytes > 0
    for label, name, unit in _METADATA_LINES:
        value = getattr(metrics, name)
        if value in ("", None) or (name in _SKIPPED_WHEN_LOCAL and not moved):
            continue
        pairs.append((label, format_value(value, unit)))
    return pairs


def format_metadata(metrics: RequestMetrics | None, finish_reason: str | None, indent: str = "") -> str:
    """A request's metadata as aligned ``key: value`` lines (``metadata_fields``)."""
    return format_fields(metadata_fields(metrics, finish_reason), indent)
