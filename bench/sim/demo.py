"""The chunked-prefill demo: one long prompt lands on a batch of streaming decodes.

Scenario: ``num_decodes`` streams (``stream_prompt_len``-token prompts, unbounded outputs) are all in
steady decode on one instance; at that moment (``arrival``) one ``prompt_len``-token prompt arrives.
With chunking on, each step carries ``chunk_size`` prompt tokens next to the decodes (token budget
``chunk_size + max_num_seqs``); with chunking off, the prompt goes through in one step.

Reported over the window from the long prompt's arrival to its first token:

- ``worst_decode_stall_ms``: the longest gap between two tokens of any stream ending in the window;
- ``long_prompt_ttft_ms``: first token of the long prompt minus its arrival;
- ``steps_over_target``: steps in the window longer than the ITL target (of ``steps_in_window``);
- ``decode_throughput_tok_s``: stream tokens produced in the window per second of window.

Everything runs through the real engine scheduler via ``bench.sim.simulator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.metrics import itls_during_prefill
from pdserve.bench.sim.config import SimConfig
from pdserve.bench.sim.cost_model import CostModel
from pdserve.bench.sim.simulator import SimResult, simulate
from pdserve.bench.workloads import WorkloadRequest, random_tokens
from pdserve.messages import StepStats

STREAM_MAX_TOKENS = 1_000_000  # streams never finish inside the window


@dataclass(frozen=True)
class DemoResult:
    """One demo run (one prompt length, chunking on or off)."""

    cost_model: str
    prompt_len: int
    chunk_size: int | None  # None = chunking off
    num_decodes: int
    itl_target_ms: float
    arrival_s: float
    worst_decode_stall_ms: float
    long_prompt_ttft_ms: float
    steps_over_target: int
    steps_in_window: int
    decode_throughput_tok_s: float
    window_steps: tuple[StepStats, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "window_steps"}
        d["window_steps"] = [s._asdict() for s in self.window_steps]
        return d

    def summary(self) -> str:
        mode = f"chunk {self.chunk_size}" if self.chunk_size else "chunking off"
        return (
            f"{self.prompt_len}-token prompt, {mode}, {self.num_decodes} decodes, ITL target "
            f"{self.itl_target_ms:g} ms on {self.cost_model}:\n"
            f"  worst decode stall:      {self.worst_decode_stall_ms:8.1f} ms\n"
            f"  long-prompt TTFT:        {self.long_prompt_ttft_ms:8.1f} ms\n"
            f"  steps over ITL target:   {self.steps_over_target:8d} of {self.steps_in_window}\n"
            f"  decode throughput:       {self.decode_throughput_tok_s:8.0f} tok/s"
        )


def _run_until(
    requests: list[WorkloadRequest], cost_model: CostModel, config: SimConfig, done: Any, start_s: float
) -> SimResult:
    """Simulate with a stop time that doubles until ``done(result)`` holds (at most 40 doublings)."""
    horizon = start_s
    for _ in range(40):
        result = simulate(requests, cost_model, SimConfig(**{**config.to_dict(), "stop_time_s": horizon}))
        if done(result):
            return result
        horizon *= 2
    raise RuntimeError("demo: the simulation did not reach the end of the window")


def run_chunked_prefill_demo(
    cost_model: CostModel,
    prompt_len: int = 8192,
    chunk_size: int | None = 1024,
    num_decodes: int = 24,
    itl_target_ms: float = 50.0,
    stream_prompt_len: int = 512,
    block_size: int = 16,
    max_num_seqs: int = 256,
    seed: int = 0,
) -> DemoResult:
    """Run the scenario once; ``chunk_size=None`` turns chunking off."""
    streams = [
        WorkloadRequest(
            f"stream-{i}", random_tokens(stream_prompt_len, _rng(seed, i)), STREAM_MAX_TOKENS, 0.0, "stream"
        )
        for i in range(num_decodes)
    ]
    config = SimConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        chunk_size=chunk_size,
        enable_chunked_prefill=chunk_size is not None,
        max_num_batched_tokens=None if chunk_size else prompt_len + max_num_seqs,
    )

    def all_streaming(result: SimResult) -> bool:
        return all(len(r.token_times) >= 2 for r in result.records)

    # 1) when is every stream in steady decode (second token out)? The long prompt arrives then.
    warm = _run_until(streams, cost_model, config, all_streaming, 0.05) if streams else None
    arrival = max(r.token_times[1] for r in warm.records) if warm else 0.0
    long_req = WorkloadRequest("long", random_tokens(prompt_len, _rng(seed, -1)), 1, arrival, "long")

    def long_done(result: SimResult) -> bool:
        return bool(result.record("long").token_times)

    # 2) the same run with the long prompt, until its first token. Identical to (1) before `arrival`.
    result = _run_until([*streams, long_req], cost_model, config, long_done, max(2 * arrival, 0.05))
    first = result.record("long").token_times[0]
    stalls = itls_during_prefill((r.token_times for r in result.records if r.label == "stream"), [(arrival, first)])
    tokens = sum(1 for r in result.records if r.label == "stream" for t in r.token_times if arrival < t <= first)
    window = [s for s in result.steps if s.started >= arrival and s.ended <= first + 1e-12]
    over = sum(1 for s in window if s.duration_s * 1000.0 > itl_target_ms)
    return DemoResult(
        cost_model=cost_model.name,
        prompt_len=prompt_len,
        chunk_size=chunk_size,
        num_decodes=num_decodes,
        itl_target_ms=itl_target_ms,
        arrival_s=arrival,
        worst_decode_stall_ms=max(stalls, default=0.0) * 1000.0,
        long_prompt_ttft_ms=(first - arrival) * 1000.0,
        steps_over_target=over,
        steps_in_window=len(window),
        decode_throughput_tok_s=tokens / (first - arrival) if first > arrival else 0.0,
        window_steps=tuple(window),
    )


@dataclass(frozen=True)
class ChunkingComparison:
    """Chunking off vs on for one long prompt: the worst-ITL improvement."""

    off: DemoResult
    on: DemoResult

    @property
    def worst_itl_ratio(self) -> float:
        return self.off.worst_decode_stall_ms / self.on.worst_decode_stall_ms if self.on.worst_decode_stall_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"off": self.off.to_dict(), "on": self.on.to_dict(), "worst_itl_ratio": self.worst_itl_ratio}


def compare_chunking(
    cost_model: CostModel,
    prompt_len: int = 32768,
    chunk_size: int = 1024,
    num_decodes: int = 24,
    itl_target_ms: float = 50.0,
    **kwargs: Any,
) -> ChunkingComparison:
    """The same scenario with chunking off and on (default: the 32k prompt)."""
    off = run_chunked_prefill_demo(cost_model, prompt_len, None, num_decodes, itl_target_ms, **kwargs)
    on = run_chunked_prefill_demo(cost_model, prompt_len, chunk_size, num_decodes, itl_target_ms, **kwargs)
    return ChunkingComparison(off, on)


def _rng(seed: int, i: int) -> Any:
    import numpy as np

    return np.random.default_rng([seed, i + 1_000_003])
