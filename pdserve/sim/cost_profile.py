"""A cost profile from a file: per-phase step-time polynomials of the kind papers publish.

The file (JSON, times in milliseconds)::

    {
      "name": "OPT-13B on A100 (DistServe fit)",
      "prefill_ms": {"const": a, "tokens": b, "tokens_sq": c},
      "decode_ms": {"const": d, "context_tokens": e, "batch_size": f},
      "kv_bytes_per_token": g,
      "kv_link_gb_per_s": h
    }

- a step of prefill chunks over ``N`` prompt tokens in all takes ``a + b*N + c*N**2`` ms;
- a step of ``B`` decodes whose context lengths sum to ``S`` takes ``d + e*S + f*B`` ms;
- a mixed (chunked-prefill) step takes the sum of its two parts minus one ``const``: the step's fixed
  cost is paid once, the larger of ``a`` and ``d`` (``b*N + c*N**2 + e*S + f*B + max(a, d)``);
- ``kv_bytes_per_token``: KV bytes of one token over all layers (sizes the prefill-to-decode transfers);
- ``kv_link_gb_per_s``: the prefill-to-decode KV link, GB/s (1e9 bytes).

Optional keys: ``kv_capacity_tokens`` (tokens of KV one instance holds; default ``DEFAULT_KV_CAPACITY_TOKENS``),
``max_context`` (the longest sequence the model takes; default 131072), ``kv_link_latency_us`` (default 20),
``source`` and ``notes`` (free text). Any other key is an error, as is a missing one, a non-number, or a
negative or non-finite coefficient. The polynomials already price the instance's tensor parallelism:
``--tp`` only counts its GPUs (for per-GPU goodput).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.sim.cost_model import StepShape

PREFILL_TERMS = ("const", "tokens", "tokens_sq")
DECODE_TERMS = ("const", "context_tokens", "batch_size")
REQUIRED_KEYS = ("name", "prefill_ms", "decode_ms", "kv_bytes_per_token", "kv_link_gb_per_s")
OPTIONAL_KEYS = ("kv_capacity_tokens", "max_context", "kv_link_latency_us", "source", "notes")
DEFAULT_KV_CAPACITY_TOKENS = 1 << 20
DEFAULT_MAX_CONTEXT = 131072
DEFAULT_KV_LINK_LATENCY_US = 20.0


@dataclass(frozen=True)
class ProfileModel:
    """What the simulator needs of a model when its costs come from a file: a name, the KV size, the
    longest sequence."""

    name: str
    kv_bytes_per_token: int
    max_context: int = DEFAULT_MAX_CONTEXT


@dataclass(frozen=True)
class CostProfile:
    """A validated cost-profile file (coefficients in milliseconds, as written)."""

    name: str
    prefill_ms: tuple[float, float, float]  # const, tokens, tokens_sq
    decode_ms: tuple[float, float, float]  # const, context_tokens, batch_size
    kv_bytes_per_token: int
    kv_link_gb_per_s: float
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS
    max_context: int = DEFAULT_MAX_CONTEXT
    kv_link_latency_us: float = DEFAULT_KV_LINK_LATENCY_US
    source: str = ""
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prefill_ms": dict(zip(PREFILL_TERMS, self.prefill_ms, strict=True)),
            "decode_ms": dict(zip(DECODE_TERMS, self.decode_ms, strict=True)),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_link_gb_per_s": self.kv_link_gb_per_s,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_context": self.max_context,
            "kv_link_latency_us": self.kv_link_latency_us,
            "source": self.source,
            "notes": self.notes,
        }

    def sim_settings(self) -> dict[str, Any]:
        """The ``SimConfig`` fields the file sets: the KV link."""
        return {"kv_link_bw": self.kv_link_gb_per_s * 1e9, "kv_link_latency_s": self.kv_link_latency_us * 1e-6}


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


def _polynomial(where: str, value: Any, terms: tuple[str, ...]) -> tuple[float, float, float]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with keys {', '.join(terms)}, got {value!r}")
    missing = [t for t in terms if t not in value]
    unknown = sorted(set(value) - set(terms))
    if missing or unknown:
        said = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown)}"] if unknown else []
        )
        raise ValueError(f"{where}: {'; '.join(said)} (the keys are {', '.join(terms)})")
    a, b, c = (_number(f"{where}.{t}", value[t]) for t in terms)
    return a, b, c


def parse_cost_profile(doc: Any) -> CostProfile:
    """Validate a decoded cost-profile document. Raises ValueError naming the offending key."""
    if not isinstance(doc, dict):
        raise ValueError(f"the file must hold a JSON object, got {type(doc).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)} (required: {', '.join(REQUIRED_KEYS)})")
    unknown = sorted(set(doc) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)})")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    for key in ("source", "notes"):
        if key in doc and not isinstance(doc[key], str):
            raise ValueError(f"{key} must be a string, got {doc[key]!r}")
    prefill = _polynomial("prefill_ms", doc["prefill_ms"], PREFILL_TERMS)
    decode = _polynomial("decode_ms", doc["decode_ms"], DECODE_TERMS)
    if prefill[0] + prefill[1] == 0 and prefill[2] == 0:
        raise ValueError("prefill_ms: every coefficient is 0 (a prefill would take no time)")
    if decode[0] == 0 and decode[1] == 0 and decode[2] == 0:
        raise ValueError("decode_ms: every coefficient is 0 (a decode would take no time)")
    return CostProfile(
        name=name.strip(),
        prefill_ms=prefill,
        decode_ms=decode,
        kv_bytes_per_token=_integer("kv_bytes_per_token", doc["kv_bytes_per_token"]),
        kv_link_gb_per_s=_number("kv_link_gb_per_s", doc["kv_link_gb_per_s"], strictly=True),
        kv_capacity_tokens=_integer("kv_capacity_tokens", doc.get("kv_capacity_tokens", DEFAULT_KV_CAPACITY_TOKENS)),
        max_context=_integer("max_context", doc.get("max_context", DEFAULT_MAX_CONTEXT)),
        kv_link_latency_us=_number("kv_link_latency_us", doc.get("kv_link_latency_us", DEFAULT_KV_LINK_LATENCY_US)),
        source=doc.get("source", ""),
        notes=doc.get("notes", ""),
    )


def load_cost_profile(path: str) -> CostProfile:
    """Read and validate a cost-profile file. Raises ValueError (naming the file) when it is missing,
    is not JSON, or does not have the documented shape."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--cost-profile: no file at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--cost-profile: cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--cost-profile: {path} is not JSON: {e}") from None
    try:
        return parse_cost_profile(doc)
    except ValueError as e:
        raise ValueError(f"--cost-profile: {path}: {e}") from None


class PolynomialCostModel:
    """Step time from a ``CostProfile``'s per-phase polynomials (see the module docstring); every role
    alike (the papers' fits are per phase, not per deployment)."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.name = profile.name
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.model = ProfileModel(profile.name, profile.kv_bytes_per_token, profile.max_context)

    def prefill_ms(self, num_tokens: int) -> float:
        a, b, c = self.profile.prefill_ms
        return a + b * num_tokens + c * num_tokens * num_tokens

    def decode_ms(self, context_tokens: int, batch_size: int) -> float:
        d, e, f = self.profile.decode_ms
        return d + e * context_tokens + f * batch_size

    def decode_pricer(self, num_seqs: int, role: str = "colocated") -> Callable[[int, int, int], float]:
        """``step_time`` of decode-only steps of ``num_seqs`` sequences, the same floats."""
        if not num_seqs:
            return lambda context_tokens, kv_read_tokens, keys: 0.0
        return lambda context_tokens, kv_read_tokens, keys: (0.0 + self.decode_ms(context_tokens, num_seqs)) / 1000.0

    def step_time(self, shape: StepShape, role: str = "colocated") -> float:
        """Seconds: the prefill part over the step's prompt tokens, the decode part over its decodes'
        summed context and count; a step with both pays one fixed cost (the larger)."""
        has_prefill, has_decode = shape.prefill_tokens > 0, shape.decode_tokens > 0
        ms = 0.0
        if has_prefill:
            ms += self.prefill_ms(shape.prefill_tokens)
        if has_decode:
            ms += self.decode_ms(shape.decode_context_tokens, shape.decode_tokens)
        if has_prefill and has_decode:
            ms -= min(self.profile.prefill_ms[0], self.profile.decode_ms[0])
        return ms / 1000.0

    def kv_capacity_tokens(self) -> int:
        return self.profile.kv_capacity_tokens
