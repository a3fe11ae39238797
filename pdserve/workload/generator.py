"""Seedable workload generators: the same spec and seed always give the identical request list.

A workload is a list of ``WorkloadRequest`` sorted by ``arrival_offset_s`` (seconds after the start
of the run). Every generator draws from its own ``numpy.random.Generator(seed)``, never from global
state. Arrival processes follow vLLM's ``bench serve``: inter-arrival gaps are gamma-distributed with
``shape = burstiness`` and ``scale = 1 / (rate * burstiness)`` (burstiness 1 = Poisson, < 1 burstier,
> 1 more regular); ``rate = inf`` sends everything at offset 0. The first request arrives after one
sampled gap, as in vLLM.

Generators: ``random_workload`` (lognormal lengths), ``uniform_workload`` (uniform lengths, all sent at
once: warm-ups and the engine benchmark), ``interference_workload`` (steady decode streams
plus periodic very long prompts), ``sharegpt_workload`` (a local ShareGPT-format JSON file) and
``shared_prefix_workload`` (K system prompts shared by many requests). ``build_workload`` dispatches
on a ``WorkloadSpec``. Random token ids lie in ``[0, 256)``, valid for the byte-level presets.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TOKEN_ID_HIGH = 256  # random token ids are drawn from [0, TOKEN_ID_HIGH): bytes, valid for the presets
WORKLOAD_KINDS = ("random", "interference", "sharegpt", "shared-prefix")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send: prompt tokens, how many tokens to generate, when to send it.

    ``max_tokens`` is the exact output length (benchmarks run with ``ignore_eos``). ``label`` tags a
    request class (``"stream"``/``"long"`` in the interference workload, ``"prefix-3"`` ...).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_offset_s: float
    label: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"{self.request_id}: prompt must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if not self.arrival_offset_s >= 0:
            raise ValueError(f"{self.request_id}: arrival_offset_s must be >= 0, got {self.arrival_offset_s}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that defines a workload, plus the runner's concurrency cap (None = unbounded).

    ``num_requests`` counts the long prompts for ``interference`` (the streams are ``num_streams``).
    Lengths: for ``random`` the prompt/output lengths are lognormal with the given arithmetic mean and
    log-space sigma (0 = constant), clipped to ``[min, max]``. ``interference`` uses ``num_streams``,
    ``stream_*``, ``long_*`` and ``long_period_s``; ``shared-prefix`` uses ``num_prefixes``,
    ``prefix_len``, ``suffix_len`` and ``output_len_mean``; ``sharegpt`` needs ``dataset_path`` and a
    tokenizer passed to ``build_workload``.
    """

    kind: str = "random"
    num_requests: int = 100
    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    prompt_len_mean: float = 512.0
    prompt_len_sigma: float = 0.5
    prompt_len_min: int = 16
    prompt_len_max: int = 4096
    output_len_mean: float = 128.0
    output_len_sigma: float = 0.5
    output_len_min: int = 1
    output_len_max: int = 1024
    # interference
    num_streams: int = 24
    stream_prompt_len: int = 256
    stream_output_len: int = 1024
    long_prompt_len: int = 8192
    long_output_len: int = 16
    long_period_s: float = 1.0
    long_start_s: float = 0.5
    # shared prefix
    num_prefixes: int = 4
    prefix_len: int = 2048
    suffix_len: int = 64
    # sharegpt
    dataset_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload: kind must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")
        if self.num_requests < 1:
            raise ValueError(f"workload: num_requests must be >= 1, got {self.num_requests}")
        _check_arrivals(self.rate, self.burstiness)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"workload: max_concurrency must be None or >= 1, got {self.max_concurrency}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return d


def _check_arrivals(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise ValueError(f"workload: rate must be > 0 requests/s (inf = all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"workload: burstiness must be > 0, got {burstiness}")


def arrival_offsets(
    n: int, rate: float, burstiness: float = 1.0, rng: np.random.Generator | int | None = 0
) -> list[float]:
    """Cumulative send offsets (seconds) of ``n`` requests.

    ``rate = inf`` → all zeros. ``burstiness = inf`` → evenly spaced at ``1/rate``. Otherwise gaps are
    ``Gamma(shape=burstiness, scale=1/(rate*burstiness))`` (mean ``1/rate``; Poisson at burstiness 1).
    """
    _check_arrivals(rate, burstiness)
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [(i + 1) / rate for i in range(n)]
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    gaps = gen.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [float(x) for x in np.cumsum(gaps)]


def lognormal_lengths(n: int, mean: float, sigma: float, low: int, high: int, rng: np.random.Generator) -> list[int]:
    """``n`` integer lengths, lognormal with arithmetic mean ``mean`` and log-space std ``sigma``.

    ``mu = ln(mean) - sigma^2 / 2`` so that ``E[X] = mean`` before rounding and clipping to
    ``[low, high]``. ``sigma = 0`` gives the constant ``round(mean)`` (clipped).
    """
    if not mean > 0 or sigma < 0:
        raise ValueError(f"lengths: mean must be > 0 and sigma >= 0, got mean={mean}, sigma={sigma}")
    if not 1 <= low <= high:
        raise ValueError(f"lengths: need 1 <= min <= max, got min={low}, max={high}")
    mu = math.log(mean) - sigma * sigma / 2.0
    x = rng.lognormal(mu, sigma, size=n) if sigma > 0 else np.full(n, float(mean))
    return [int(v) for v in np.clip(np.rint(x), low, high)]


def random_tokens(n: int, rng: np.random.Generator, high: int = TOKEN_ID_HIGH) -> list[int]:
    return rng.integers(0, high, size=n).tolist()


def random_workload(
    num_requests: int,
    *,
    prompt_len_mean: float = 512.0,
    prompt_len_sigma: float = 0.5,
    prompt_len_min: int = 16,
    prompt_len_max: int = 4096,
    output_len_mean: float = 128.0,
    output_len_sigma: float = 0.5,
    output_len_min: int = 1,
    output_len_max: int = 1024,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Requests with random tokens and lognormal prompt/output lengths, sent at Poisson/gamma times."""
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(num_requests, prompt_len_mean, prompt_len_sigma, prompt_len_min, prompt_len_max, rng)
    outputs = lognormal_lengths(num_requests, output_len_mean, output_len_sigma, output_len_min, output_len_max, rng)
    offsets = arrival_offsets(num_requests, rate, burstiness, rng)
    return [
        WorkloadRequest(f"rand-{i}", random_tokens(p, rng), o, t)
        for i, (p, o, t) in enumerate(zip(prompts, outputs, offsets, strict=True))
    ]


def uniform_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    *,
    seed: int = 0,
    prefix: str = "uni",
    label: str = "",
) -> list[WorkloadRequest]:
    """Requests with random tokens, all sent at once; prompt and output lengths are uniform over the
    inclusive ranges ``(low, high)``. Raises ValueError unless ``1 <= low <= high`` for both."""
    for what, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"uniform workload: {what} needs 1 <= low <= high, got {(low, high)}")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [
        WorkloadRequest(f"{prefix}-{i}", random_tokens(int(p), rng), int(o), 0.0, label)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def interference_workload(
    *,
    num_streams: int = 24,
    stream_prompt_len: int = 256,
    stream_output_len: int = 1024,
    num_long: int = 4,
    long_prompt_len: int = 8192,
    long_output_len: int = 16,
    long_period_s: float = 1.0,
    long_start_s: float = 0.5,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """The long-prompt interference scenario.

    ``num_streams`` streaming requests (label ``"stream"``) with short prompts and long outputs all
    sent at t=0, plus ``num_long`` very long prompts (label ``"long"``) sent at
    ``long_start_s + k * long_period_s``. The streams' ITL shows what each long prefill does to them.
    """
    if num_streams < 0 or num_long < 0 or long_period_s < 0 or long_start_s < 0:
        raise ValueError("interference: counts and times must be >= 0")
    rng = np.random.default_rng(seed)
    reqs = [
        WorkloadRequest(f"stream-{i}", random_tokens(stream_prompt_len, rng), stream_output_len, 0.0, "stream")
        for i in range(num_streams)
    ]
    reqs += [
        WorkloadRequest(
            f"long-{k}",
            random_tokens(long_prompt_len, rng),
            long_output_len,
            long_start_s + k * long_period_s,
            "long",
        )
        for k in range(num_long)
    ]
    return sorted(reqs, key=lambda r: r.arrival_offset_s)


def shared_prefix_workload(
    num_requests: int,
    *,
    num_prefixes: int = 4,
    prefix_len: int = 2048,
    suffix_len: int = 64,
    output_len: int = 128,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``num_prefixes`` long system prompts; each request = one of them (uniformly) + a unique suffix.

    Labels are ``"prefix-<k>"``, so per-prefix behaviour (prefix-cache hits) can be told apart.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise ValueError("shared-prefix: num_prefixes, prefix_len and suffix_len must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [random_tokens(prefix_len, rng) for _ in range(num_prefixes)]
    choice = rng.integers(0, num_prefixes, size=num_requests)
    offsets = arrival_offsets(num_requests, rate, burstiness, rng)
    return [
        WorkloadRequest(f"sp-{i}", prefixes[int(k)] + random_tokens(suffix_len, rng), output_len, t, f"prefix-{int(k)}")
        for i, (k, t) in enumerate(zip(choice, offsets, strict=True))
    ]


def sharegpt_workload(
    path: str,
    tokenize: Callable[[str], Sequence[int]],
    num_requests: int,
    *,
    rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_output_len: int = 1024,
    min_prompt_len: int = 4,
    min_output_len: int = 4,
    fixed_output_len: int | None = None,
) -> list[WorkloadRequest]:
    """Requests from a local ShareGPT-format JSON file.

    The file is a list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}``.
    Prompt = the first human turn, tokenized by ``tokenize`` and truncated to ``max_prompt_len``; output
    length = the token count of the gpt turn that follows it, capped at ``max_output_len`` (or
    ``fixed_output_len``). Conversations without such a pair, or shorter than the minimums, are skipped
    (vLLM drops replies under 4 tokens too). Conversations are sampled in a seeded random order.
    Raises ValueError if fewer than ``num_requests`` usable conversations exist.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"sharegpt: {path} must hold a JSON list of conversations")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    picked: list[tuple[list[int], int]] = []
    for idx in order:
        pair = _first_exchange(data[int(idx)])
        if pair is None:
            continue
        prompt = list(tokenize(pair[0]))[:max_prompt_len]
        out_len = fixed_output_len or min(len(tokenize(pair[1])), max_output_len)
        if len(prompt) < min_prompt_len or out_len < (1 if fixed_output_len else min_output_len):
            continue
        picked.append((prompt, out_len))
        if len(picked) == num_requests:
            break
    if len(picked) < num_requests:
        raise ValueError(f"sharegpt: {path} has only {len(picked)} usable conversations, {num_requests} requested")
    offsets = arrival_offsets(num_requests, rate, burstiness, rng)
    return [WorkloadRequest(f"sg-{i}", p, o, t) for i, ((p, o), t) in enumerate(zip(picked, offsets, strict=True))]


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i in range(len(turns) - 1):
        a, b = turns[i], turns[i + 1]
        if (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.get("from") == "human"
            and b.get("from") == "gpt"
            and isinstance(a.get("value"), str)
            and isinstance(b.get("value"), str)
            and a["value"]
        ):
            return a["value"], b["value"]
    return None


def byte_tokenize(text: str) -> list[int]:
    """UTF-8 bytes: the presets' tokenizer (same ids as ``engine.tokenizer.ByteTokenizer``)."""
    return list(text.encode("utf-8"))


@dataclass(frozen=True)
class Workload:
    """A generated workload with the spec that made it."""

    spec: WorkloadSpec
    requests: list[WorkloadRequest] = field(default_factory=list)


def build_workload(spec: WorkloadSpec, tokenize: Callable[[str], Sequence[int]] | None = None) -> Workload:
    """Generate the workload a spec describes (``tokenize`` is used for ShareGPT; default: bytes)."""
    if spec.kind == "random":
        reqs = random_workload(
            spec.num_requests,
            prompt_len_mean=spec.prompt_len_mean,
            prompt_len_sigma=spec.prompt_len_sigma,
            prompt_len_min=spec.prompt_len_min,
            prompt_len_max=spec.prompt_len_max,
            output_len_mean=spec.output_len_mean,
            output_len_sigma=spec.output_len_sigma,
            output_len_min=spec.output_len_min,
            output_len_max=spec.output_len_max,
            rate=spec.rate,
            burstiness=spec.burstiness,
            seed=spec.seed,
        )
    elif spec.kind == "interference":
        reqs = interference_workload(
            num_streams=spec.num_streams,
            stream_prompt_len=spec.stream_prompt_len,
            stream_output_len=spec.stream_output_len,
            num_long=spec.num_requests,
            long_prompt_len=spec.long_prompt_len,
            long_output_len=spec.long_output_len,
            long_period_s=spec.long_period_s,
            long_start_s=spec.long_start_s,
            seed=spec.seed,
        )
    elif spec.kind == "shared-prefix":
        reqs = shared_prefix_workload(
            spec.num_requests,
            num_prefixes=spec.num_prefixes,
            prefix_len=spec.prefix_len,
            suffix_len=spec.suffix_len,
            output_len=max(1, round(spec.output_len_mean)),
            rate=spec.rate,
            burstiness=spec.burstiness,
            seed=spec.seed,
        )
    else:
        if not spec.dataset_path:
            raise ValueError("workload: sharegpt needs dataset_path")
        reqs = sharegpt_workload(
            spec.dataset_path,
            tokenize or byte_tokenize,
            spec.num_requests,
            rate=spec.rate,
            burstiness=spec.burstiness,
            seed=spec.seed,
            max_prompt_len=spec.prompt_len_max,
            max_output_len=spec.output_len_max,
        )
    return Workload(spec, reqs)


# ---- command-line options shared by `pdserve bench` and `pdserve sim` -----------------------------------


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options of ``pdserve bench`` and ``pdserve sim``; see ``workload_spec_from_args``."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload", choices=WORKLOAD_KINDS, default=None, help="default: random (interference for --sweep)"
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (interference: long prompts); default 100, interference 8, --pd-search 400",
    )
    g.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf = all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--prompt-len-mean", type=float, default=512.0)
    g.add_argument("--prompt-len-sigma", type=float, default=0.5)
    g.add_argument("--prompt-len-min", type=int, default=16)
    g.add_argument("--prompt-len-max", type=int, default=4096)
    g.add_argument("--output-len-mean", type=float, default=128.0)
    g.add_argument("--output-len-sigma", type=float, default=0.5)
    g.add_argument("--output-len-min", type=int, default=1)
    g.add_argument("--output-len-max", type=int, default=1024)
    g.add_argument("--num-streams", type=int, default=24, help="interference: steady decode streams")
    g.add_argument("--stream-prompt-len", type=int, default=256)
    g.add_argument("--stream-output-len", type=int, default=1024)
    g.add_argument("--long-prompt-len", type=int, default=8192)
    g.add_argument("--long-output-len", type=int, default=16)
    g.add_argument("--long-period", type=float, default=1.0, help="interference: seconds between long prompts")
    g.add_argument("--long-start", type=float, default=0.5)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=2048)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--dataset", default=None, help="ShareGPT-format JSON (byte tokenizer)")


def workload_spec_from_args(args: argparse.Namespace, kind: str, default_requests: int = 100) -> WorkloadSpec:
    n = args.num_requests or (8 if kind == "interference" else default_requests)
    return WorkloadSpec(
        kind=kind,
        num_requests=n,
        rate=args.rate,
        burstiness=args.burstiness,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        prompt_len_mean=args.prompt_len_mean,
        prompt_len_sigma=args.prompt_len_sigma,
        prompt_len_min=args.prompt_len_min,
        prompt_len_max=args.prompt_len_max,
        output_len_mean=args.output_len_mean,
        output_len_sigma=args.output_len_sigma,
        output_len_min=args.output_len_min,
        output_len_max=args.output_len_max,
        num_streams=args.num_streams,
        stream_prompt_len=args.stream_prompt_len,
        stream_output_len=args.stream_output_len,
        long_prompt_len=args.long_prompt_len,
        long_output_len=args.long_output_len,
        long_period_s=args.long_period,
        long_start_s=args.long_start,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        dataset_path=args.dataset,
    )
