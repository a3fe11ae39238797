"""The quantized paths: ``--quantization native`` (GGUF weights kept as they ship, int4/int8 weight-only
GEMMs) and ``--quantization float16`` (every weight in float16, computed in float32).

Exact where the kernel is exact (Q4_0/Q4_1 in float32 against the dequantised weights), and for SmolLM2
(native: float32 activations, bfloat16 inputs to the int4 GEMMs; float16 weights) close enough to the
float32 reference: teacher-forced top-1 agreement of at least 98 %, and the demo's questions answered
correctly. Both paths give a request the same bits whatever its batch and however its prompt is chunked.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.gguf_writer import write_gguf
from support.prompt_logits import engine_prompt_logits

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.attention_width import (
    KEY_PIECE,
    attend,
    attention_is_width_invariant,
    padded_query_rows,
    query_block_rows,
)
from pdserve.engine.config import checkpoint_preset_file
from pdserve.engine.gguf import QuantizedBlocks, read_gguf
from pdserve.engine.llm_engine import quantized_checkpoint, resolve_quantization
from pdserve.engine.quantization import (
    Float16Embedding,
    Float16Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    Int8Weight,
    TileScratch,
    auto_weight_format,
    fbgemm_float16_available,
    weight_bytes,
)

CPU = torch.device("cpu")
PARITY_PROMPTS = [  # (question, as a chat turn): those of the float32 parity tests against transformers
    ("What is the capital of France?", True),
    ("Write a haiku about the sea, then explain each of its three lines in one sentence.", True),
    ("Write a haiku about the sea, then explain each of its three lines in one sentence.", False),
]
DEMO_ANSWERS = [  # the demo's short questions and a word each correct answer has
    ("What is the capital of France?", "Paris"),
    ("What is the largest ocean on Earth?", "Pacific"),
]


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))
        yield


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> QuantizedBlocks:
    rng = np.random.default_rng(seed)
    groups = cols // 32
    scale = rng.uniform(0.01, 0.1, (rows, groups)).astype(np.float32)
    if kind == "Q8_0":
        return QuantizedBlocks(kind, rng.integers(-127, 128, (rows, cols)).astype(np.int8), scale, None)
    minimum = rng.uniform(-1.0, 0.0, (rows, groups)).astype(np.float32) if kind == "Q4_1" else -8.0 * scale
    return QuantizedBlocks(kind, rng.integers(0, 16, (rows, cols)).astype(np.uint8), scale, minimum)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_linear_computes_with_the_files_scales_and_minimums(kind, rows):
    blocks = _random_blocks(kind, 96, 256)
    weight = torch.from_numpy(blocks.dequantize())
    bias = torch.randn(96)
    layer = Int4Linear(blocks, torch.float32, CPU, bias)
    x = torch.randn(rows, 256)
    expected = x @ weight.t() + bias
    assert (layer(x) - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


def test_int8_weight_keeps_every_value_within_half_a_step():
    blocks = _random_blocks("Q8_0", 64, 128)
    weight = torch.from_numpy(blocks.dequantize())
    int8 = Int8Weight.from_blocks(blocks, torch.float32, CPU)
    restored = int8.codes.float() * int8.scales[:, None]
    assert ((restored - weight).abs() <= int8.scales[:, None] / 2 + 1e-7).all()
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(Int8Embedding(int8)(ids), restored[ids])
    x = torch.randn(2, 128)
    assert torch.allclose(Int8Linear(int8)(x), x @ restored.t(), atol=1e-4)
    bf16_head = Int8Linear(Int8Weight.from_blocks(blocks, torch.bfloat16, CPU), float32_output=True)
    assert bf16_head(x.bfloat16()).dtype == torch.float32


@pytest.mark.slow
def test_stored_blocks_decode_like_the_gguf_package():
    checkpoint = read_gguf(checkpoint_preset_file("smollm2"))
    layer = "model.layers.0"
    chosen = {"model.embed_tokens.weight", f"{layer}.self_attn.q_proj.weight", f"{layer}.mlp.down_proj.weight"}
    tensors = [t for t in checkpoint.tensors if t.hf_name in chosen]
    assert {t.kind for t in tensors} == {"Q8_0", "Q4_1"} and len(tensors) == 3
    for tensor in tensors:  # q_proj's rows are unpermuted (llama.cpp's rope order) like the dequantised ones
        assert np.array_equal(tensor.quantized_blocks().dequantize(), tensor.dequantize())


@pytest.mark.parametrize(
    "arch, matrix_type, tied", [("llama", "Q4_0", True), ("qwen2", "Q4_1", False), ("llama", "Q8_0", True)]
)
def test_quantized_small_files_give_the_dequantised_logits(tmp_path, arch, matrix_type, tied):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, matrix_type, tied=tied)
    common = dict(model=str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32)
    exact = LLMEngine(EngineConfig(quantization="none", **common))
    native = LLMEngine(EngineConfig(quantization="native", **common))
    assert native.quantized and not exact.quantized
    linear_kind = Int8Linear if matrix_type == "Q8_0" else Int4Linear
    assert isinstance(native.runner.model.model.layers[0].mlp.gate_up_proj, linear_kind)  # fused, as float ones
    assert isinstance(native.runner.model.lm_head, linear_kind)  # float32 kernel inputs: float32 logits on it
    prompt = native.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    ours, reference = engine_prompt_logits(native, prompt), engine_prompt_logits(exact, prompt)
    if matrix_type == "Q8_0":  # one int8 scale per row instead of per 32 weights: close, not exact
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9
    else:
        assert (ours - reference).abs().max().item() <= 1e-3


def _smollm2_engine(**overrides) -> LLMEngine:
    common = dict(model="smollm2", device="cpu", max_num_batched_tokens=64, num_kv_blocks=96)
    return LLMEngine(EngineConfig(**(common | overrides), enable_prefix_caching=False))


@pytest.fixture(scope="module")
def reference_engine() -> LLMEngine:
    return _smollm2_engine(dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def quantized_engine() -> LLMEngine:
    return _smollm2_engine(quantization="native")


@pytest.fixture(scope="module")
def float16_engine() -> LLMEngine:
    return _smollm2_engine(quantization="float16")


NEAR_TIE_LOGITS = 0.1  # the reference's top two this close (probabilities within 10 %): either is its top-1


def _top1_agreement(engine: LLMEngine, reference: LLMEngine, near_ties: bool = False) -> float:
    """Teacher-forced top-1 agreement over the parity prompts; with ``near_ties``, a position where the
    reference's top two logits are within ``NEAR_TIE_LOGITS`` agrees when ours is either of them."""
    agree = total = 0
    for question, chat in PARITY_PROMPTS:
        tokenizer = engine.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}]) if chat else question
        prompt = tokenizer.encode(text)
        ours = engine_prompt_logits(engine, prompt).argmax(-1)
        theirs = engine_prompt_logits(reference, prompt)
        agreed = ours == theirs.argmax(-1)
        if near_ties:
            top2 = theirs.topk(2, dim=-1)
            tied = top2.values[:, 0] - top2.values[:, 1] <= NEAR_TIE_LOGITS
            agreed |= tied & (ours == top2.indices[:, 1])
        agree += int(agreed.sum())
        total += len(prompt)
    return agree / total


@pytest.mark.slow
def test_quantized_smollm2_agrees_with_the_float32_reference(reference_engine, quantized_engine):
    """The int4 kernels on bfloat16 inputs, the rest of the model in float32."""
    model = quantized_engine.runner.model
    assert quantized_engine.dtype == torch.float32 and quantized_engine.kv_cache.dtype == torch.float16
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert model.model.layers[0].self_attn.qkv_proj.scales_and_zeros.dtype == torch.bfloat16
    assert isinstance(model.model.embed_tokens, Int8Embedding)  # the file's Q8_0 table, as int8
    if platform.machine() in ("x86_64", "AMD64"):  # float32 logits from float16 weights on FBGEMM
        assert isinstance(model.lm_head, Float16Linear) and model.lm_head.float32_output
    else:
        assert isinstance(model.lm_head, Int8Linear) and model.lm_head.float32_output
    # the weights alone (the reference's float32 KV cache): at least 98 % of positions pick the same token
    weights_only = _smollm2_engine(quantization="native", kv_cache_dtype="float32")
    agreement = _top1_agreement(weights_only, reference_engine)
    assert agreement >= 0.98, f"top-1 agreement {agreement:.1%}"
    # as served, over a float16 cache: the same, where the reference's near-ties may go to its runner-up
    agreement = _top1_agreement(quantized_engine, reference_engine, near_ties=True)
    assert agreement >= 0.98, f"top-1 agreement, near-ties either way, {agreement:.1%}"


def _assert_answers_the_demo_questions(engine: LLMEngine) -> None:
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in DEMO_ANSWERS]
    completions = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for (question, word), completion in zip(DEMO_ANSWERS, completions, strict=True):
        assert word in completion.text, f"{question!r} -> {completion.text!r}"
    engine.block_manager.check_integrity()


def test_quantized_smollm2_answers_the_demo_questions(quantized_engine):
    _assert_answers_the_demo_questions(quantized_engine)


def test_int4_linear_on_bfloat16_inputs_returns_float32_and_is_row_independent():
    blocks = _random_blocks("Q4_1", 192, 576)
    layer = Int4Linear(blocks, torch.bfloat16, CPU)
    x = torch.randn(40, 576)
    out = layer(x)
    assert out.dtype == torch.float32
    exact = x.bfloat16().float() @ torch.from_numpy(blocks.dequantize()).t()  # inputs rounded, float32 sums
    assert (out - exact).abs().max().item() <= 2**-7 * exact.abs().max().item()  # + bfloat16 outputs
    fused = Int4Linear.concatenate([layer, Int4Linear(_random_blocks("Q4_1", 64, 576, seed=1), torch.bfloat16, CPU)])
    assert fused is not None and torch.equal(fused(x)[:, :192], out)


@pytest.mark.parametrize("rows", [1, 2, 3, 7])
@pytest.mark.parametrize("float32_output", [False, True])
def test_float16_linear_tiles_give_every_row_the_same_result_in_any_batch(rows, float32_output):
    """The path for CPUs without FBGEMM: float16 matrix-vector products and float32 tiles."""
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 200) * 0.1, torch.randn(300)
    layer = Float16Linear(weight, bias, TileScratch(), float32_output=float32_output, use_fbgemm=False)
    layer.tile_rows = 64  # several tiles, the last one short
    assert layer.weight is not None and layer.weight.dtype == torch.float16
    x = torch.randn(rows, 200)
    exact = x.half().float() @ layer.weight.float().t()
    if not float32_output:
        exact = exact.half().float()
    out = layer(x)
    assert out.dtype == torch.float32
    # float16 rounding of the result (2**-11 relative) plus float32 accumulation-order differences
    assert (out - (exact + bias)).abs().max().item() <= 2e-3 * exact.abs().max().item()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    if float32_output:  # float32 logits: as batch-invariant as a float32 GEMM, to its rounding
        assert torch.allclose(alone, out, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    else:  # rounded to float16: identical but where float32 accumulation orders straddle a rounding step
        differ = (alone != out).float().mean().item()
        assert differ <= 0.01, f"{differ:.2%} of the outputs depend on the batch"


def test_float16_linear_on_fbgemm_is_exact_to_float32_and_batch_invariant():
    torch.manual_seed(0)
    weight, bias = torch.randn(1000, 576) * 0.05, torch.randn(1000)
    layer = Float16Linear(weight, bias, TileScratch())
    if platform.machine() not in ("x86_64", "AMD64"):  # FBGEMM ships only in x86 builds of torch
        assert not fbgemm_float16_available() and not layer.use_fbgemm
        return
    assert layer.use_fbgemm and layer.weight is None and layer.packed_bytes == 2 * weight.numel()
    x = torch.randn(600, 576)
    out = layer(x)
    exact = x @ weight.half().float().t() + bias  # float32 activations against the float16 weights
    assert out.dtype == torch.float32
    assert (out - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    # a row's result is its own in any batch: FBGEMM's one- and two-row kernels sum in another order, so
    # batches of those sizes (and their remainders) are padded with zero rows
    for start, rows in [(0, n) for n in range(1, 41)] + [(7, 1), (3, 2), (100, 17), (101, 122), (64, 512)]:
        assert torch.equal(layer(x[start : start + rows]), out[start : start + rows]), (start, rows)
    assert layer(x.view(2, 300, 576)).shape == (2, 300, 1000)


def test_float16_weights_halve_the_bytes_and_share_the_tied_table(float16_engine, reference_engine):
    model = float16_engine.runner.model
    assert float16_engine.quantization == "float16" and float16_engine.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.down_proj, Float16Linear)
    assert isinstance(model.model.embed_tokens, Float16Embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # SmolLM2's output projection is tied
    assert model.lm_head.float32_output and not model.model.layers[0].self_attn.qkv_proj.float32_output
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in model.parameters())
    full = weight_bytes(reference_engine.runner.model)
    assert abs(weight_bytes(model) / full - 0.5) < 0.01
    assert float16_engine.kv_cache.dtype == torch.float16  # auto: a float16 cache beside float16 weights


def test_float16_smollm2_agrees_with_the_float32_reference_and_answers(reference_engine, float16_engine):
    agreement = _top1_agreement(float16_engine, reference_engine)
    assert agreement >= 0.98, f"top-1 agreement {agreement:.1%}"
    _assert_answers_the_demo_questions(float16_engine)


@pytest.mark.slow
def test_float16_smollm2_gives_a_request_the_same_tokens_alone_and_in_any_batch(float16_engine):
    """Decode batches of 1 to 5 rows and chunked prefills of several prompts: the rows' sizes that FBGEMM pads."""
    tokenizer = float16_engine.tokenizer
    questions = ["What is the capital of France?", "Name a large ocean.", "What is 2+2?", "Say hello.", "Why?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [float16_engine.generate([p], params)[0].token_ids for p in prompts]
    together = [c.token_ids for c in float16_engine.generate(prompts, params)]
    assert together == alone
    float16_engine.block_manager.check_integrity()


@pytest.mark.parametrize("quantization", ["native", "float16"])
@pytest.mark.slow
def test_a_prompts_logits_do_not_depend_on_how_it_is_chunked(quantization):
    """Bit for bit, across token budgets that cut a 700-token prompt in different places (its keys span more
    than one of the attention kernel's 512-key blocks), where this CPU's attention kernel passes the probe that
    lets ``auto`` pick ``native``; where it fails the probe, ``auto`` must not pick ``native``."""
    if not attention_is_width_invariant("cpu"):
        assert auto_weight_format(CPU) != "native"
        return
    tokenizer = None
    logits = []
    for budget in (1024, 100, 37):
        engine = _smollm2_engine(quantization=quantization, max_num_batched_tokens=budget)
        tokenizer = tokenizer or engine.tokenizer
        text = "Summarise the history of the Roman empire from its founding to its fall, with names. " * 34
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        assert 600 < len(prompt) < 1024
        logits.append(engine_prompt_logits(engine, prompt))
    assert torch.equal(logits[1], logits[0]) and torch.equal(logits[2], logits[0])


def _chat_ids(engine: LLMEngine, question: str) -> list[int]:
    tokenizer = engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.mark.parametrize("quantization", ["native", "float16"])
@pytest.mark.slow
def test_a_prompts_tokens_and_logits_do_not_depend_on_the_prefix_cache(quantization):
    """The haiku chat prompt (38 tokens) with 0, 16 and 32 of its tokens from the prefix cache: 16 after another
    chat prompt shares its first block (the system prompt), 32 after the prompt itself. Its prompt logits and
    greedy tokens must be the same bits in every cache state, at the default token budget and at a small one."""
    if quantization == "native" and not attention_is_width_invariant("cpu"):
        assert auto_weight_format(CPU) != "native"
        return
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for budget in (512, 8):
        common = dict(model="smollm2", device="cpu", num_kv_blocks=96, quantization=quantization)
        uncached = LLMEngine(EngineConfig(**common, max_num_batched_tokens=budget, enable_prefix_caching=False))
        haiku, france = (
            _chat_ids(uncached, q) for q in ("Write a haiku about the sea.", "What is the capital of France?")
        )
        assert (
            len(haiku) == 38
            and 16 <= next(i for i, (a, b) in enumerate(zip(haiku, france, strict=False)) if a != b) < 32
        )
        expected = uncached.generate([haiku], params)[0].token_ids
        expected_logits = engine_prompt_logits(uncached, haiku)
        cached = LLMEngine(EngineConfig(**common, max_num_batched_tokens=budget))
        cached.generate([france], params)
        seen = []
        for cache_hit in (16, 32):
            completion = cached.generate([haiku], params)[0]
            assert completion.num_cached_tokens == cache_hit
            seen.append(completion.token_ids)
        assert seen == [expected, expected], (budget, [uncached.tokenizer.decode(t) for t in [expected, *seen]])
        # the logits of the uncached part, with 32 of the prompt's tokens in the cache
        request_id = cached.add_request(haiku, SamplingParams(max_tokens=1, temperature=0.0))
        rows = []
        while cached.get_request(request_id) is not None:
            output = cached.scheduler.schedule()
            rows.append(cached.runner.prompt_logits(output))
            cached.scheduler.update_after_step(output)
            if cached.get_request(request_id).num_computed_tokens == len(haiku):
                cached.abort(request_id)
        assert torch.equal(torch.cat(rows), expected_logits[32:])
        cached.block_manager.check_integrity()


def _decode_logprobs(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list:
    """The first prompt's tokens and their log-probabilities, decoded beside the others."""
    first = engine.add_request(prompts[0], params)
    for prompt in prompts[1:]:
        engine.add_request(prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.new_token_ids, o.logprobs) for o in engine.step() if o.request_id == first]
    return seen


@pytest.mark.slow
def test_a_decode_gets_the_same_bits_beside_a_longer_request(quantized_engine):
    """A 300-token request decodes alone, then beside a 700-token one: its keys span 512 then 1024 positions in
    the shared decode call (padded, masked), and its tokens and log-probabilities must not change a bit."""
    if not attention_is_width_invariant("cpu"):
        assert auto_weight_format(CPU) != "native"
        return
    tokenizer = quantized_engine.tokenizer
    texts = ["Explain how attention works, step by step. " * 30, "Tell the history of Rome, with names. " * 70]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert 256 < lengths[0] < 512 < lengths[1] < 1024
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = _decode_logprobs(quantized_engine, prompts[:1], params)
    assert len(alone) == 12 and all(logprobs for _, logprobs in alone)
    assert _decode_logprobs(quantized_engine, prompts, params) == alone
    quantized_engine.block_manager.check_integrity()


def test_a_token_decoded_and_recomputed_in_a_prompt_gets_the_same_bits(quantized_engine):
    """What a preempted request's recomputation relies on: 12 tokens decoded after a 184-token prompt (their
    keys crossing from whole blocks to a 512-key span), then the prompt and those tokens prefilled in chunks of
    64: every decoded token's logits come out of the prefill bit for bit."""
    if not attention_is_width_invariant("cpu"):
        assert auto_weight_format(CPU) != "native"
        return
    tokenizer = quantized_engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain how attention works, step by step. " * 17}]
    )
    prompt = tokenizer.encode(text)
    assert len(prompt) <= KEY_PIECE < len(prompt) + 12
    request_id = quantized_engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    decoded, logits = [], []
    while quantized_engine.has_unfinished_requests():
        for output in quantized_engine.step(keep_logits=True):
            if output.request_id == request_id and output.new_token_ids:
                decoded += output.new_token_ids
                logits.append(quantized_engine.last_logits[request_id])
    assert len(decoded) == 12
    recomputed = engine_prompt_logits(quantized_engine, prompt + decoded[:-1])[len(prompt) - 1 :]
    assert torch.equal(recomputed, torch.stack(logits))
    quantized_engine.block_manager.check_integrity()


def test_attention_beyond_a_piece_matches_one_call_and_ignores_the_pieces_a_row_cannot_see():
    """``attend`` over more than ``KEY_PIECE`` keys: the pieces' results combined by log-sum-exp give what one call
    over all the keys gives (to float32 rounding), and a row's bits do not change when the call holds more keys
    it cannot see (a decode beside a longer request; a longer prompt's chunk)."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 3, 1000, 64, generator=generator)
    query = torch.randn(1, 3, 12, 64, generator=generator)
    positions = torch.tensor([0, 5, 150, 191, 192, 200, 383, 384, 385, 600, 700, 999])
    mask = torch.arange(1000) <= positions[:, None]
    out = attend(query, keys, values, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(query, keys, values, attn_mask=mask))
    for span in (704, 1000):  # every key the first eleven rows see, and more pieces (or fewer)
        shorter = attend(query[:, :, :11], keys[:, :, :span], values[:, :, :span], mask[:11, :span])
        assert torch.equal(shorter, out[:, :, :11]), span
    alone = attend(query[:, :, 2:3], keys[:, :, :160], values[:, :, :160], mask[2:3, :160])
    assert torch.equal(alone, out[:, :, 2:3])  # 150 sees one piece: the one-call path gives the same bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_beyond_a_piece_keeps_the_query_dtype(dtype):
    """A half-precision model's attention over more than ``KEY_PIECE`` keys returns its own dtype (the pieces'
    log-sum-exps are float32), close to one call over all the keys."""
    generator = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 1, 3, 400, 64, generator=generator).to(dtype)
    query = torch.randn(1, 3, 4, 64, generator=generator).to(dtype)
    mask = torch.ones(4, 400, dtype=torch.bool)
    out = attend(query, keys, values, mask)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(query, keys, values, attn_mask=mask), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_attend_gives_a_few_query_rows_the_bits_they_get_among_many(rows):
    """``attend`` pads a call of fewer than ``MIN_QUERY_ROWS`` query rows per head; its results are
    scaled_dot_product_attention's (to float32 rounding) and, where the probe passes, the bits those rows get
    in a call of 40 rows."""
    generator = torch.Generator().manual_seed(rows)
    keys, values = torch.randn(2, 1, 3, 512, 64, generator=generator)
    query = torch.randn(1, 3, 40, 64, generator=generator)
    mask = torch.arange(512) <= torch.randint(0, 512, (40, 1), generator=generator)
    many = attend(query, keys, values, mask)
    few = attend(query[:, :, :rows], keys, values, mask[:rows])
    assert few.shape == (1, 3, rows, 64)
    torch.testing.assert_close(
        few, F.scaled_dot_product_attention(query[:, :, :rows], keys, values, attn_mask=mask[:rows])
    )
    decode_mask = mask[:1].view(1, 1, 1, 512)  # a decode batch's mask, broadcast over the rows
    broadcast = attend(query[:, :, :rows], keys, values, decode_mask)
    assert torch.equal(broadcast, attend(query[:, :, :rows], keys, values, decode_mask.expand(1, 1, rows, 512)))
    if attention_is_width_invariant("cpu"):
        assert torch.equal(few, many[:, :, :rows])


def test_attend_never_leaves_the_kernel_a_last_block_of_one_to_three_query_rows(monkeypatch):
    """The CPU flash kernel walks query rows in blocks of 32 (64 from 192 rows, 256 from 768); a last block of 1-3
    rows takes another path through its products on some CPUs (an AMD EPYC's AVX-512 build), so the rows there got
    other bits than in any other call: a 22-token chunk of SmolLM2 (66 rows) after 16 tokens from the prefix
    cache. ``attend`` pads such calls; the padded rows' results are dropped."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        seen.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 3, 64, 64, generator=generator)
    for rows in (1, 2, 3, 4, 33, 34, 35, 36, 66, 114, 193, 195, 196, 769, 1537):
        query = torch.randn(1, 3, rows, 64, generator=generator)
        mask = torch.arange(64) <= torch.randint(0, 64, (rows, 1), generator=generator)
        out = attend(query, keys, values, mask)
        assert out.shape == query.shape
        torch.testing.assert_close(out, sdpa(query, keys, values, attn_mask=mask))
        blocks = query_block_rows(seen[-1])
        assert seen[-1] >= rows and not 0 < seen[-1] % blocks < 4, (rows, seen[-1])
    assert [padded_query_rows(r) for r in (1, 33, 66, 114, 193, 769)] == [4, 36, 68, 114, 196, 772]


def _cpu_like(monkeypatch, fbgemm: bool, avx512: bool, invariant_attention: bool = True) -> None:
    from pdserve.engine import quantization

    monkeypatch.setattr(quantization, "fbgemm_float16_available", lambda: fbgemm)
    monkeypatch.setattr(quantization, "fast_weight_only_kernels", lambda device: device.type == "cuda" or avx512)
    monkeypatch.setattr(quantization, "attention_is_width_invariant", lambda device_type="cpu": invariant_attention)


def test_float16_is_asked_for_and_refused_off_the_cpu(monkeypatch):
    _cpu_like(monkeypatch, fbgemm=False, avx512=False)
    assert resolve_quantization("auto", "smollm2", CPU) == ("none", None)  # batches keep float32's throughput
    assert resolve_quantization("float16", "smollm2", CPU) == ("float16", None)
    assert resolve_quantization("float16", "tiny", CPU) == ("float16", None)
    with pytest.raises(ValueError, match="quantization float16 is for CPUs"):
        resolve_quantization("float16", "tiny", torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization float16 computes in float32"):
        LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="bfloat16", quantization="float16"))


def test_auto_picks_the_fastest_format_the_machine_has(monkeypatch):
    _cpu_like(monkeypatch, fbgemm=True, avx512=True)  # AVX-512, rows' bits independent: the file's int4 blocks
    picked, blocks = resolve_quantization("auto", "smollm2", CPU)
    assert picked == "native" and blocks is not None
    assert resolve_quantization("auto", "tiny", CPU) == ("none", None)  # a float checkpoint is served as it is
    _cpu_like(monkeypatch, fbgemm=True, avx512=True, invariant_attention=False)  # x86, attention not invariant
    assert resolve_quantization("auto", "smollm2", CPU) == ("float16", None)
    assert quantized_checkpoint("auto", "smollm2", CPU, "bfloat16") is not None  # float16 computes in float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100/H200
    assert quantized_checkpoint("auto", "smollm2", torch.device("cuda")) is not None  # its Q4_1 blocks
    _cpu_like(monkeypatch, fbgemm=True, avx512=False)  # AVX2 x86: FBGEMM's float16 GEMM beats int4 and float32
    assert resolve_quantization("auto", "smollm2", CPU) == ("float16", None)
    _cpu_like(monkeypatch, fbgemm=False, avx512=True)  # an AVX-512 CPU without FBGEMM: torch's int4 kernels
    assert quantized_checkpoint("auto", "smollm2", CPU) is not None
    assert quantized_checkpoint("auto", "tiny", CPU) is None  # nothing quantized to keep
    assert quantized_checkpoint("none", "smollm2", CPU) is None
    _cpu_like(monkeypatch, fbgemm=False, avx512=False)
    assert quantized_checkpoint("auto", "smollm2", CPU) is None
    assert quantized_checkpoint("native", "smollm2", CPU) is not None
    with pytest.raises(ValueError, match="not a GGUF file with Q4_0, Q4_1 or Q8_0 weights"):
        quantized_checkpoint("native", "tiny", CPU)
    with pytest.raises(ValueError, match="quantization must be auto, native, float16 or none"):
        EngineConfig(quantization="int4")


def test_a_bfloat16_kv_cache_holds_twice_the_blocks_and_still_answers(reference_engine):
    common = dict(model="smollm2", device="cpu", dtype="float32", quantization="none", kv_cache_memory_gb=0.05)
    half = LLMEngine(EngineConfig(kv_cache_dtype="bfloat16", **common))
    full = LLMEngine(EngineConfig(**common))
    assert half.kv_cache.dtype == torch.bfloat16 and full.kv_cache.dtype == torch.float32
    assert half.block_manager.num_blocks // 2 == full.block_manager.num_blocks  # the same memory, halved blocks
    prompt = half.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_ANSWERS[0][0]}])
    [completion] = half.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in completion.text
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int8")


def test_kernels_and_compute_dtype_follow_the_cpu(monkeypatch):
    from pdserve.engine import quantization

    for capability, fast in (("AVX2", False), ("DEFAULT", False), ("AVX512", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert quantization.fast_weight_only_kernels(CPU) is fast
    assert quantization.fast_weight_only_kernels(torch.device("cuda")) is True
    # activations in float32 on a CPU, the int4/int8 kernels' inputs in bfloat16; bfloat16 on CUDA
    assert quantization.quantized_compute_dtype(CPU) == torch.float32
    assert quantization.weight_only_input_dtype(CPU) == torch.bfloat16
    assert quantization.quantized_compute_dtype(torch.device("cuda")) == torch.bfloat16
    assert quantization.weight_only_input_dtype(torch.device("cuda")) == torch.bfloat16
