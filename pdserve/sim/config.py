"""``SimConfig``: the simulated engine's settings, the engine options the simulator models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import DEFAULT_TOKEN_BUDGET, EngineConfig
from pdserve.router.config import RouterConfig

_ENGINE_DEFAULTS = EngineConfig()
_ROUTER_DEFAULTS = RouterConfig()
# The engine options the simulator models (`pdserve sim` offers these, with the engine's names and defaults).
ENGINE_OPTIONS = (
    "block_size",
    "num_kv_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "max_chunk_tokens",
    "enable_prefix_caching",
)


@dataclass(frozen=True)
class SimConfig:
    """Per-instance engine settings plus the KV link, mirroring ``engine.EngineConfig`` (its defaults too).

    Token budget: ``max_num_batched_tokens`` when given; otherwise ``chunk_size + max_num_seqs`` when a
    chunk size is set (decodes never eat into the chunk), else the engine's default budget. With chunking
    off the budget is raised to ``longest prompt + max_num_seqs`` so that every prompt fits one step
    next to a full decode batch (the engine raises it to ``max_model_len``).
    ``num_kv_blocks=None`` sizes the pool from the cost model's memory left after the weights.
    ``stop_time_s`` ends the run at that virtual time (requests still open are recorded as failed).

    Around the steps: ``token_latency_s`` (a step's end to the client receiving its tokens),
    ``control_latency_s`` (one router-to-worker call) and ``step_gap_s`` (an engine loop's time between
    two steps), all 0 by default (a GPU profile's steps dwarf them) and measured for the cpu-measured
    profile (``LinearProfile.sim_settings``). Between the workers of a disaggregated deployment, no client
    is on the path: ``reserve_latency_s`` is the round trip of a prefill worker's reservation on an idle
    decode worker (the call and its answer), ``handoff_latency_s`` the time from the prefill worker
    sampling the first token to the router's decode call reaching the decode worker; None prices them as
    client calls (two control calls; the token's delivery plus a control call). The machine's slowdown:
    with ``step_tail`` and ``slowdown_percentiles``, every ``slowdown_window_s`` of virtual time draws one
    factor from that distribution (``random.Random(seed)``), shared by all instances (a burst of other
    load slows them all), and a step's priced work is stretched by the factors of the windows it spans; each control
    call's latency is drawn from ``control_latency_percentiles``. ``step_tail=False`` leaves both out.
    ``co_run_slowdown`` (``k``): an instance's step runs ``1 + k`` times slower while every other
    instance runs a step too (``1 + k * busy / others`` in between; the cores and memory are shared),
    re-timed whenever another instance starts or ends a step; 0 (GPU instances share nothing).
    ``auto_*`` are the router's auto thresholds (``router.policy.RouterConfig``, same defaults).

    Speed, not results: ``coalesce_decode_steps`` advances a decode instance's runs of identical
    decode-only steps without an event per step (the same steps and token times; it applies where no
    tail, co-run slowdown, loop gap, stop time or replay is set). ``keep_steps=False`` keeps no step
    records (a fleet-scale run's millions), only their count.
    """

    block_size: int = _ENGINE_DEFAULTS.block_size
    max_num_seqs: int = _ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int | None = None
    chunk_size: int | None = None  # the engine's max_chunk_tokens
    enable_chunked_prefill: bool = _ENGINE_DEFAULTS.enable_chunked_prefill
    enable_prefix_caching: bool = _ENGINE_DEFAULTS.enable_prefix_caching
    num_kv_blocks: int | None = None
    kv_link_bw: float | None = None  # bytes/s; None = the hardware profile's default
    kv_link_latency_s: float | None = None
    stop_time_s: float | None = None
    token_latency_s: float = 0.0
    control_latency_s: float = 0.0
    control_latency_percentiles: tuple[float, ...] = ()
    step_gap_s: float = 0.0
    reserve_latency_s: float | None = None
    handoff_latency_s: float | None = None
    slowdown_window_s: float = 0.1
    slowdown_percentiles: tuple[float, ...] = ()
    co_run_slowdown: float = 0.0
    step_tail: bool = True
    seed: int = 0
    auto_min_remote_tokens: int = _ROUTER_DEFAULTS.auto_min_remote_tokens
    auto_max_prefill_queue_tokens: int = _ROUTER_DEFAULTS.auto_max_prefill_queue_tokens
    coalesce_decode_steps: bool = True
    keep_steps: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"sim: {name} must be >= 1")
        for name in ("max_num_batched_tokens", "chunk_size", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"sim: {name} must be None or >= 1, got {v}")
        if self.kv_link_bw is not None and not self.kv_link_bw > 0:
            raise ValueError(f"sim: kv_link_bw must be > 0, got {self.kv_link_bw}")
        for name in ("token_latency_s", "control_latency_s", "step_gap_s", "auto_min_remote_tokens", "co_run_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"sim: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("reserve_latency_s", "handoff_latency_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"sim: {name} must be None or >= 0, got {v}")
        if not self.slowdown_window_s > 0:
            raise ValueError(f"sim: slowdown_window_s must be > 0, got {self.slowdown_window_s}")

    @staticmethod
    def from_engine_config(engine: EngineConfig, **extra: Any) -> SimConfig:
        """The ``ENGINE_OPTIONS`` of ``engine`` with its token budget (the engine's default when none is
        given; with chunked prefill off, raised to fit the longest prompt), plus ``extra`` fields (the KV
        link, latencies, ...)."""
        budget = engine.max_num_batched_tokens
        if budget is None and engine.enable_chunked_prefill:
            budget = DEFAULT_TOKEN_BUDGET
        return SimConfig(
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=budget,
            chunk_size=engine.max_chunk_tokens if engine.enable_chunked_prefill else None,
            enable_chunked_prefill=engine.enable_chunked_prefill,
            enable_prefix_caching=engine.enable_prefix_caching,
            num_kv_blocks=engine.num_kv_blocks,
            **extra,
        )

    def token_budget(self, longest_prompt: int) -> int:
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        elif self.chunk_size is not None:
            budget = self.chunk_size + self.max_num_seqs
        else:
            budget = DEFAULT_TOKEN_BUDGET
        if not self.enable_chunked_prefill:
            budget = max(budget, longest_prompt + self.max_num_seqs)
        return budget

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
