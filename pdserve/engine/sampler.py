"""Token sampling whose randomness depends only on (request seed, output token index).

One pass over the batch: temperature, top-k and top-p as tensor operations over every sampled row at
once, then each row's token by inverse transform: the first token whose cumulative probability reaches
the draw's uniform number, which is a hash of (request seed, token index) (``draw_uniform``). A seeded
request gets the same tokens whichever batch it is in, without a generator per draw, and a draw costs one
cumulative sum of its row (an exponential race would draw an Exp(1) noise for every vocabulary entry, many
times the cost for a large vocabulary; docs/engine.md has the figures).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import PromptLogprob

_MIX = 0x9E3779B97F4A7C15
_MASK64 = 0xFFFFFFFFFFFFFFFF


def draw_seed(seed: int, token_index: int) -> int:
    """A 63-bit seed for one draw; the same on every worker."""
    x = (seed * _MIX + token_index + 1) & _MASK64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    return x & 0x7FFFFFFFFFFFFFFF


def draw_uniform(seed: int, token_index: int) -> float:
    """The uniform number in (0, 1] of one draw (53 bits of ``draw_seed``); the same on every worker."""
    return ((draw_seed(seed, token_index) >> 10) + 1) * 2.0**-53


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


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """For rows of ``logits`` ([N, vocab]: positions of a prompt), the log-probability of the token that
    follows each position (``targets``), its rank (1 + the tokens more likely) and the ``k`` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logits.device).unsqueeze(-1)
    chosen = logprobs.gather(-1, target)
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    values = chosen.squeeze(-1).tolist()
    if not k:
        return [PromptLogprob(v, r, []) for v, r in zip(values, ranks, strict=True)]
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return [
        PromptLogprob(v, r, list(zip(ids, tops, strict=True)))
        for v, r, ids, tops in zip(values, ranks, top_ids.tolist(), top_values.tolist(), strict=True)
    ]


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], token_indices: list[int]) -> list[int]:
    """Pick one token per row of ``logits`` ([B, vocab], float32)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens.tolist()
    device, vocab = logits.device, logits.shape[-1]
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, device=device)
    temperature = torch.tensor([p.temperature for p in chosen], dtype=torch.float32, device=device).unsqueeze(1)
    scores = logits / temperature if len(rows) == len(params) else logits[index].div_(temperature)
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
    uniforms = torch.tensor([draw_uniform(seeds[i], token_indices[i]) for i in rows], device=device).unsqueeze(1)
    # A token of probability 0 adds nothing to the running sum, so it is never the first to reach u times the
    # total (which is > 0). On a CPU the sum runs in float64 and each entry is rounded to float32 on its own,
    # so a token's share is off by at most one float32 step of the sum (~6e-8), never accumulated.
    cumulative = probs.cumsum(dim=-1)
    tokens[index] = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:]).squeeze(1).clamp_(max=vocab - 1)
    return tokens.tolist()
