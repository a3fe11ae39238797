"""Build a model and fill its weights: from a HF safetensors checkpoint (a GGUF file converts to one,
see ``engine.gguf``), or a seeded random preset."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import load_file

from pdserve.engine.config import PRESETS, ModelConfig, resolve_checkpoint
from pdserve.engine.model import LlamaForCausalLM


def build_model(
    model: str, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LlamaForCausalLM:
    with torch.device("meta"), _skip_parameter_init():
        module = LlamaForCausalLM(config)
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
