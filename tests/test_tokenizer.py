"""Tokenizers: a real tokenizer.json through the `tokenizers` library, and the byte tokenizer."""

from __future__ import annotations

import json

import pytest
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = ["naïve café — 東京 and Zürich, déjà vu", "chunked prefill splits prompts", "€ 5 über alles"] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json next to a small Llama config (random weights, via safetensors)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("hf-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXT,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (64, 64),
                p + "self_attn.k_proj.weight": (32, 64),
                p + "self_attn.v_proj.weight": (32, 64),
                p + "self_attn.o_proj.weight": (64, 64),
                p + "mlp.gate_proj.weight": (128, 64),
                p + "mlp.up_proj.weight": (128, 64),
                p + "mlp.down_proj.weight": (64, 128),
                p + "input_layernorm.weight": (64,),
                p + "post_attention_layernorm.weight": (64,),
            }
        )
    save_file({k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}, str(path / "model.safetensors"))
    return path


def test_hf_tokenizer_round_trip_and_incremental_decoding(model_dir):
    tok = load_tokenizer(str(model_dir), eos_token_id=None)
    assert isinstance(tok, HFTokenizer)
    text = "naïve café — 東京, déjà vu"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no half characters, ever


def test_byte_tokenizer_holds_back_partial_characters():
    detok = ByteTokenizer().detokenizer()
    euro = "€".encode()  # three bytes
    assert detok.push([euro[0]]) == "" and detok.push([euro[1]]) == ""
    assert detok.push([euro[2], 257]) == "€"  # EOS decodes to nothing


def test_engine_streams_text_with_a_checkpoint_tokenizer(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
    assert engine.eos_token_id == 0
    [completion] = engine.generate(["café au lait"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert completion.prompt_token_ids == engine.tokenizer.encode("café au lait")
    assert completion.text == engine.tokenizer.decode(completion.token_ids)
