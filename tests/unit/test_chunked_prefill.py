"""Chunked prefill computes exactly what a whole prefill computes: same KV, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.model_runner import ModelRunner, gather_kv

PROMPT_LENGTHS = (37, 150, 203)  # none is a multiple of the block size (16)
CHUNK_SIZES = (1, 7, 16, 100, 1000)  # 1000 is larger than every prompt


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs, and the prompt KV each request left in the cache."""
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), hold_blocks=True)
        for p in prompts
    ]
    while engine.has_unfinished_requests():
        engine.step()
    outputs, kvs = [], []
    for rid, prompt in zip(ids, prompts, strict=True):
        request = engine.held[rid]
        outputs.append(request.output_token_ids)
        kvs.append(gather_kv(engine.kv_cache, request.block_ids, len(prompt)))
        engine.release(rid)
    engine.block_manager.check_integrity()
    assert engine.block_manager.usage().used == 0
    return outputs, kvs


@pytest.fixture(scope="module")
def unchunked_reference():
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            enable_chunked_prefill=False,
            num_kv_blocks=256,
            enable_prefix_caching=False,
            max_model_len=1024,
        )
    )
    return _run(engine, _prompts())


def _chunked_engine(chunk: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            max_num_batched_tokens=chunk,
            num_kv_blocks=256,
            enable_prefix_caching=False,
            max_model_len=1024,
        )
    )


def _assert_same(result, reference) -> None:
    outputs, kvs = result
    ref_outputs, ref_kvs = reference
    for kv, ref_kv in zip(kvs, ref_kvs, strict=True):
        torch.testing.assert_close(kv, ref_kv, rtol=1e-4, atol=1e-5)
    assert outputs == ref_outputs


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_chunked_matches_unchunked(chunk, unchunked_reference):
    engine = _chunked_engine(chunk)
    _assert_same(_run(engine, _prompts()), unchunked_reference)
    # the budget really split the prompts: no step computed more than `chunk` tokens
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in engine.step_history) <= chunk


class ChunkRelativePositions(ModelRunner):
    """The reference lesson's exercise 3: RoPE positions restart at 0 in every chunk (a bug)."""

    def _prepare(self, output):
        input_ids, _, meta = super()._prepare(output)
        relative = [p - c.start for c in output.chunks for p in range(c.start, c.start + len(c.token_ids))]
        return input_ids, torch.tensor(relative, dtype=torch.long), meta


@pytest.mark.parametrize("chunk", [7, 100])
def test_chunk_relative_position_bug_is_caught(chunk, unchunked_reference):
    engine = _chunked_engine(chunk)
    engine.runner.__class__ = ChunkRelativePositions
    with pytest.raises(AssertionError):
        _assert_same(_run(engine, _prompts()), unchunked_reference)
