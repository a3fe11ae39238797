"""Build a model and fill its weights: from a HF safetensors checkpoint (a GGUF file converts to one,
see ``engine.gguf``), from a GGUF file's quantized blocks as they ship (``engine.quantization``), or a
seeded random preset."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pdserve.engine.config import PRESETS, ModelConfig, resolve_checkpoint
from pdserve.engine.gguf import GGUFCheckpoint
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.quantization import (
    INT4_KINDS,
    INT8_KINDS,
    Float16Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    Int8Weight,
    TileScratch,
    fbgemm_float16_available,
)


def build_model(
    model: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantized: GGUFCheckpoint | None = None,
    kernel_dtype: torch.dtype | None = None,
    native_kinds: frozenset[str] = INT4_KINDS | INT8_KINDS,
) -> LlamaForCausalLM:
    """The model with its weights, in ``dtype`` on ``device``; from ``quantized``'s blocks when given, whose
    int4/int8 GEMMs take their inputs in ``kernel_dtype`` (default ``dtype``); blocks of other kinds than
    ``native_kinds`` are dequantised to ``dtype``."""
    with torch.device("meta"), _skip_parameter_init():
        module = LlamaForCausalLM(config)
    if quantized is not None:
        return load_quantized(module, quantized, dtype, device, kernel_dtype or dtype, native_kinds).eval()
    module = module.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty() allocates every parameter anew, which unties them
        module.lm_head.weight = module.model.embed_tokens.weight
    module.model.rotary_emb.reset_tables()
    if model in PRESETS:
        init_random_weights(module, seed)
    else:
        load_checkpoint(module, resolve_checkpoint(model))
    module = module.to(device=device, dtype=dtype).eval()
    module.model.rotary_emb.reset_tables()  # keep the rotation tables in float32 whatever the dtype
    return module


def load_quantized(
    module: LlamaForCausalLM,
    checkpoint: GGUFCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    kernel_dtype: torch.dtype | None = None,
    native_kinds: frozenset[str] = INT4_KINDS | INT8_KINDS,
) -> LlamaForCausalLM:
    """Fill a meta-device ``module`` from a GGUF file: Q4_0/Q4_1 linears become ``Int4Linear``, Q8_0 ones
    ``Int8Linear`` (a tied Q8_0 embedding shares its int8 table with the output projection), both taking
    their inputs in ``kernel_dtype`` (default ``dtype``), where ``native_kinds`` holds their kind; every other
    weight is dequantised to ``dtype``.

    With 16-bit kernel inputs on a CPU with FBGEMM (x86), a quantized output projection is a float16
    ``Float16Linear`` instead: float32 logits cost 12x more on torch's int8 kernel with float32 inputs than
    with bfloat16 ones, and bfloat16 logits tie a confident model's top tokens (a tied embedding keeps the
    file's int8 table)."""
    kernel_dtype = kernel_dtype or dtype
    tensors = {t.hf_name: t for t in checkpoint.tensors}
    int4_kinds, int8_kinds = INT4_KINDS & native_kinds, INT8_KINDS & native_kinds

    def dense(name: str, to: torch.dtype = dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(tensors[name].dequantize())).to(device=device, dtype=to)

    embed = tensors["model.embed_tokens.weight"]
    head_name = "model.embed_tokens.weight" if module.config.tie_word_embeddings else "lm_head.weight"
    shared: Int8Weight | None = None
    if embed.kind in int8_kinds:
        shared = Int8Weight.from_blocks(embed.quantized_blocks(), kernel_dtype, device)
        module.model.embed_tokens = Int8Embedding(shared, dtype)  # type: ignore[assignment]
    float16_head = kernel_dtype != torch.float32 and device.type == "cpu" and fbgemm_float16_available()
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, nn.Linear):
            continue
        weight_name = head_name if name == "lm_head" else f"{name}.weight"
        bias = dense(f"{name}.bias") if f"{name}.bias" in tensors else None
        source = tensors[weight_name]
        replacement: nn.Module
        if name == "lm_head" and float16_head and source.kind in int4_kinds | int8_kinds:
            head = dense(weight_name, torch.float32)  # not rounded to a bfloat16 --dtype on the way to float16
            replacement = Float16Linear(head, bias, TileScratch(), float32_output=True, use_fbgemm=True)
        elif source.kind in int4_kinds:
            replacement = Int4Linear(source.quantized_blocks(), kernel_dtype, device, bias)
        elif weight_name == "model.embed_tokens.weight" and shared is not None:
            replacement = Int8Linear(shared, bias, float32_output=name == "lm_head")
        elif source.kind in int8_kinds:
            weight = Int8Weight.from_blocks(source.quantized_blocks(), kernel_dtype, device)
            replacement = Int8Linear(weight, bias, float32_output=name == "lm_head")
        else:
            continue
        module.set_submodule(name, replacement)
    for name, param in list(module.named_parameters()):
        if param.is_meta:
            owner, _, leaf = name.rpartition(".")
            weight_name = head_name if name == "lm_head.weight" else name
            setattr(module.get_submodule(owner), leaf, nn.Parameter(dense(weight_name), requires_grad=False))
    if module.config.tie_word_embeddings and isinstance(module.lm_head, nn.Linear):
        module.lm_head.weight = module.model.embed_tokens.weight
    rope = module.model.rotary_emb
    rope.cos, rope.sin = torch.empty(0, device=device), torch.empty(0, device=device)
    rope.reset_tables()
    return module


@contextlib.contextmanager
def _skip_parameter_init() -> Iterator[None]:
    """Make ``torch.nn.init``'s fills no-ops: every weight is set afterwards anyway, and a fill on the meta
    device imports torch's Python reference kernels, which costs a process seconds the first time."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def init_random_weights(module: LlamaForCausalLM, seed: int) -> None:
    """Deterministic: the same seed gives bit-identical weights on every machine."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        with torch.no_grad():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02, generator=generator)
            elif "embed_tokens" in name or name == "lm_head.weight":
                param.normal_(0.0, 0.1, generator=generator)
            else:  # fan-in scaled, so every layer contributes to the residual stream
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)


def load_checkpoint(module: LlamaForCausalLM, model_dir: str) -> None:
    """Load ``*.safetensors`` (one file, or several listed by ``model.safetensors.index.json``)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(model_dir, name) for name in files]
    else:
        paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r}")
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        state.update(load_file(path))
    if module.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {name for name, _ in module.named_parameters()}
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(
            f"model: checkpoint {model_dir!r} lacks weights: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if unexpected:
        raise ValueError(f"model: checkpoint {model_dir!r} has unknown weights: {', '.join(unexpected[:5])}")
    with torch.no_grad():
        for name, param in module.named_parameters():
            tensor = state[name]
            if tensor.shape != param.shape:
                raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if tensor.dtype == param.dtype and tensor.device == param.device:
                # Take the file-backed tensor itself: a copy would first-touch fresh memory page by page,
                # which costs more than the file read (workers on one machine then share the pages, too).
                param.data = tensor
            else:
                param.copy_(tensor.to(param.dtype))
