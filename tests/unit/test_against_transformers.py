"""The engine matches Hugging Face transformers: prompt logits and greedy tokens, Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.prompt_logits import engine_prompt_logits

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams


def _save_random_hf_model(kind: str, path: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=299,
        bos_token_id=298,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True}, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # Qwen2 initialises its qkv biases to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    with torch.no_grad():  # larger weights than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(path, safe_serialization=True, max_shard_size="300KB")
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_and_greedy_tokens_match_transformers(kind, tmp_path):
    hf = _save_random_hf_model(kind, str(tmp_path))
    assert (tmp_path / "model.safetensors.index.json").exists(), "exercise the sharded-checkpoint path"
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=64, num_kv_blocks=64)
    )
    assert engine.model_config.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    prompt = [int(t) for t in torch.randint(0, 290, (77,), generator=torch.Generator().manual_seed(1))]

    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    ours = engine_prompt_logits(engine, prompt)
    assert ours.shape == ref_logits.shape
    assert (ours - ref_logits).abs().max().item() <= 1e-4

    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )[0, len(prompt) :].tolist()
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert completion.token_ids == ref
    engine.block_manager.check_integrity()
