"""What an engine serves its model in, decided once at start-up: the device, the weight format
(``--quantization``), the compute and kernel dtypes, the KV cache's dtype and size; then the model built in
them (``load``). ``LLMEngine`` takes the result and keeps none of these rules itself.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from pdserve.engine.config import EngineConfig, ModelConfig, gguf_file
from pdserve.engine.gguf import GGUFCheckpoint, open_gguf
from pdserve.engine.kv_capacity import KVCapacity, plan_kv_capacity
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_runner import use_device
from pdserve.engine.quantization import (
    INT4_KINDS,
    INT8_KINDS,
    auto_weight_format,
    native_weight_kinds,
    quantized_compute_dtype,
    release_freed_memory,
    store_weights_in_float16,
    weight_only_input_dtype,
)
from pdserve.engine.weights import build_model

log = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """A model built as ``EngineConfig`` asks, with the choices made for it."""

    model: LlamaForCausalLM
    device: torch.device
    quantization: str  # what --quantization resolved to: native, float16 or none
    dtype: torch.dtype  # the activations' dtype
    kernel_dtype: torch.dtype  # the inputs of the native path's int4/int8 GEMMs
    kv_cache_dtype: torch.dtype
    kv_capacity: KVCapacity  # the KV pool's blocks and how they were sized


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU. A bare ``cuda`` names the current GPU by its index, so that
    the engine's threads all bind to that one (``model_runner.use_device``) and it reports which it is."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_quantization(
    mode: str, model: str, device: torch.device, dtype: str = "auto"
) -> tuple[str, GGUFCheckpoint | None]:
    """The weight format to serve ``model`` in (``native``, ``float16`` or ``none``), with the GGUF file whose
    blocks ``native`` keeps (None otherwise). See ``engine.quantization.auto_weight_format`` for what ``auto``
    picks with ``dtype`` and why. ``native`` keeps only the kinds ``native_weight_kinds`` allows on ``device``
    (on CUDA, Q4 alone) and dequantises the others to the compute dtype, saying so in a warning; with none
    left to keep it is ``none``.

    ``native`` on a model that is not a GGUF file with Q4_0/Q4_1/Q8_0 weights, and ``float16`` off the CPU,
    raise ValueError.
    """
    if mode == "none":
        return "none", None
    if mode == "float16":
        if device.type != "cpu":
            raise ValueError(f"quantization float16 is for CPUs; on {device.type}, compute in 16 bits (--dtype)")
        return "float16", None
    path = gguf_file(model)
    checkpoint = open_gguf(path) if path is not None else None
    quantized = {t.kind for t in checkpoint.tensors} & (INT4_KINDS | INT8_KINDS) if checkpoint is not None else set()
    if not quantized:
        if mode == "auto":
            return "none", None
        raise ValueError(f"quantization native: model {model!r} is not a GGUF file with Q4_0, Q4_1 or Q8_0 weights")
    picked = "native" if mode == "native" else auto_weight_format(device, dtype)
    if picked == "native":  # only the kinds a good kernel takes here stay quantized
        compute_dtype = resolve_dtype(dtype, device)
        kept = native_weight_kinds(device, compute_dtype)
        dequantised = sorted(quantized - kept.kinds)
        if dequantised:
            log.warning(
                "quantization %s on %s: %s weights dequantised to %s (%s)",
                mode,
                device,
                ", ".join(dequantised),
                str(compute_dtype).removeprefix("torch."),
                kept.why_not,
            )
        if not quantized & kept.kinds:
            return "none", None
    return picked, checkpoint if picked == "native" else None


def quantized_checkpoint(mode: str, model: str, device: torch.device, dtype: str = "auto") -> GGUFCheckpoint | None:
    """The GGUF file to serve in its own quantized format, or None for a dequantised path."""
    return resolve_quantization(mode, model, device, dtype)[1]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load(config: EngineConfig, model_config: ModelConfig) -> LoadedModel:
    """Build ``config``'s model on its device in the format, dtypes and KV size it resolves to.

    Raises ValueError when the options contradict each other (``float16`` weights computed in 16 bits).
    """
    device = resolve_device(config.device)
    use_device(device)
    quantization, quantized = resolve_quantization(config.quantization, config.model, device, config.dtype)
    if quantized is not None and config.dtype == "auto":
        dtype = quantized_compute_dtype(device)
        kernel_dtype = weight_only_input_dtype(device)
    else:
        dtype = kernel_dtype = resolve_dtype(config.dtype, device)
    if quantization == "float16" and dtype != torch.float32:
        raise ValueError(f"quantization float16 computes in float32: --dtype auto or float32, not {dtype}")
    if config.kv_cache_dtype == "auto":  # 16-bit weights or fewer on a CPU: a float16 cache, as llama.cpp's
        bfloat16_inputs = dtype == torch.float32 and kernel_dtype != torch.float32  # native on a CPU
        kv_cache_dtype = torch.float16 if quantization == "float16" or bfloat16_inputs else dtype
    else:
        kv_cache_dtype = resolve_dtype(config.kv_cache_dtype, device)
    model = build_model(
        config.model,
        model_config,
        dtype,
        device,
        config.seed,
        quantized=quantized,
        kernel_dtype=kernel_dtype,
        native_kinds=native_weight_kinds(device, kernel_dtype).kinds,
    )
    model.fuse_projections()
    if quantization == "float16":
        store_weights_in_float16(model)
    release_freed_memory()
    capacity = plan_kv_capacity(config, model, model_config, kv_cache_dtype, device)
    return LoadedModel(model, device, quantization, dtype, kernel_dtype, kv_cache_dtype, capacity)
