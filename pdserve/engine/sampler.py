"""Token sampling whose randomness depends only on (request seed, output token index).

One pass over the batch: temperature, top-k and top-p as tensor operations over every sampled row at
once, and the noise of each draw from a counter-based hash of (draw seed, vocabulary index), so a seeded
request gets the same tokens whichever batch it is in, without a generator per draw.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK64 = 0xFFFFFFFFFFFFFFFF


def draw_seed(seed: int, token_index: int) -> int:
    """A 63-bit seed for one draw; the same on every worker."""
    x = (seed * _MIX + token_index + 1) & _MASK64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    return x & 0x7FFFFFFFFFFFFFFF


class TokenLogprobs(NamedTuple):
    """The sampled token's log-probability under the model (before temperature, top-k and top-p), and the
    ``k`` most likely tokens with theirs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities for rows of ``logits`` ([B, vocab]) whose sampled ``tokens`` and top-``ks`` a request
    asked for (``return logprobs``); one log_softmax per row, only for these rows."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device).unsqueeze(-1)).squeeze(-1).tolist()
    k_max = max(ks, default=0)
    if not k_max:
        return [TokenLogprobs(lp, []) for lp in chosen]
    values, indices = logprobs.topk(k_max, dim=-1)
    values_rows, index_rows = values.tolist(), indices.tolist()
    return [
        TokenLogprobs(chosen[row], list(zip(index_rows[row][:k], values_rows[row][:k], strict=True)))
        for row, k in enumerate(ks)
    ]


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits (torch integer arithmetic wraps modulo 2**64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(seeds: torch.Tensor, size: int) -> torch.Tensor:
    """``[len(seeds), size]`` Exp(1) draws, element ``[r, v]`` a function of ``(seeds[r], v)`` only (splitmix64)."""
    x = seeds.view(-1, 1) + (torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device) * _signed(_MIX))
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift_right(x, 31)
    uniform = (_shift_right(x, 11).to(torch.float64) + 1.0) * 2.0**-53  # in (0, 1]
    return (-torch.log(uniform)).to(torch.float32)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], token_indices: list[int]) -> list[int]:
    """Pick one token per row of ``logits`` ([B, vocab], float32)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens.tolist()
    device, vocab = logits.device, logits.shape[-1]
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, device=device)
    temperature = torch.tensor([p.temperature for p in chosen], dtype=torch.float32, device=device)
    scores = logits[index] / temperature.unsqueeze(1)
    top_k = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in chosen]
    if any(top_k):
        kth_values = torch.topk(scores, max(top_k), dim=-1).values
        k = torch.tensor([max(k, 1) for k in top_k], device=device)
        kth = kth_values.gather(1, (k - 1).unsqueeze(1))
        kth = torch.where(torch.tensor(top_k, device=device).unsqueeze(1) > 0, kth, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    top_p = torch.tensor([p.top_p for p in chosen], dtype=torch.float32, device=device).unsqueeze(1)
    if (top_p < 1.0).any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = (cumulative - sorted_probs > top_p) & (top_p < 1.0)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    draw_seeds = [draw_seed(seeds[i], token_indices[i]) for i in rows]
    noise = exponential_noise(torch.tensor(draw_seeds, dtype=torch.int64, device=device), vocab)
    # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
    tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()
