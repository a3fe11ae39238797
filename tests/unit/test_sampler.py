"""The batched sampler: each draw a function of (request seed, token index), with the right distribution."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import draw_uniform, sample
from pdserve.engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def test_a_draws_uniform_number_is_in_0_1_and_uniform_over_seeds_and_token_indices():
    draws = torch.tensor([draw_uniform(seed, i) for seed in range(100) for i in range(100)], dtype=torch.float64)
    assert (draws > 0).all() and (draws <= 1).all()
    assert len(set(draws.tolist())) == len(draws)  # no two draws alike
    assert abs(draws.mean().item() - 0.5) < 0.01 and abs(draws.var().item() - 1 / 12) < 0.005
    deciles = torch.histc(draws.float(), bins=10, min=0, max=1) / len(draws)
    assert (deciles - 0.1).abs().max().item() < 0.015


def test_tokens_of_probability_zero_are_never_drawn_even_at_the_ends_of_the_vocabulary():
    n = 2000
    logits = torch.full((n, 1000), float("-inf"))
    logits[:, 1], logits[:, 998] = 0.0, 1.0  # only tokens 1 and 998 are possible
    tokens = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * n, list(range(n)), [0] * n))
    assert set(tokens.tolist()) == {1, 998}
    share = (tokens == 998).float().mean().item()
    assert abs(share - torch.sigmoid(torch.tensor(1.0)).item()) < 0.04


def test_draws_follow_the_distribution_in_one_batched_call():
    n = 8000
    logits = PROBS.log().expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * n
    tokens = torch.tensor(sample(logits, params, [42] * n, list(range(n))))
    frequencies = torch.bincount(tokens, minlength=4).float() / n
    assert (frequencies - PROBS).abs().max().item() < 0.02


def test_a_seeded_draw_is_the_same_in_any_batch_and_top_k_top_p_cut_the_tail():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
    ]
    seeds, indices = [1, 2, 3, 4, 5, 6], [0, 9, 3, 4, 7, 1]
    together = sample(logits, mixed, seeds, indices)
    alone = [sample(logits[i : i + 1], [mixed[i]], [seeds[i]], [indices[i]])[0] for i in range(6)]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[4] == int(logits[4].argmax())
    for _ in range(3):
        many = sample(logits[1:2].expand(300, -1), [mixed[1]] * 300, [9] * 300, list(range(300)))
        assert set(many) <= set(torch.topk(logits[1], 3).indices.tolist())
    probs = torch.softmax(logits[2] / 0.7, -1)
    order = probs.argsort(descending=True)
    keep = order[: int((probs[order].cumsum(0) - probs[order] <= 0.5).sum())].tolist()
    many = sample(logits[2:3].expand(300, -1), [mixed[2]] * 300, [9] * 300, list(range(300)))
    assert set(many) <= set(keep) and len(set(many)) == len(keep)
