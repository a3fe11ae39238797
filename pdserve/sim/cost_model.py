"""Step-time cost models: how long one scheduled batch takes, from its shape alone.

A step's shape (``StepShape``) is read off the real scheduler's ``SchedulerOutput``: for a chunk of
``n`` tokens starting at absolute position ``s``, token ``i`` attends to ``s + i + 1`` keys, so the
chunk contributes ``n*s + n*(n+1)/2`` *context tokens* (attention work), reads the ``s`` cached
tokens' KV and writes ``n`` new ones.

``RooflineCostModel`` (GPU profiles) prices each kind of kernel on its own and adds them up, as the
kernels run one after another::

    step = overhead + gemm + prefill_attention + decode_attention + elementwise + all_reduce + pipeline
    overhead = step_overhead_s + seq_overhead_s * sequences
    gemm = blend((2 * matmul_params * tokens + 2 * lm_head_params * sampled) / tp / (peak_flops * mfu),
                 (matmul_params + lm_head_params) * dtype_bytes / tp / bandwidth)
    prefill_attention = blend(attn_flops_per_key * prefill_context / tp / (peak_flops * mfu),
                              kv_bytes_per_token * (prefill_kv_read + prefill_tokens) / tp / bandwidth)
    decode_attention  = blend(attn_flops_per_key * decode_context / tp / (peak_flops * mfu),
                              kv_bytes_per_token * decode_context / tp / bandwidth)
    elementwise = activation_bytes_per_token * tokens / tp / bandwidth
    all_reduce = 2 * layers * (latency + 2 * (tp-1)/tp * tokens * hidden * dtype_bytes / interconnect_bw)
    pipeline = (pp - 1) * (p2p_latency + tokens * hidden * dtype_bytes / interconnect_bw)

with ``bandwidth = mem_bw * bw_efficiency`` and ``blend(c, m) = sqrt(c**2 + m**2)`` (``combine="smooth"``,
the default), a roofline with a soft knee: a matrix product of a few rows streams its weights
(bandwidth-bound), one of thousands computes at ``mfu`` of peak, and in between it is slower than
either alone, so the fraction of peak reached grows with the rows instead of being a constant. On
Vidur's published A100 profile of Llama-3-8B the blend prices the matrix products within 7 % from 64
to 32,768 rows (``max`` is 13-26 % low at 64-384 rows). ``combine="max"`` or ``"sum"`` take the hard
roofline or the sum. A decode step streams the decoder layers and the LM head, not the embedding table
(read a row per token). Each attention reads its own KV: a big decode batch's KV reads add to a mixed
step's matrix products rather than hiding under them.

``LinearCostModel`` (the cpu-measured profile) is the per-role least-squares fit from ``calibrate``::

    step = c0 + a * prefill_tokens + b * decode_tokens + cp * prefill_context + cd * decode_keys
           + r * prefill_kv_read + s[n]   (s[n]: a step of n <= SMALL_STEP_TOKENS tokens; 0 above)

(a shape's typical step); the simulator stretches it by the machine's measured slowdown (``SimConfig``).
Prefill attention (many queries over a chunk's keys) and decode attention (one query reading a whole
cached context) get separate terms: their costs per attended key differ, on a GPU by an order of
magnitude (decode is bandwidth-bound), and on a CPU too (different kernels).

``decode_keys`` is what our engine's decode attention really reads: it sorts a step's decodes by
context length, attends them in groups of ``DECODE_GROUP_SIZE`` and pads every decode of a group to
the group's longest context in whole KV blocks (``engine.model_runner``). One 1500-token decode next
to three 100-token ones makes the step gather 4 x 1500 keys, not 1800: summed context lengths
under-price such a step and, fitted over many uniform ones, over-price the uniform steps.

``s[n]`` is a small step's own cost: a matrix product of a few rows does not cost a linear function of
the rows (a CPU kernel may multiply 2, 3 and 4 rows at one speed, so a line through the sizes would price
the smaller steps low).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from pdserve.engine.scheduler import chunk_context_tokens  # the engine's own count: simulator and StepStats agree
from pdserve.messages import StepStats
from pdserve.sim.profiles import SMALL_STEP_TOKENS, HardwareProfile, LinearProfile, ModelProfile

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput

ROLES = ("colocated", "prefill", "decode", "auto-decode")  # auto-decode: a decode instance under auto
STEP_KINDS = ("prefill-only", "decode-only", "mixed")  # ``StepShape.kind``
DECODE_GROUP_SIZE = 16  # engine.model_runner.DECODE_GROUP_SIZE (a test keeps them equal; that module needs torch)
DEFAULT_BLOCK_SIZE = 16  # engine.EngineConfig().block_size

__all__ = [
    "ROLES",
    "STEP_KINDS",
    "CostModel",
    "DecodePricer",
    "LinearCostModel",
    "RooflineCostModel",
    "StepCost",
    "StepShape",
    "chunk_context_tokens",
    "decode_keys",
    "linear_features",
]


class StepShape(NamedTuple):
    """What a step computes, as the cost models see it."""

    prefill_tokens: int
    decode_tokens: int
    context_tokens: int  # Σ over scheduled tokens of keys attended
    kv_read_tokens: int  # Σ over chunks of cached tokens whose KV is read (chunk start)
    num_seqs: int
    sampled_tokens: int  # chunks that produce a token (LM head work)
    decode_context_tokens: int = 0  # of context_tokens, those attended by decode tokens
    decode_keys: int = 0  # keys the decodes' attention reads, padded as the engine pads (``decode_keys``)
    prefill_square_tokens: int = 0  # Σ over prompt chunks of n * (start + n): a published fit's quadratic term

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def kind(self) -> str:
        """One of ``STEP_KINDS``: ``prefill-only``, ``decode-only`` or ``mixed`` (prompt chunks and decodes in
        one step)."""
        if self.prefill_tokens and self.decode_tokens:
            return "mixed"
        return "prefill-only" if self.prefill_tokens else "decode-only"

    @property
    def prefill_context_tokens(self) -> int:
        return self.context_tokens - self.decode_context_tokens

    @property
    def prefill_kv_read_tokens(self) -> int:
        """Of ``kv_read_tokens``, the cached prefix read by prefill chunks (a decode reads ``start``
        keys, ``decode_context - 1``)."""
        return self.kv_read_tokens - (self.decode_context_tokens - self.decode_tokens)

    def split(self) -> tuple[StepShape, StepShape]:
        """``(its prefill chunks alone, its decodes alone)``: two steps that together compute this one."""
        d = self.decode_tokens
        decode = StepShape(
            0,
            d,
            self.decode_context_tokens,
            self.decode_context_tokens - d,
            d,
            d,
            self.decode_context_tokens,
            self.decode_keys,
        )
        prefill = StepShape(
            self.prefill_tokens,
            0,
            self.prefill_context_tokens,
            self.prefill_kv_read_tokens,
            self.num_seqs - d,
            self.sampled_tokens - d,
            prefill_square_tokens=self.prefill_square_tokens,
        )
        return prefill, decode

    @staticmethod
    def from_chunks(chunks: Iterable[tuple[int, int, bool]], block_size: int = DEFAULT_BLOCK_SIZE) -> StepShape:
        """From ``(start, num_tokens, samples)`` per chunk. A 1-token sampling chunk is a decode."""
        prefill = decode = context = kv_read = seqs = sampled = square = 0
        decode_contexts = []
        for start, n, samples in chunks:
            if n == 1 and samples:
                decode += 1
                decode_contexts.append(start + 1)
            else:
                prefill += n
                square += n * (start + n)
            context += chunk_context_tokens(start, n)
            kv_read += start
            seqs += 1
            sampled += int(samples)
        keys = decode_keys(decode_contexts, block_size)
        return StepShape(prefill, decode, context, kv_read, seqs, sampled, sum(decode_contexts), keys, square)

    @staticmethod
    def from_output(output: SchedulerOutput, block_size: int = DEFAULT_BLOCK_SIZE) -> StepShape:
        """From the engine scheduler's ``SchedulerOutput``."""
        return StepShape.from_chunks(((c.start, len(c.token_ids), c.samples) for c in output.chunks), block_size)

    @staticmethod
    def from_stats(
        step: StepStats, decode_contexts: Sequence[int] | None = None, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> StepShape:
        """From a measured (or simulated) step record. Sampled tokens are not recorded: one per
        decode, plus one when the step carries prefill tokens (an estimate; only the roofline uses it).

        A record keeps only the decodes' summed context, not each one: ``decode_contexts`` (every
        decode's context length, e.g. read off the requests' token times) gives the padded
        ``decode_keys`` exactly when it agrees with the record (as many decodes, the same sum); without
        it the decodes are taken as equally long (no padding beyond the block). ``prefill_square_tokens`` is
        exact for one prompt chunk (``n * (start + n)`` from its keys attended), an estimate for several."""
        sampled = step.num_decode_tokens + int(step.num_prefill_tokens > 0)
        d, total = step.num_decode_tokens, step.num_decode_context_tokens
        if decode_contexts is not None and len(decode_contexts) == d and sum(decode_contexts) == total:
            keys = decode_keys(decode_contexts, block_size)
        else:
            keys = d * _round_up(-(-total // d), block_size) if d else 0
        n = step.num_prefill_tokens
        prefill_context = step.num_context_tokens - total
        return StepShape(
            step.num_prefill_tokens,
            step.num_decode_tokens,
            step.num_context_tokens,
            step.num_kv_read_tokens,
            step.num_seqs,
            sampled,
            total,
            keys,
            prefill_context + n * (n - 1) // 2 if n else 0,
        )

    def to_stats(self, worker: str, started: float, duration_s: float, num_preempted: int = 0) -> StepStats:
        """The step record of a simulated step of this shape."""
        return StepStats(
            started,
            duration_s,
            0.0,
            self.prefill_tokens,
            self.decode_tokens,
            self.num_seqs,
            num_preempted,
            self.context_tokens,
            self.decode_context_tokens,
            self.kv_read_tokens,
            worker,
        )


def _round_up(n: int, block_size: int) -> int:
    return -(-n // block_size) * block_size


def decode_keys(contexts: Iterable[int], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Keys read by the decode attention of decodes with these context lengths, as the engine runs it:
    sorted by length, in groups of ``DECODE_GROUP_SIZE``, each decode padded to its group's longest
    context rounded up to whole blocks of ``block_size``."""
    ordered = sorted(contexts)
    keys = 0
    for g in range(0, len(ordered), DECODE_GROUP_SIZE):
        group = ordered[g : g + DECODE_GROUP_SIZE]
        keys += len(group) * _round_up(group[-1], block_size)
    return keys


def linear_features(shape: StepShape) -> tuple[float, ...]:
    """The linear model's regressors, in ``LINEAR_TERMS`` order: 1, prefill tokens, decode tokens,
    prefill context (keys attended by prefill tokens), decode keys (padded, ``decode_keys``), prefill KV
    read; then one indicator per step size of 1 ... ``SMALL_STEP_TOKENS`` tokens (1 for the step's own)."""
    n = shape.num_tokens
    return (
        1.0,
        float(shape.prefill_tokens),
        float(shape.decode_tokens),
        float(shape.prefill_context_tokens),
        float(shape.decode_keys),
        float(shape.prefill_kv_read_tokens),
        *_SMALL_STEPS[min(n, SMALL_STEP_TOKENS + 1)],
    )


# indicator rows: _SMALL_STEPS[n] for a step of n tokens (n > SMALL_STEP_TOKENS and 0 share the all-zero row)
_SMALL_STEPS = [
    tuple(1.0 if n == j else 0.0 for j in range(1, SMALL_STEP_TOKENS + 1)) for n in range(SMALL_STEP_TOKENS + 2)
]


class ModelInfo(Protocol):
    """What the simulator and its callers read of a cost model's model: a ``ModelProfile``, or a cost
    profile file's (``sim.cost_profile.ProfileModel``)."""

    @property
    def name(self) -> str: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def max_context(self) -> int: ...


class CostModel(Protocol):
    """Anything that prices a step. ``kv_bytes_per_token`` sizes KV transfers (whole model, all ranks).

    ``role`` names the instance's place in the deployment (``ROLES``: a colocated instance, a prefill
    instance, or a decode instance next to prefill instances); a model may price them differently.
    The price is deterministic: what a loaded machine adds on top is ``SimConfig``'s (the slowdown trace)."""

    name: str
    kv_bytes_per_token: int

    @property
    def model(self) -> ModelInfo: ...

    def step_time(self, shape: StepShape, role: str = "colocated") -> float: ...

    def kv_capacity_tokens(self) -> int: ...


DecodePricer = Callable[[int, int, int], float]
"""Seconds of a decode-only step of a fixed batch from ``(context_tokens, kv_read_tokens, decode_keys)``."""


def decode_pricer(cost_model: CostModel, num_seqs: int, role: str) -> tuple[DecodePricer, bool]:
    """``(price, reads_keys)``: the price of decode-only steps of ``num_seqs`` sequences on ``cost_model``
    (``step_time`` of the shape those three numbers complete), bit for bit, and whether it reads
    ``decode_keys`` (else any value will do). The model's own ``decode_pricer`` when it has one (the
    simulator calls the price once per step of a coalesced decode run, so it should be cheap; such a
    model's price reads no keys), else ``step_time`` of the whole ``StepShape``."""
    own = getattr(cost_model, "decode_pricer", None)
    if own is not None:
        return own(num_seqs, role), False

    def price(context_tokens: int, kv_read_tokens: int, keys: int) -> float:
        shape = StepShape(0, num_seqs, context_tokens, kv_read_tokens, num_seqs, num_seqs, context_tokens, keys)
        return cost_model.step_time(shape, role)

    return price, True


class StepCost(NamedTuple):
    """A roofline step's parts (seconds); ``total`` is what the simulator advances the clock by."""

    overhead: float
    gemm: float
    prefill_attention: float
    decode_attention: float
    elementwise: float
    all_reduce: float
    pipeline: float
    total: float
    compute: float = 0.0  # the kernels' compute-bound times, summed (matrix products and attention)
    memory: float = 0.0  # their memory-bound times, summed (weights, KV, activations)


COMBINES = ("smooth", "max", "sum")


def blend(compute: float, memory: float, combine: str = "smooth") -> float:
    """A kernel's time from its compute-bound and its memory-bound time: ``sqrt(c**2 + m**2)`` (``smooth``),
    ``max(c, m)`` or ``c + m``."""
    if combine == "smooth":
        return math.sqrt(compute * compute + memory * memory)
    return max(compute, memory) if combine == "max" else compute + memory


class RooflineCostModel:
    """Roofline step time of ``model`` on an instance of ``tp`` x ``pp`` GPUs of ``hardware`` (see the module
    docstring). ``pp`` pipeline stages split the layers: a step's latency is every stage's in turn plus the
    hand-offs between them; the stages work on ``pp`` steps at once (the simulator runs a pipelined
    instance as ``pp`` engines, each with its share of the KV pool)."""

    def __init__(
        self, hardware: HardwareProfile, model: ModelProfile, tp: int = 1, combine: str = "smooth", pp: int = 1
    ) -> None:
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")
        if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
            raise ValueError(f"tp={tp} does not divide {model.name}'s {model.num_heads} heads")
        if model.num_layers % pp:
            raise ValueError(f"pp={pp} does not divide {model.name}'s {model.num_layers} layers")
        self.hardware = hardware
        self.model = model
        self.tp = tp
        self.pp = pp
        self.combine = combine
        shape = f"x{tp}" if pp == 1 else f"x{tp}x{pp}pp"
        self.name = f"{hardware.name}{shape}/{model.name}"
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._flops = hardware.peak_flops * hardware.mfu * tp
        self._bw = hardware.mem_bw * hardware.bw_efficiency * tp

    def breakdown(self, shape: StepShape) -> StepCost:
        """The step's parts and their sum (0 for an empty step)."""
        return self._parts(
            shape.num_tokens,
            shape.sampled_tokens,
            shape.num_seqs,
            shape.prefill_tokens,
            shape.prefill_context_tokens,
            shape.prefill_kv_read_tokens,
            shape.decode_context_tokens,
        )

    def _parts(
        self,
        tokens: int,
        sampled: int,
        seqs: int,
        prefill_tokens: int,
        prefill_context: int,
        prefill_kv_read: int,
        decode_context: int,
    ) -> StepCost:
        if not tokens:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        m, hw, tp, flops, bw, combine = self.model, self.hardware, self.tp, self._flops, self._bw, self.combine
        overhead = hw.step_overhead_s + hw.seq_overhead_s * seqs
        gemm_flops = 2 * m.matmul_params * tokens + 2 * m.lm_head_params * sampled
        gemm_bytes = (m.matmul_params + (m.lm_head_params if sampled else 0)) * m.dtype_bytes
        gemm_c, gemm_m = gemm_flops / flops, gemm_bytes / bw
        gemm = blend(gemm_c, gemm_m, combine)
        attn, kv = m.attn_flops_per_context_token, m.kv_bytes_per_token
        prefill_c = attn * prefill_context / flops if prefill_tokens else 0.0
        prefill_m = kv * (prefill_kv_read + prefill_tokens) / bw if prefill_tokens else 0.0
        prefill = blend(prefill_c, prefill_m, combine) if prefill_tokens else 0.0
        decode_c, decode_m = attn * decode_context / flops, kv * decode_context / bw
        decode = blend(decode_c, decode_m, combine) if decode_context else 0.0
        elementwise = m.activation_bytes_per_token * tokens / bw
        payload = tokens * m.hidden_size * m.dtype_bytes
        all_reduce = 0.0
        if tp > 1:
            all_reduce = 2 * m.num_layers * (hw.allreduce_latency_s + 2 * (tp - 1) / tp * payload / hw.interconnect_bw)
        pipeline = (self.pp - 1) * (hw.p2p_latency_s + payload / hw.interconnect_bw)
        total = overhead + gemm + prefill + decode + elementwise + all_reduce + pipeline
        compute = gemm_c + prefill_c + decode_c
        memory = gemm_m + prefill_m + decode_m + elementwise
        return StepCost(overhead, gemm, prefill, decode, elementwise, all_reduce, pipeline, total, compute, memory)

    def step_time(self, shape: StepShape, role: str = "colocated") -> float:
        """The roofline prices every role alike (a prefill instance just never runs decodes)."""
        return self.breakdown(shape).total

    def decode_pricer(self, num_seqs: int, role: str = "colocated") -> DecodePricer:
        """``step_time`` of decode-only steps of ``num_seqs`` sequences: the same arithmetic (``_parts``), the
        same floats."""
        parts = self._parts

        def price(context_tokens: int, kv_read_tokens: int, keys: int) -> float:
            return parts(num_seqs, num_seqs, num_seqs, 0, 0, 0, context_tokens).total

        return price

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in one instance (``tp`` x ``pp`` GPUs) after the weights, at the hardware's
        ``gpu_memory_utilization`` (vLLM's). Raises ValueError if the weights alone do not fit."""
        hw, m = self.hardware, self.model
        free = hw.mem_bytes * hw.gpu_memory_utilization * self.tp * self.pp - m.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{m.name} ({m.weight_bytes / 1e9:.0f} GB of weights) does not fit on {self.tp * self.pp} x "
                f"{hw.name}; raise --tp"
            )
        return int(free // m.kv_bytes_per_token)


class LinearCostModel:
    """The calibrated per-role linear step time (cpu-measured). ``model`` sizes KV; TP is not modelled."""

    def __init__(self, profile: LinearProfile, model: ModelProfile) -> None:
        self.profile = profile
        self.model = model
        self.name = f"{profile.name}/{model.name}"
        self.kv_bytes_per_token = model.kv_bytes_per_token

    def step_time(self, shape: StepShape, role: str = "colocated") -> float:
        if shape.num_tokens == 0:
            return 0.0
        return self.profile.fit_for(role).predict(linear_features(shape))

    def kv_capacity_tokens(self) -> int:
        return int(self.profile.kv_memory_bytes // self.model.kv_bytes_per_token)
