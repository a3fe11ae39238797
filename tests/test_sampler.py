"""The batched sampler: each draw a function of (request seed, token index), with the right distribution."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import draw_seed, exponential_noise, sample
from pdserve.engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def test_noise_of_a_row_depends_only_on_its_seed():
    seeds = torch.tensor([draw_seed(7, 0), draw_seed(7, 1), draw_seed(8, 0)])
    together = exponential_noise(seeds, 1000)
    for row, seed in enumerate(seeds):
        assert torch.equal(exponential_noise(seed.view(1), 1000)[0], together[row])
    assert not torch.equal(together[0], together[1]) and not torch.equal(together[0], together[2])
    big = exponential_noise(torch.tensor([draw_seed(1, 2)]), 200_000)[0]
    assert (big > 0).all() and abs(big.mean().item() - 1.0) < 0.01 and abs(big.std().item() - 1.0) < 0.02


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
