"""Log-probabilities of sampled tokens (and the most likely alternatives), from the engine's own logits."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.sampler import token_logprobs


def test_token_logprobs_are_the_log_softmax_of_the_rows():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    out = token_logprobs(logits, [2, 3], [2, 0])
    reference = torch.log_softmax(logits, dim=-1)
    assert out[0].logprob == pytest.approx(reference[0, 2].item())
    assert [t for t, _ in out[0].top] == [1, 2]
    assert [v for _, v in out[0].top] == pytest.approx([reference[0, 1].item(), reference[0, 2].item()])
    assert out[1].logprob == pytest.approx(reference[1, 3].item()) and out[1].top == []


def test_the_engine_reports_logprobs_only_for_requests_that_ask():
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, torch_threads=1, seed=0))
    asks = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3))
    plain = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    got: dict[str, list] = {asks: [], plain: []}
    tokens: dict[str, list[int]] = {asks: [], plain: []}
    for _ in range(50):
        for out in engine.step(keep_logits=True):
            tokens[out.request_id] += out.new_token_ids
            got[out.request_id].append(out.logprobs)
            if out.request_id == asks and engine.last_logits is not None:
                reference = torch.log_softmax(engine.last_logits[asks].float(), dim=-1)
                (lp,) = out.logprobs
                assert lp.logprob == pytest.approx(reference[out.new_token_ids[0]].item(), abs=1e-5)
        if len(tokens[asks]) == 5 and len(tokens[plain]) == 5:
            break
    assert all(lps is None for lps in got[plain])
    assert len(got[asks]) == 5
    for (lp,), token in zip(got[asks], tokens[asks], strict=True):
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)  # greedy: the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_bad_logprobs_counts_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)
