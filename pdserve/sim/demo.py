"""The chunked-prefill demo: one long prompt lands on a batch of streaming decodes.

Scenario: ``num_decodes`` streams (``stream_prompt_len``-token prompts, unbounded outputs) are all in
steady decode on one instance; at that moment (``arrival``) one ``prompt_len``-token prompt arrives.
With chunking on, each step carries ``chunk_size`` prompt tokens next to the decodes (token budget
``chunk_size + max_num_seqs``); with chunking off, the prompt goes through in one step.

Reported over the window from the long prompt's arrival to its first token:

- ``worst_decode_stall_ms``: the longest gap between two tokens of any stream ending in the window;
- ``long_prompt_ttft_ms``: first token of the long prompt minus its arrival;
- ``steps_over_target``: steps in the window that carry decode tokens and take longer than the ITL
  target (of ``steps_in_window``, every instance's steps in the window);
- ``decode_throughput_tok_s``: stream tokens produced in the window per second of window.

The architecture (``DemoArchitecture``) is colocated on one instance by default, as in the lesson; on
several colocated instances, or disaggregated / auto with P prefill and D decode instances, the router's
``RoutingPolicy`` places the streams and the long prompt, as it would in a deployment.

Everything runs through the real engine scheduler via ``sim.simulator``; ``pdserve sim --demo``
and the explorer's playground (``pdserve.explorer``) both call ``run_chunked_prefill_demo``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve.messages import StepStats
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.simulator import SimResult, simulate
from pdserve.workload.generator import WorkloadRequest, random_tokens
from pdserve.workload.metrics import itls_during_prefill

STREAM_MAX_TOKENS = 1_000_000  # streams never finish inside the window
TIMELINE_CONTEXT_STEPS = 4  # steps shown on each side of the window on the timeline


class DemoArchitecture(NamedTuple):
    """Where the demo runs: ``num_instances`` colocated instances, or ``num_prefill`` + ``num_decode``."""

    mode: str = "colocated"  # colocated, disaggregated or auto
    num_instances: int = 1  # colocated
    num_prefill: int = 1  # disaggregated / auto
    num_decode: int = 1

    @property
    def name(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.num_instances}"
        return f"{self.mode} {self.num_prefill}P:{self.num_decode}D"


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
    architecture: str = "colocated x1"
    instances: tuple[str, ...] = ("decode-0",)
    window_steps: tuple[StepStats, ...] = field(default=(), repr=False)
    timeline_steps: tuple[StepStats, ...] = field(default=(), repr=False)  # the window and a few steps around it

    def to_dict(self) -> dict[str, Any]:
        steps = ("window_steps", "timeline_steps")
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in steps}
        d["instances"] = list(self.instances)
        d["window_steps"] = [s._asdict() for s in self.window_steps]
        return d

    def summary(self) -> str:
        mode = f"chunk {self.chunk_size}" if self.chunk_size else "chunking off"
        return (
            f"{self.prompt_len}-token prompt, {mode}, {self.num_decodes} decodes, ITL target "
            f"{self.itl_target_ms:g} ms on {self.cost_model}, {self.architecture}:\n"
            f"  worst decode stall:      {self.worst_decode_stall_ms:8.1f} ms\n"
            f"  long-prompt TTFT:        {self.long_prompt_ttft_ms:8.1f} ms\n"
            f"  steps over ITL target:   {self.steps_over_target:8d} of {self.steps_in_window}\n"
            f"  decode throughput:       {self.decode_throughput_tok_s:8.0f} tok/s"
        )


def _run_until(
    requests: list[WorkloadRequest],
    cost_model: CostModel,
    config: SimConfig,
    architecture: DemoArchitecture,
    done: Any,
    start_s: float,
) -> SimResult:
    """Simulate with a stop time that doubles until ``done(result)`` holds (at most 40 doublings)."""
    horizon = start_s
    for _ in range(40):
        result = simulate(
            requests,
            cost_model,
            SimConfig(**{**config.to_dict(), "stop_time_s": horizon}),
            mode=architecture.mode,
            num_instances=architecture.num_instances,
            num_prefill=architecture.num_prefill,
            num_decode=architecture.num_decode,
        )
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
    architecture: DemoArchitecture = DemoArchitecture(),
    base: SimConfig | None = None,
) -> DemoResult:
    """Run the scenario once; ``chunk_size=None`` turns chunking off.

    ``base``: the simulated engine's other settings (KV link, block size, request cap, seed, the
    machine's tail); its chunking and token budget are replaced by the demo's. Raises ValueError for an
    impossible setting (as the simulator does)."""
    base = base or SimConfig(max_num_seqs=256)
    if num_decodes >= base.max_num_seqs:
        raise ValueError(
            f"demo: {num_decodes} decodes and the long prompt do not fit a step of at most {base.max_num_seqs} "
            f"requests (max_num_seqs): use at most {base.max_num_seqs - 1} decodes"
        )
    seed = base.seed
    streams = [
        WorkloadRequest(
            f"stream-{i}", random_tokens(stream_prompt_len, _rng(seed, i)), STREAM_MAX_TOKENS, 0.0, "stream"
        )
        for i in range(num_decodes)
    ]
    config = dataclasses.replace(
        base,
        chunk_size=chunk_size,
        enable_chunked_prefill=chunk_size is not None,
        max_num_batched_tokens=None if chunk_size else prompt_len + base.max_num_seqs,
        stop_time_s=None,
    )

    def all_streaming(result: SimResult) -> bool:
        return all(len(r.token_times) >= 2 for r in result.records)

    # 1) when is every stream in steady decode (second token out)? The long prompt arrives then.
    warm = _run_until(streams, cost_model, config, architecture, all_streaming, 0.05) if streams else None
    arrival = max(r.token_times[1] for r in warm.records) if warm else 0.0
    long_req = WorkloadRequest("long", random_tokens(prompt_len, _rng(seed, -1)), 1, arrival, "long")

    def long_done(result: SimResult) -> bool:
        return bool(result.record("long").token_times)

    # 2) the same run with the long prompt, until its first token. Identical to (1) before `arrival`.
    result = _run_until([*streams, long_req], cost_model, config, architecture, long_done, max(2 * arrival, 0.05))
    first = result.record("long").token_times[0]
    stalls = itls_during_prefill((r.token_times for r in result.records if r.label == "stream"), [(arrival, first)])
    tokens = sum(1 for r in result.records if r.label == "stream" for t in r.token_times if arrival < t <= first)
    window = [s for s in result.steps if s.started >= arrival and s.ended <= first + 1e-12]
    over = sum(1 for s in window if s.num_decode_tokens and s.duration_s * 1000.0 > itl_target_ms)
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
        architecture=architecture.name,
        instances=result.instances,
        window_steps=tuple(window),
        timeline_steps=_around(result.steps, window),
    )


def _around(steps: tuple[StepStats, ...], window: list[StepStats]) -> tuple[StepStats, ...]:
    """The window's steps with up to ``TIMELINE_CONTEXT_STEPS`` more on each side, on every instance."""
    if not window:
        return ()
    first, last = min(s.started for s in window), max(s.ended for s in window)
    out = []
    for name in dict.fromkeys(s.worker for s in steps):
        mine = [s for s in steps if s.worker == name]
        before = [s for s in mine if s.started < first][-TIMELINE_CONTEXT_STEPS:]
        inside = [s for s in mine if first <= s.started and s.ended <= last + 1e-12]
        after = [s for s in mine if s.started > last][:TIMELINE_CONTEXT_STEPS]
        out += before + inside + after
    return tuple(sorted(out, key=lambda s: (s.started, s.worker)))


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
