"""Token sampling whose randomness depends only on (request seed, output token index)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def draw_seed(seed: int, token_index: int) -> int:
    """A 63-bit generator seed for one draw; the same on every worker."""
    x = (seed * _MIX + token_index + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
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


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], token_indices: list[int]) -> list[int]:
    """Pick one token per row of ``logits`` ([B, vocab], float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scores = logits[row] / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        generator = torch.Generator(device="cpu").manual_seed(draw_seed(seeds[row], token_indices[row]))
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=generator)
        tokens[row] = int((probs.cpu() / noise).argmax())
    return tokens
