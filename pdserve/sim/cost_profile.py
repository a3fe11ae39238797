"""A cost profile from a file: per-phase step-time polynomials of the kind papers publish.

The file (JSON, times in milliseconds)::

    {
      "name": "OPT-13B on A100 (DistServe fit)",
      "prefill_ms": {"const": a, "tokens": b, "tokens_sq": c},
      "decode_ms": {"const": d, "context_tokens": e, "batch_size": f},
      "kv_bytes_per_token": g,
      "kv_link_gb_per_s": h
    }

- a step of prompt chunks of ``n_i`` tokens after ``s_i`` cached ones takes ``a + b*N + c*Σ n_i*(s_i + n_i)`` ms
  (``N = Σ n_i``; for whole prompts the quadratic term is ``Σ n_i²``: attention is quadratic per request,
  not in the step's total);
- a step of ``B`` decodes whose context lengths sum to ``S`` takes ``d + e*S + f*B`` ms;
- a mixed (chunked-prefill) step takes the sum of its two parts minus one ``const``: the step's fixed
  cost is paid once, the larger of ``a`` and ``d``;
- ``kv_bytes_per_token``: KV bytes of one token over all layers (sizes the prefill-to-decode transfers);
- ``kv_link_gb_per_s``: the prefill-to-decode KV link, GB/s (1e9 bytes).

Fits per tensor-parallel degree and per role: instead of (or beside) the top-level ``prefill_ms`` and
``decode_ms``, ``fits`` lists ``{"tp": 2, "role": "prefill", "prefill_ms": ..., "decode_ms": ...}`` entries
(``tp`` default 1; ``role`` one of ``all``, ``colocated``, ``prefill``, ``decode``, default ``all``; the
top-level pair is the ``tp`` 1, ``all`` entry). An instance of ``tp`` T in role R takes the ``(T, R)`` fit, else
``(T, all)``; a decode instance under auto takes the decode fit. Any polynomial may come with
``decode_ms_large_batch`` (``{"from_batch_size": 95, "const": ..., "context_tokens": ..., "batch_size": ...}``):
decode steps of at least that many sequences take it instead.

KV capacity (tokens one instance holds): ``kv_capacity_tokens`` when given; else, with ``gpu_memory_gib``
(per GPU) and ``weight_gb`` (the model's weights, 1e9 bytes), what ``gpu_memory_utilization`` (default 0.9, as
vLLM's) of the instance's GPUs holds after the weights; else ``DEFAULT_KV_CAPACITY_TOKENS`` (the caller is told,
``CostProfile.kv_capacity_given``). Optional keys besides: ``max_context`` (the longest sequence the model
takes; default 131072), ``kv_link_latency_us`` (default 20), ``source``, ``licence`` and ``notes`` (free text).
Any other key is an error, as is a missing one, a non-number, or a negative or non-finite coefficient.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.sim.cost_model import StepShape

PREFILL_TERMS = ("const", "tokens", "tokens_sq")
DECODE_TERMS = ("const", "context_tokens", "batch_size")
FIT_ROLES = ("all", "colocated", "prefill", "decode")
REQUIRED_KEYS = ("name", "kv_bytes_per_token", "kv_link_gb_per_s")
OPTIONAL_KEYS = (
    "prefill_ms",
    "decode_ms",
    "decode_ms_large_batch",
    "fits",
    "kv_capacity_tokens",
    "gpu_memory_gib",
    "weight_gb",
    "gpu_memory_utilization",
    "max_context",
    "kv_link_latency_us",
    "source",
    "licence",
    "notes",
)
FIT_KEYS = ("tp", "role", "prefill_ms", "decode_ms", "decode_ms_large_batch")
DEFAULT_KV_CAPACITY_TOKENS = 1 << 20
DEFAULT_MAX_CONTEXT = 131072
DEFAULT_KV_LINK_LATENCY_US = 20.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# the simulator's roles (cost_model.ROLES) and the fit roles that price them, in order of preference
_ROLE_FITS = {
    "colocated": ("colocated", "all"),
    "prefill": ("prefill", "all"),
    "decode": ("decode", "all"),
    "auto-decode": ("decode", "all"),
}
# published profiles shipped with pdserve (pdserve/sim/published_data), by the name --cost-profile takes
PUBLISHED_DIR = os.path.join(os.path.dirname(__file__), "published_data")
PUBLISHED_PROFILES = {
    "distserve-opt-13b-a100": "distserve-opt-13b-a100.distserve.json",
    "vllm-opt-13b-a100": "distserve-opt-13b-a100.vllm.json",
}


@dataclass(frozen=True)
class ProfileModel:
    """What the simulator needs of a model when its costs come from a file: a name, the KV size, the
    longest sequence."""

    name: str
    kv_bytes_per_token: int
    max_context: int = DEFAULT_MAX_CONTEXT


@dataclass(frozen=True)
class PhaseFit:
    """One (TP degree, role)'s polynomials, coefficients in milliseconds as written."""

    prefill_ms: tuple[float, float, float]  # const, tokens, tokens_sq
    decode_ms: tuple[float, float, float]  # const, context_tokens, batch_size
    decode_ms_large_batch: tuple[float, float, float] | None = None
    large_batch_from: int = 0  # decode steps of at least this many sequences take decode_ms_large_batch

    def prefill(self, tokens: int, square_tokens: int) -> float:
        """Milliseconds of a step's prompt chunks: ``a + b*N + c*Σ n*(s + n)``."""
        a, b, c = self.prefill_ms
        return a + b * tokens + c * square_tokens

    def decode_poly(self, batch_size: int) -> tuple[float, float, float]:
        if self.decode_ms_large_batch is not None and batch_size >= self.large_batch_from:
            return self.decode_ms_large_batch
        return self.decode_ms

    def decode(self, context_tokens: int, batch_size: int) -> float:
        """Milliseconds of a step's decodes: ``d + e*S + f*B``."""
        d, e, f = self.decode_poly(batch_size)
        return d + e * context_tokens + f * batch_size

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "prefill_ms": dict(zip(PREFILL_TERMS, self.prefill_ms, strict=True)),
            "decode_ms": dict(zip(DECODE_TERMS, self.decode_ms, strict=True)),
        }
        if self.decode_ms_large_batch is not None:
            d["decode_ms_large_batch"] = {
                "from_batch_size": self.large_batch_from,
                **dict(zip(DECODE_TERMS, self.decode_ms_large_batch, strict=True)),
            }
        return d


@dataclass(frozen=True)
class CostProfile:
    """A validated cost-profile file: its fits by (TP degree, role), the KV sizes and link."""

    name: str
    fits: Mapping[tuple[int, str], PhaseFit]
    kv_bytes_per_token: int
    kv_link_gb_per_s: float
    kv_capacity_tokens: int | None = None
    gpu_memory_gib: float | None = None
    weight_gb: float | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_context: int = DEFAULT_MAX_CONTEXT
    kv_link_latency_us: float = DEFAULT_KV_LINK_LATENCY_US
    source: str = ""
    licence: str = ""
    notes: str = ""

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The TP degrees the file has fits for, ascending."""
        return tuple(sorted({tp for tp, _ in self.fits}))

    @property
    def kv_capacity_given(self) -> bool:
        """Whether the file sizes the KV pool (``kv_capacity_tokens``, or the GPU memory and the weights)."""
        return self.kv_capacity_tokens is not None or (self.gpu_memory_gib is not None and self.weight_gb is not None)

    def fit_for(self, tp: int, role: str) -> PhaseFit:
        """The fit that prices an instance of ``tp`` GPUs in the simulator's ``role``. Raises ValueError
        when the file has none for ``tp``."""
        for fit_role in _ROLE_FITS.get(role, (role, "all")):
            fit = self.fits.get((tp, fit_role))
            if fit is not None:
                return fit
        have = ", ".join(str(t) for t in self.tp_degrees)
        raise ValueError(f"cost profile {self.name!r}: no fit for tp={tp} in role {role} (it has tp {have})")

    def kv_capacity(self, num_gpus: int = 1) -> int:
        """Tokens of KV one instance of ``num_gpus`` GPUs holds (see the module docstring). Raises ValueError
        when the weights alone do not fit."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        if self.gpu_memory_gib is None or self.weight_gb is None:
            return DEFAULT_KV_CAPACITY_TOKENS
        free = self.gpu_memory_gib * 2**30 * self.gpu_memory_utilization * num_gpus - self.weight_gb * 1e9
        if free <= 0:
            raise ValueError(
                f"cost profile {self.name!r}: {self.weight_gb:g} GB of weights do not fit on {num_gpus} GPU(s) of "
                f"{self.gpu_memory_gib:g} GiB at {self.gpu_memory_utilization:g} utilisation"
            )
        return int(free // self.kv_bytes_per_token)

    def sim_settings(self) -> dict[str, Any]:
        """The ``SimConfig`` fields the file sets: the KV link."""
        return {"kv_link_bw": self.kv_link_gb_per_s * 1e9, "kv_link_latency_s": self.kv_link_latency_us * 1e-6}

    def to_dict(self) -> dict[str, Any]:
        fits = [{"tp": tp, "role": role, **fit.to_dict()} for (tp, role), fit in sorted(self.fits.items())]
        d: dict[str, Any] = {
            "name": self.name,
            "fits": fits,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_link_gb_per_s": self.kv_link_gb_per_s,
            "max_context": self.max_context,
            "kv_link_latency_us": self.kv_link_latency_us,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        for key in ("kv_capacity_tokens", "gpu_memory_gib", "weight_gb"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        for key in ("source", "licence", "notes"):
            if getattr(self, key):
                d[key] = getattr(self, key)
        return d


def _number(where: str, value: Any, minimum: float = 0.0, strictly: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < minimum or (strictly and x == minimum):
        bound = f"> {minimum:g}" if strictly else f">= {minimum:g}"
        raise ValueError(f"{where} must be a finite number {bound}, got {value!r}")
    return x


def _integer(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return value


def _keys(where: str, value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with keys {', '.join(required + optional)}, got {value!r}")
    missing = [t for t in required if t not in value]
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing or unknown:
        said = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown)}"] if unknown else []
        )
        raise ValueError(f"{where}: {'; '.join(said)} (the keys are {', '.join(required + optional)})")
    return value


def _polynomial(where: str, value: Any, terms: tuple[str, ...]) -> tuple[float, float, float]:
    value = _keys(where, value, terms)
    a, b, c = (_number(f"{where}.{t}", value[t]) for t in terms)
    if a == 0 and b == 0 and c == 0:
        raise ValueError(f"{where}: every coefficient is 0 (a step would take no time)")
    return a, b, c


def _phase_fit(where: str, doc: Mapping[str, Any]) -> PhaseFit:
    for key in ("prefill_ms", "decode_ms"):
        if key not in doc:
            raise ValueError(f"{where}: missing key {key}")
    large = None
    large_from = 0
    if "decode_ms_large_batch" in doc:
        raw = _keys(f"{where}decode_ms_large_batch", doc["decode_ms_large_batch"], ("from_batch_size", *DECODE_TERMS))
        large_from = _integer(f"{where}decode_ms_large_batch.from_batch_size", raw["from_batch_size"])
        large = _polynomial(f"{where}decode_ms_large_batch", {t: raw[t] for t in DECODE_TERMS}, DECODE_TERMS)
    return PhaseFit(
        _polynomial(f"{where}prefill_ms", doc["prefill_ms"], PREFILL_TERMS),
        _polynomial(f"{where}decode_ms", doc["decode_ms"], DECODE_TERMS),
        large,
        large_from,
    )


def parse_cost_profile(doc: Any) -> CostProfile:
    """Validate a decoded cost-profile document. Raises ValueError naming the offending key."""
    if not isinstance(doc, dict):
        raise ValueError(f"the file must hold a JSON object, got {type(doc).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if "fits" not in doc:
        missing += [k for k in ("prefill_ms", "decode_ms") if k not in doc]
    if missing:
        raise ValueError(
            f"missing key(s) {', '.join(missing)} (required: {', '.join(REQUIRED_KEYS)}, and fits or "
            "prefill_ms with decode_ms)"
        )
    unknown = sorted(set(doc) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)})")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    for key in ("source", "licence", "notes"):
        if key in doc and not isinstance(doc[key], str):
            raise ValueError(f"{key} must be a string, got {doc[key]!r}")
    fits: dict[tuple[int, str], PhaseFit] = {}
    if "prefill_ms" in doc or "decode_ms" in doc or "decode_ms_large_batch" in doc:
        fits[(1, "all")] = _phase_fit("", doc)
    raw_fits = doc.get("fits", [])
    if not isinstance(raw_fits, list):
        raise ValueError(f"fits must be a list of objects, got {raw_fits!r}")
    for i, raw in enumerate(raw_fits):
        where = f"fits[{i}]."
        raw = _keys(f"fits[{i}]", raw, ("prefill_ms", "decode_ms"), ("tp", "role", "decode_ms_large_batch"))
        tp = _integer(f"{where}tp", raw.get("tp", 1))
        role = raw.get("role", "all")
        if role not in FIT_ROLES:
            raise ValueError(f"{where}role must be one of {', '.join(FIT_ROLES)}, got {role!r}")
        if (tp, role) in fits:
            raise ValueError(f"{where[:-1]}: a second fit for tp={tp}, role {role}")
        fits[(tp, role)] = _phase_fit(where, raw)
    utilization = _number("gpu_memory_utilization", doc.get("gpu_memory_utilization", 0.9), strictly=True)
    if utilization > 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    return CostProfile(
        name=name.strip(),
        fits=fits,
        kv_bytes_per_token=_integer("kv_bytes_per_token", doc["kv_bytes_per_token"]),
        kv_link_gb_per_s=_number("kv_link_gb_per_s", doc["kv_link_gb_per_s"], strictly=True),
        kv_capacity_tokens=_integer("kv_capacity_tokens", doc["kv_capacity_tokens"])
        if "kv_capacity_tokens" in doc
        else None,
        gpu_memory_gib=_number("gpu_memory_gib", doc["gpu_memory_gib"], strictly=True)
        if "gpu_memory_gib" in doc
        else None,
        weight_gb=_number("weight_gb", doc["weight_gb"], strictly=True) if "weight_gb" in doc else None,
        gpu_memory_utilization=utilization,
        max_context=_integer("max_context", doc.get("max_context", DEFAULT_MAX_CONTEXT)),
        kv_link_latency_us=_number("kv_link_latency_us", doc.get("kv_link_latency_us", DEFAULT_KV_LINK_LATENCY_US)),
        source=doc.get("source", ""),
        licence=doc.get("licence", ""),
        notes=doc.get("notes", ""),
    )


def resolve_cost_profile(path_or_name: str) -> str:
    """The file of ``path_or_name``: a published profile's name (``PUBLISHED_PROFILES``) or a path."""
    if path_or_name in PUBLISHED_PROFILES:
        return os.path.join(PUBLISHED_DIR, PUBLISHED_PROFILES[path_or_name])
    return path_or_name


def load_cost_profile(path: str) -> CostProfile:
    """Read and validate a cost-profile file (or a published profile by name). Raises ValueError (naming the
    file) when it is missing, is not JSON, or does not have the documented shape."""
    path = resolve_cost_profile(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        published = ", ".join(PUBLISHED_PROFILES)
        raise ValueError(f"--cost-profile: no file at {path} (published profiles: {published})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--cost-profile: cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--cost-profile: {path} is not JSON: {e}") from None
    try:
        return parse_cost_profile(doc)
    except ValueError as e:
        raise ValueError(f"--cost-profile: {path}: {e}") from None


class PolynomialCostModel:
    """Step time from a ``CostProfile``'s polynomials for an instance of ``tp`` x ``pp`` GPUs (see the module
    docstring). ``pp`` pipeline stages each run a ``1/pp`` share of the layers in ``1/pp`` of the time, in turn:
    a step's latency is the fit's, and the stages work on ``pp`` steps at once (the simulator runs a pipelined
    instance as ``pp`` engines), as DistServe's simulator models it (hand-offs between stages not priced)."""

    def __init__(self, profile: CostProfile, tp: int = 1, pp: int = 1) -> None:
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        self.profile = profile
        self.tp = tp
        self.pp = pp
        self._fits = {role: profile.fit_for(tp, role) for role in _ROLE_FITS}
        shape = "" if (tp, pp) == (1, 1) else f" tp{tp}" + (f"pp{pp}" if pp > 1 else "")
        self.name = profile.name + shape
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.model = ProfileModel(profile.name, profile.kv_bytes_per_token, profile.max_context)

    def decode_pricer(self, num_seqs: int, role: str = "colocated") -> Callable[[int, int, int], float]:
        """``step_time`` of decode-only steps of ``num_seqs`` sequences, the same floats."""
        if not num_seqs:
            return lambda context_tokens, kv_read_tokens, keys: 0.0
        fit = self._fits.get(role) or self.profile.fit_for(self.tp, role)
        return lambda context_tokens, kv_read_tokens, keys: (0.0 + fit.decode(context_tokens, num_seqs)) / 1000.0

    def step_time(self, shape: StepShape, role: str = "colocated") -> float:
        """Seconds: the prefill part over the step's prompt chunks, the decode part over its decodes' summed
        context and count; a step with both pays one fixed cost (the larger)."""
        fit = self._fits.get(role) or self.profile.fit_for(self.tp, role)
        has_prefill, has_decode = shape.prefill_tokens > 0, shape.decode_tokens > 0
        ms = 0.0
        if has_prefill:
            ms += fit.prefill(shape.prefill_tokens, shape.prefill_square_tokens)
        if has_decode:
            ms += fit.decode(shape.decode_context_tokens, shape.decode_tokens)
        if has_prefill and has_decode:
            ms -= min(fit.prefill_ms[0], fit.decode_poly(shape.decode_tokens)[0])
        return ms / 1000.0

    def kv_capacity_tokens(self) -> int:
        return self.profile.kv_capacity(self.tp * self.pp)
