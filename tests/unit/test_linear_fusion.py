"""The engine's float linears: the few-row CPU path and the fused q/k/v and gate/up projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.prompt_logits import engine_prompt_logits

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.model import FEW_ROWS, Linear, LlamaForCausalLM, fuse_linears
from pdserve.engine.quantization import Int4Linear, Int8Linear


@pytest.mark.parametrize("rows", range(1, FEW_ROWS + 2))
@pytest.mark.parametrize("out_features, bias", [(192, False), (576, True), (97, False)])
def test_few_rows_agree_with_f_linear(rows, out_features, bias):
    torch.manual_seed(rows)
    layer = Linear(64, out_features, bias=bias)
    x = torch.randn(rows, 64)
    expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    out = layer(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for row in range(rows):  # each row is the row alone: the few-row path does not mix rows up
        torch.testing.assert_close(layer(x[row : row + 1])[0], out[row], rtol=1e-5, atol=1e-5)


def test_fused_linears_compute_the_parts_side_by_side():
    torch.manual_seed(0)
    parts = [Linear(32, n, bias=True) for n in (48, 16, 16)]
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 80
    x = torch.randn(5, 32)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    assert fuse_linears([Linear(32, 8, bias=True), Linear(32, 8, bias=False)]) is None  # bias on some only


def test_fused_engine_gives_the_unfused_logits():
    common = dict(model="tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    engine = LLMEngine(EngineConfig(**common))
    layer = engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.self_attn.q_proj is None
    assert layer.mlp.gate_up_proj is not None and layer.mlp.gate_proj is None
    reference = LLMEngine(EngineConfig(**common))
    for layer in reference.runner.model.model.layers:  # the same weights, the projections apart again
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv_proj.weight.split([attn.num_heads * attn.head_dim, *[attn.num_kv_heads * attn.head_dim] * 2])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        for name, weight in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            part = Linear(weight.shape[1], weight.shape[0], bias=False)
            part.weight.data = weight.clone()
            setattr(attn, name, part)
        for name, weight in (("gate_proj", gate), ("up_proj", up)):
            part = Linear(weight.shape[1], weight.shape[0], bias=False)
            part.weight.data = weight.clone()
            setattr(mlp, name, part)
        attn.qkv_proj = mlp.gate_up_proj = None
    prompt = list(range(3, 60))
    torch.testing.assert_close(
        engine_prompt_logits(engine, prompt), engine_prompt_logits(reference, prompt), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q8_0"])
def test_quantized_projections_fuse_with_the_same_results(tmp_path, monkeypatch, matrix_type):
    from support.gguf_writer import write_gguf

    path = write_gguf(tmp_path / "llama.gguf", "llama", matrix_type, tied=True)
    common = dict(model=str(path), device="cpu", quantization="native", num_kv_blocks=64)
    engine = LLMEngine(EngineConfig(**common))
    kind = Int4Linear if matrix_type == "Q4_0" else Int8Linear
    for layer in engine.runner.model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, kind) and layer.self_attn.q_proj is None
        assert isinstance(layer.mlp.gate_up_proj, kind) and layer.mlp.gate_proj is None
    monkeypatch.setattr(LlamaForCausalLM, "fuse_projections", lambda self: None)
    apart = LLMEngine(EngineConfig(**common))
    assert isinstance(apart.runner.model.model.layers[0].self_attn.q_proj, kind)
    prompt = list(range(3, 60))
    assert torch.equal(engine_prompt_logits(engine, prompt), engine_prompt_logits(apart, prompt))
