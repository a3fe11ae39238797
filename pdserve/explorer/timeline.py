"""One row of the page's step timeline, the format ``static/explorer.js`` draws (both views)."""

from __future__ import annotations

from pdserve.messages import StepStats


def step_row(step: StepStats, start: float, prefill_share: float) -> list[float]:
    """``[start, duration ms, prefill ms, decode ms, prefill tokens, decode tokens]``: ``start`` in the
    view's own unit and origin, the step's time split by ``prefill_share`` (0 ... 1)."""
    ms = step.duration_s * 1000.0
    prefill_ms = ms * prefill_share
    return [round(start, 4), round(ms, 3), round(prefill_ms, 3), round(ms - prefill_ms, 3)] + [
        step.num_prefill_tokens,
        step.num_decode_tokens,
    ]
