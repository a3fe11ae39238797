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
    with pytest.raises(ValueError, match=r"^logprobs"):
        SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match=r"^prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_are_the_reference_models_over_chunks_and_past_the_prefix_cache(tmp_path):
    """Every prompt token's log-probability given those before it, as ``transformers`` computes it (float32), with
    its rank and the k most likely: computed chunk by chunk, and computed even where the prefix cache holds the
    prompt (a cached position has no logits)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=64)
    )
    prompt = [int(t) for t in torch.randint(0, 300, (53,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # the prompt's blocks now cached
    [done] = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
    assert done.num_cached_tokens == 0  # computed, not taken from the cache
    assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(prompt) - 1
    for position, entry in enumerate(done.prompt_logprobs):
        row, token = reference[position], prompt[position + 1]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == 1 + int((row > row[token]).sum())
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    engine.block_manager.check_integrity()


def test_prompt_logprobs_come_once_with_the_first_token():
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, torch_threads=1, seed=0))
    rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0))
    firsts = []
    while engine.has_unfinished_requests():
        firsts += [out.prompt_logprobs for out in engine.step() if out.request_id == rid]
    assert len(firsts) == 3 and firsts[1] is None and firsts[2] is None
    assert len(firsts[0]) == 38 and all(lp.top == [] and lp.rank >= 1 for lp in firsts[0])
