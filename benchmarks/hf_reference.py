"""The ``transformers`` side of ``benchmarks/engine_bench.py``: the engine's weights in a ``LlamaForCausalLM``,
run through ``generate`` the way a user batches it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdserve.workload.generator import WorkloadRequest

PAD_TOKEN = 258  # reserved in the byte tokenizer: decodes to nothing, never a prompt token here


def build_hf_model(engine: Any) -> tuple[Any, dict[str, Any]]:
    """A transformers ``LlamaForCausalLM`` holding exactly an ``LLMEngine``'s weights, and facts about it.

    Raises SystemExit when the weights cannot be mirrored (rope scaling, a state dict mismatch)."""
    import transformers

    transformers.logging.set_verbosity_error()
    mc = engine.model_config
    if mc.rope_scaling:
        raise SystemExit("engine_bench: the HF comparison supports plain RoPE only")
    ours = engine.runner.model
    # Mirror what the engine really computes with: its lm_head may not be the embedding even when the
    # config says tied (engine/weights.py unties them); then the HF model is built untied too.
    shared = ours.lm_head.weight is ours.model.embed_tokens.weight
    same_values = torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    tie = bool(mc.tie_word_embeddings and (shared or same_values))
    config = transformers.LlamaConfig(  # type: ignore[call-arg]  # rope_theta: not in the stub's signature
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,
        tie_word_embeddings=tie,
        attention_bias=mc.attention_bias,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN,
    )
    hf: Any = transformers.LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"engine_bench: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf = hf.to(dtype=engine.dtype).eval()
    for name, tensor in ours.state_dict().items():
        if not torch.equal(hf.state_dict()[name], tensor):
            raise SystemExit(f"engine_bench: HF weight {name} differs from the engine's after loading")
    gc = hf.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, PAD_TOKEN
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    info = {
        "transformers": transformers.__version__,
        "attn_implementation": getattr(config, "_attn_implementation", "?"),
        "config_tie_word_embeddings": mc.tie_word_embeddings,
        "engine_lm_head_is_embedding": shared,
        "hf_tie_word_embeddings": tie,
    }
    return hf, info


def hf_batches(workload: Sequence[WorkloadRequest], batch_size: int) -> list[list[int]]:
    """Request indices, sorted by prompt length, cut into batches: what a user of ``generate`` would do."""
    order = sorted(range(len(workload)), key=lambda i: workload[i].num_prompt_tokens)
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


def hf_generate_batched(
    hf: Any, workload: Sequence[WorkloadRequest], batches: list[list[int]], outputs: list[list[int]]
) -> int:
    """Run ``batches`` through ``generate`` (left padding, greedy, each batch as long as its longest
    request); fill ``outputs`` with each request's own tokens; return the tokens computed, padding included."""
    computed = 0
    for idx in batches:
        prompts = [workload[i].prompt_token_ids for i in idx]
        width = max(len(p) for p in prompts)
        new = max(workload[i].max_tokens for i in idx)
        ids = torch.tensor([[PAD_TOKEN] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN,
            )
        if out.shape[1] != width + new:
            raise SystemExit(f"engine_bench: HF generate stopped early ({out.shape[1] - width} of {new} tokens)")
        for row, i in enumerate(idx):
            outputs[i] = out[row, width : width + workload[i].max_tokens].tolist()
        computed += len(idx) * new
    return computed


def hf_warm(hf: Any) -> None:
    """One short ``generate`` call, so the first timed batch pays no one-off costs."""
    with torch.inference_mode():
        hf.generate(
            input_ids=torch.tensor([[5] * 32]),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN,
        )
