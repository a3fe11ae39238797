"""Hardware and model profiles for the step-time cost model.

Hardware figures are datasheet peaks (dense bf16 tensor FLOP/s without sparsity, HBM bandwidth,
per-GPU NVLink bandwidth in one direction) times achievable fractions (``mfu`` for matmuls,
``bw_efficiency`` for streaming reads) that are typical of tuned serving kernels, not measurements.
``cpu-measured`` is not a roofline: it is a per-role linear step-time fit (``sim.calibrate``) of
our own engine on this machine, loaded from a calibration JSON.

Model profiles count parameters from the architecture (Llama family: GQA attention, SwiGLU MLP).
The ``tiny`` and ``bench`` entries are the engine presets (``engine.config.ModelConfig.preset``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (one tensor-parallel rank). Rates are peak; the fractions say how much is reached.

    ``mfu`` is what a large matrix product reaches of ``peak_flops``; a small one (a decode step's few
    rows) is bandwidth-bound, and the roofline blends the two (``RooflineCostModel``), so the achieved
    fraction grows with the rows. The per-step cost is ``step_overhead_s`` plus ``seq_overhead_s`` per
    sequence in the step (scheduling, input preparation, sampling and output handling grow with the batch).
    ``gpu_memory_utilization`` is vLLM's: the share of ``mem_bytes`` for the weights and the KV cache.
    """

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float  # HBM capacity
    mfu: float = 0.7  # fraction of peak_flops a large matrix product reaches
    bw_efficiency: float = 0.8  # achievable fraction of mem_bw
    step_overhead_s: float = 0.0015  # fixed per-step cost: scheduling, launches, sampling
    seq_overhead_s: float = 10e-6  # per sequence in the step: its inputs, its sample, its output
    interconnect_bw: float = 300 * GB  # per-GPU, one direction (NVLink), for tensor-parallel all-reduce
    allreduce_latency_s: float = 10e-6  # per all-reduce call
    p2p_latency_s: float = 10e-6  # per pipeline-stage hand-off (send/recv of the activations)
    gpu_memory_utilization: float = 0.9  # fraction of mem_bytes for weights + KV cache
    kv_link_bw: float = 25 * GB  # default KV link between a prefill and a decode instance (bytes/s)
    kv_link_latency_s: float = 20e-6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GIB = 2**30
# Datasheet numbers: A100 SXM4 80GB (312 TFLOP/s bf16, 2.04 TB/s, NVLink3 600 GB/s both ways),
# H100 SXM5 80GB (989 TFLOP/s, 3.35 TB/s, NVLink4 900 GB/s), H200 SXM 141GB (989 TFLOP/s, 4.8 TB/s).
# kv_link_bw: one 200 Gb/s (A100) or 400 Gb/s (H100/H200) RDMA NIC per GPU.
# A100's fractions are measured: Vidur's published A100 profile of Llama-3-8B's matrix products
# (microsoft/vidur, data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv, medians) reaches 74.5 % of
# peak at 32,768 rows and streams the 436 MB of one layer's weights in 0.276 ms at 1 row (77.5 % of HBM
# bandwidth). The H100 and H200 fractions are assumptions of the same order (no such profile was at hand).
HARDWARE: dict[str, HardwareProfile] = {
    "A100": HardwareProfile(
        "A100",
        312 * TFLOPS,
        2.039e12,
        80 * GIB,
        mfu=0.745,
        bw_efficiency=0.775,
        interconnect_bw=300 * GB,
        kv_link_bw=25 * GB,
    ),
    "H100": HardwareProfile("H100", 989 * TFLOPS, 3.35e12, 80 * GIB, interconnect_bw=450 * GB, kv_link_bw=50 * GB),
    "H200": HardwareProfile("H200", 989 * TFLOPS, 4.8e12, 141 * GB, interconnect_bw=450 * GB, kv_link_bw=50 * GB),
}
CPU_MEASURED = "cpu-measured"
HARDWARE_NAMES = (*HARDWARE, CPU_MEASURED)


@dataclass(frozen=True)
class ModelProfile:
    """A Llama-family decoder's shape; parameter, FLOP and byte counts derive from it."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    max_context: int = 131072  # the longest sequence the model takes (Llama 3.1's 128k)

    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h  # + the two RMSNorm weights

    @property
    def num_params(self) -> int:
        """All parameters (embedding counted once when tied)."""
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * self.params_per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies by (the decoder layers; not the embedding lookup or LM head)."""
        return self.num_layers * self.params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Every weight's bytes (what the GPU holds)."""
        return self.num_params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """Weights a step streams when it samples: the decoder layers and the LM head. The embedding table is
        read a row per token (tied to the LM head or not), not streamed."""
        return (self.matmul_params + self.lm_head_params) * self.dtype_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """Bytes one token moves through the memory-bound element-wise kernels of all layers: two RMSNorms (read
        and write the hidden state), RoPE on the queries and keys, the SwiGLU activation (read gate and up, write
        the product), two residual adds (read two, write one)."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        per_layer = 4 * h + 2 * (self.num_heads + self.num_kv_heads) * d + 3 * inter + 6 * h
        return self.num_layers * per_layer * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_context_token(self) -> int:
        """FLOPs one query spends per attended key: QK^T and PV, 2 FLOPs per multiply-add, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(num_params=self.num_params, kv_bytes_per_token=self.kv_bytes_per_token)
        return d


MODELS: dict[str, ModelProfile] = {
    "Llama-3-8B": ModelProfile("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "Llama-3-70B": ModelProfile("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "Mistral-7B": ModelProfile("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32000, max_context=32768),
    # OPT-13B: multi-head attention and a two-matrix GELU MLP (5120 x 20480); the SwiGLU intermediate size
    # that counts the same parameters (2 x 20480 / 3) stands in for it
    "OPT-13B": ModelProfile("OPT-13B", 40, 5120, 40, 40, 128, 13653, 50272, tie_word_embeddings=True, max_context=2048),
    "tiny": ModelProfile("tiny", 4, 256, 8, 4, 32, 768, 260, 4, tie_word_embeddings=True, max_context=4096),
    "bench": ModelProfile("bench", 8, 512, 8, 4, 64, 1536, 260, 4, tie_word_embeddings=True, max_context=8192),
}


def get_hardware(name: str) -> HardwareProfile:
    """A GPU profile by name (case-insensitive). ``cpu-measured`` is a calibration file: use
    ``load_linear_profile``. Raises ValueError for unknown names."""
    for key, hw in HARDWARE.items():
        if key.lower() == name.lower():
            return hw
    raise ValueError(f"hardware: unknown profile {name!r} (known: {', '.join(HARDWARE_NAMES)})")


def get_model(name: str) -> ModelProfile:
    """A model profile by name (case-insensitive). Raises ValueError for unknown names."""
    for key, m in MODELS.items():
        if key.lower() == name.lower():
            return m
    raise ValueError(f"model profile: unknown {name!r} (known: {', '.join(MODELS)})")


SMALL_STEP_TOKENS = 8  # a step of 1 ... this many tokens has a cost of its own on top of the linear terms
BASE_TERMS = (
    "fixed_s",  # per step
    "per_prefill_token_s",
    "per_decode_token_s",
    "per_prefill_context_token_s",  # per key attended by a prefill token
    "per_decode_key_s",  # per key a decode token's attention reads, padded as the engine pads (its KV read included)
    "per_prefill_kv_read_token_s",  # per cached token a prefill chunk reads (gathers) before its own keys
)
# per step of exactly n tokens: the matrix kernels' cost is not linear in a few rows (a CPU kernel may
# multiply 2-4 rows at one speed, so a decode step of 2 or 3 sequences costs about as much as one of 4)
SMALL_STEP_TERMS = tuple(f"step_of_{n}_tokens_s" for n in range(1, SMALL_STEP_TOKENS + 1))
LINEAR_TERMS = BASE_TERMS + SMALL_STEP_TERMS
RATIO_PERCENTILES = tuple(range(101))
# A role without a fit of its own takes this one's (then ``all``'s): an auto deployment's decode
# instance is a decode instance that also runs the prompts the router keeps local.
ROLE_FALLBACK = {"auto-decode": "decode"}  # where RoleFit.ratio_percentiles samples measured/predicted


def quantile_at(percentiles: tuple[float, ...], u: float, default: float = 0.0) -> float:
    """Interpolate a table of evenly spaced percentiles (0 ... 100) at quantile ``u`` in [0, 1]."""
    if not percentiles:
        return default
    if len(percentiles) == 1:
        return percentiles[0]
    x = min(max(u, 0.0), 1.0) * (len(percentiles) - 1)
    i = min(int(x), len(percentiles) - 2)
    return percentiles[i] + (percentiles[i + 1] - percentiles[i]) * (x - i)


@dataclass(frozen=True)
class RoleFit:
    """One role's linear step time (``LINEAR_TERMS`` coefficients, seconds) and how well it fits.

    ``ratio_percentiles``: measured / predicted step time over *all* the role's records (slow ones
    included) at percentiles 0, 1, ..., 100: the body and the tail of what the machine adds on top of
    the fit. ``ratio_at(u)`` interpolates it.
    The quality figures (``r2``, ``rms_residual_s``, the relative errors) are over every record.
    Coefficients of the ``BASE_TERMS`` alone (a fit made before the small-step terms) leave those at 0.
    """

    coefficients: tuple[float, ...]
    num_records: int = 0
    r2: float = 0.0
    rms_residual_s: float = 0.0
    mean_abs_rel_error: float = 0.0
    median_abs_rel_error: float = 0.0
    ratio_percentiles: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.coefficients) == len(BASE_TERMS):
            object.__setattr__(self, "coefficients", (*self.coefficients, *(0.0,) * len(SMALL_STEP_TERMS)))
        if len(self.coefficients) != len(LINEAR_TERMS):
            raise ValueError(f"RoleFit: need {len(LINEAR_TERMS)} coefficients ({', '.join(LINEAR_TERMS)})")

    def predict(self, features: tuple[float, ...]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features, strict=True))

    def ratio_at(self, u: float) -> float:
        """The measured/predicted ratio at quantile ``u`` in [0, 1] (1.0 when none was recorded)."""
        return quantile_at(self.ratio_percentiles, u, 1.0)

    def terms(self) -> dict[str, float]:
        return dict(zip(LINEAR_TERMS, self.coefficients, strict=True))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["coefficients"] = self.terms()
        d["ratio_percentiles"] = [round(x, 4) for x in self.ratio_percentiles]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RoleFit:
        coef = d["coefficients"]
        if isinstance(coef, dict):  # a file of before the small-step terms has none of them
            coef = tuple(float(coef[t]) for t in BASE_TERMS) + tuple(float(coef.get(t, 0.0)) for t in SMALL_STEP_TERMS)
        else:
            coef = tuple(coef)
        known = {f.name for f in fields(RoleFit)} - {"coefficients", "ratio_percentiles"}
        rest = {k: v for k, v in d.items() if k in known}
        return RoleFit(coef, ratio_percentiles=tuple(d.get("ratio_percentiles", ())), **rest)


@dataclass(frozen=True)
class LinearProfile:
    """A measured step-time model of our engine on this machine (``sim.calibrate`` writes it as
    the cpu-measured JSON): one ``RoleFit`` per role (``colocated``, ``prefill``, ``decode``; ``all``
    fits every record and stands in for a role that has none), plus what the deployment and the machine
    add around the steps, as measured: the KV link; ``token_latency_s`` (a worker's step end to the
    client's receipt of its tokens, median); ``control_latency_s`` (one call from the client or router to
    a worker, median; ``control_latency_percentiles`` its distribution); between a disaggregated
    deployment's workers, ``reserve_latency_s`` (a reservation's round trip) and ``handoff_latency_s``
    (the first token sampled on the prefill worker to the decode call on the decode worker), medians,
    None when the calibration runs held no case to measure them on; ``step_gap_s`` (a busy engine
    loop's time between two steps, median); and the machine's slowdown: per ``slowdown_window_s`` of a
    worker's time, measured step time over the fit's, at percentiles 0 ... 100 (``slowdown_percentiles``).
    Valid for the model it was measured on.
    """

    model: str
    roles: dict[str, RoleFit]
    kv_link_bw: float = 2 * GB  # below what NIXL moves between two processes on one machine (docs/benchmarks.md)
    kv_link_latency_s: float = 200e-6
    token_latency_s: float = 0.0
    control_latency_s: float = 0.0
    control_latency_percentiles: tuple[float, ...] = ()
    step_gap_s: float = 0.0
    reserve_latency_s: float | None = None
    handoff_latency_s: float | None = None
    slowdown_window_s: float = 0.1
    slowdown_percentiles: tuple[float, ...] = ()
    run_slowdown_percentiles: tuple[float, ...] = ()
    co_run_slowdown: float = 0.0
    kv_memory_bytes: float = 0.5 * 2**30  # the engine's default kv_cache_memory_gb
    name: str = CPU_MEASURED
    measured_at: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        if "all" not in self.roles:
            raise ValueError("LinearProfile: roles must include 'all' (the fit over every record)")

    def fit_for(self, role: str) -> RoleFit:
        """``role``'s fit, else its fallback role's (``auto-decode``: ``decode``), else ``all``."""
        fallback = ROLE_FALLBACK.get(role, "all")
        return self.roles.get(role) or self.roles.get(fallback) or self.roles["all"]

    def sim_settings(self) -> dict[str, Any]:
        """``SimConfig`` fields this profile sets: the KV link, the deployment's latencies, the machine's slowdown."""
        names: tuple[str, ...] = ("kv_link_bw", "kv_link_latency_s", "token_latency_s", "control_latency_s")
        names += ("control_latency_percentiles", "step_gap_s", "slowdown_window_s", "slowdown_percentiles")
        names += ("co_run_slowdown", "reserve_latency_s", "handoff_latency_s")
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["roles"] = {k: v.to_dict() for k, v in self.roles.items()}
        d["control_latency_percentiles"] = [round(x, 6) for x in self.control_latency_percentiles]
        d["slowdown_percentiles"] = [round(x, 4) for x in self.slowdown_percentiles]
        d["run_slowdown_percentiles"] = [round(x, 4) for x in self.run_slowdown_percentiles]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> LinearProfile:
        """Raises ValueError for a file of another shape (e.g. the single-fit profiles of before)."""
        if not isinstance(d.get("roles"), dict):
            raise ValueError("not a per-role calibration (no 'roles'); calibrate again")
        known = {f.name for f in fields(LinearProfile)} - {"roles"}
        roles = {k: RoleFit.from_dict(v) for k, v in d["roles"].items()}
        rest = {k: v for k, v in d.items() if k in known}
        for name in ("control_latency_percentiles", "slowdown_percentiles", "run_slowdown_percentiles"):
            rest[name] = tuple(rest.get(name, ()))
        return LinearProfile(roles=roles, **rest)


def save_linear_profile(profile: LinearProfile, path: str) -> None:
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=2)
        f.write("\n")


def load_linear_profile(path: str) -> LinearProfile:
    """Read a calibration JSON. Raises ValueError (with the path) when it is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            return LinearProfile.from_dict(json.load(f))
    except FileNotFoundError:
        raise ValueError(
            f"hardware cpu-measured: no calibration file at {path} (run `pdserve sim --calibrate` first)"
        ) from None
    except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
        raise ValueError(f"hardware cpu-measured: {path} is not a calibration JSON: {e}") from None
