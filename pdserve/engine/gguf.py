"""GGUF checkpoints (llama.cpp's one-file format), read with the ``gguf`` package.

A GGUF file holds the architecture, the (mostly quantised) tensors and the tokenizer as metadata.
``converted_checkpoint`` checks one (magic, architecture, tensor types and shapes, tokenizer), then
dequantises it to float32 and writes a Hugging Face-style directory into the cache, once:
``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
template), and where each tensor lies in the file (``gguf_tensors.json``). The safetensors path serves it
from there, so each later load (every worker of a deployment) reads a safetensors file instead of parsing
and dequantising again; the quantized path opens the file's blocks through that index (``open_gguf``)
instead of parsing its metadata again (seconds: the ``gguf`` reader walks a vocabulary element by element).

llama.cpp's converter permutes the rows of Llama's Q and K projections (its rope rotates adjacent
pairs, Hugging Face's rotates halves); ``unpermute_rope_rows`` puts them back.

The cache lives in ``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``;
an entry is keyed by the file's real path, size and modification time, and replaces the entries of
earlier versions of the same path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType
    from tokenizers import Tokenizer

CONVERTER_VERSION = 2  # bump when the converted layout changes: old cache entries are then ignored
GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"  # written last: an entry without it is incomplete
TENSOR_INDEX_FILE = "gguf_tensors.json"  # each tensor's type, shape and place in the file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # GGUF name -> HF name
PERMUTED_QK = frozenset({"llama"})  # architectures whose converter permutes Q/K rows
TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)

QUANT_GROUP = 32  # weights per block in Q4_0, Q4_1 and Q8_0
BLOCK_LAYOUTS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per block: f16 scale [, f16 minimum], the codes

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# How text is split into words before BPE, by ``tokenizer.ggml.pre`` (llama.cpp's names).
_GPT2_SPLIT = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_THEN_GPT2_SPLIT = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_REGEX_SPLITS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_REGEX_SPLIT_ALIASES = {"llama-bpe": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3", "deepseek-r1-qwen": "qwen2"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class TensorSource(NamedTuple):
    """A tensor of a GGUF file as the ``gguf`` reader gives it, or as ``open_gguf`` finds it again from the index."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest dimension first
    offset: int  # of its first byte in the file
    data: np.ndarray  # a view of the memory-mapped file, typed and shaped as the ``gguf`` reader types it

    def index_entry(self) -> dict[str, Any]:
        """What ``open_gguf`` needs to find it again (``TENSOR_INDEX_FILE``)."""
        return {
            "name": self.name,
            "type": self.tensor_type.name,
            "shape": list(self.shape),
            "offset": self.offset,
            "dtype": self.data.dtype.str,
            "data_shape": list(self.data.shape),
        }


@dataclass(frozen=True)
class GGUFTensor:
    """One weight to convert: the GGUF tensor, its Hugging Face name and shape, and the Q/K heads to unpermute."""

    hf_name: str
    source: TensorSource
    shape: tuple[int, ...]
    unpermute_heads: int | None = None

    def __post_init__(self) -> None:
        gguf_shape = tuple(int(n) for n in reversed(self.source.shape))  # GGUF lists the fastest dimension first
        if gguf_shape != self.shape:
            raise ValueError(f"tensor {self.source.name} has shape {gguf_shape}, the config implies {self.shape}")
        if self.unpermute_heads is not None and self.shape[0] % (2 * self.unpermute_heads):
            heads = self.unpermute_heads
            raise ValueError(f"tensor {self.source.name}: {self.shape[0]} rows do not split into {heads} heads")

    def dequantize(self) -> np.ndarray:
        """The weight in float32, in Hugging Face's layout."""
        from gguf.quants import dequantize

        array = dequantize(self.source.data, self.source.tensor_type).reshape(self.shape)
        if self.unpermute_heads is not None:
            array = unpermute_rope_rows(array, self.unpermute_heads)
        return np.ascontiguousarray(array, dtype=np.float32)

    @property
    def kind(self) -> str:
        """The GGUF tensor type's name: ``"Q4_1"``, ``"F32"``, ..."""
        return self.source.tensor_type.name

    def quantized_blocks(self) -> QuantizedBlocks:
        """The weight as its file stores it (Q4_0, Q4_1 or Q8_0 only), in Hugging Face's row order.

        Raises ValueError for another type. Nothing is dequantised: the codes and the per-32 scales are read
        from the blocks as they are.
        """
        if self.kind not in BLOCK_LAYOUTS or len(self.shape) != 2:
            raise ValueError(f"tensor {self.source.name}: type {self.kind} has no quantized kernel (Q4_0, Q4_1, Q8_0)")
        rows, cols = self.shape
        block_bytes = BLOCK_LAYOUTS[self.kind]
        raw = np.asarray(self.source.data, dtype=np.uint8).reshape(rows, cols // QUANT_GROUP, block_bytes)
        if self.unpermute_heads is not None:  # whole rows move: a block never spans two rows
            raw = unpermute_rope_rows(raw, self.unpermute_heads)
        scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if self.kind == "Q8_0":
            codes = raw[..., 2:].copy().view(np.int8).reshape(rows, cols)
            return QuantizedBlocks(self.kind, codes, scale, None)
        offset = 4 if self.kind == "Q4_1" else 2
        packed = raw[..., offset:]  # 16 bytes: element i in the low nibble of byte i, element 16 + i in the high
        codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
        if self.kind == "Q4_1":
            minimum = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:  # Q4_0: w = d * (q - 8)
            minimum = -8.0 * scale
        return QuantizedBlocks(self.kind, codes, scale, minimum)


@dataclass(frozen=True)
class QuantizedBlocks:
    """A GGUF weight in its stored form: ``w[r, c] = scale[r, g] * codes[r, c] + minimum[r, g]``, ``g = c // 32``.

    ``codes`` is uint8 in 0..15 (Q4_0, Q4_1) or int8 (Q8_0, whose ``minimum`` is None); ``scale`` and
    ``minimum`` are float32 ``[rows, cols / 32]``.
    """

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        scale = np.repeat(self.scale, QUANT_GROUP, axis=1)
        weight = scale * self.codes.astype(np.float32)
        if self.minimum is not None:
            weight += np.repeat(self.minimum, QUANT_GROUP, axis=1)
        return weight


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A checked GGUF file: its HF config, tokenizer and tensors (dequantised only on ``state_dict``)."""

    path: str
    hf_config: Mapping[str, Any]
    tokenizer: Tokenizer
    tokenizer_config: Mapping[str, Any]
    tensors: tuple[GGUFTensor, ...]

    def __post_init__(self) -> None:
        names = [t.hf_name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"model: {self.path}: two tensors map to the same weight")
        if self.tokenizer.get_vocab_size() > self.hf_config["vocab_size"]:
            raise ValueError(
                f"model: {self.path}: the tokenizer has {self.tokenizer.get_vocab_size()} tokens, "
                f"the embedding only {self.hf_config['vocab_size']} rows"
            )

    def state_dict(self) -> dict[str, np.ndarray]:
        return {t.hf_name: t.dequantize() for t in self.tensors}

    def save(self, directory: str) -> None:
        """Write the Hugging Face-style checkpoint into ``directory`` (which must exist)."""
        from safetensors.numpy import save_file

        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(dict(self.hf_config), f, indent=1)
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(dict(self.tokenizer_config), f, indent=1)
        self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
        with open(os.path.join(directory, TENSOR_INDEX_FILE), "w") as f:
            json.dump([t.source.index_entry() for t in self.tensors], f)
        save_file(self.state_dict(), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of a Q or K projection (weight or bias).

    llama.cpp stores each head's rows as pairs (row i, row i + head_dim/2), adjacent; Hugging Face keeps
    the two halves apart.
    """
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def cache_root() -> Path:
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve"


def converted_checkpoint(path: str) -> str:
    """The cached Hugging Face-style directory of the GGUF file ``path``, converted on first use.

    Raises ValueError naming what is wrong when ``path`` is not a GGUF file we can serve. Concurrent
    callers may both convert; the first to finish publishes its directory (an atomic rename).
    """
    real = os.path.realpath(path)
    stat = os.stat(real)
    source = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "converter": CONVERTER_VERSION}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
    target = cache_root() / "gguf" / f"{Path(real).stem}-{key}"
    if _is_complete(target, source):
        return str(target)
    checkpoint = read_gguf(real)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        checkpoint.save(staging)
        with open(os.path.join(staging, SOURCE_FILE), "w") as f:
            json.dump(source, f)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target, source):  # not a concurrent conversion: a stale entry, replace it
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_outdated(target, real)
    return str(target)


def open_gguf(path: str) -> GGUFCheckpoint:
    """``read_gguf(path)`` through its conversion's files (``converted_checkpoint``, made first if need be): the
    config, tokenizer and tensor index from there, the tensors' blocks from a memory map of the file. About a
    tenth of a second, where ``read_gguf`` takes seconds; the same checks of the tensors' shapes run again."""
    from gguf import GGMLQuantizationType
    from tokenizers import Tokenizer

    directory = Path(converted_checkpoint(path))
    with open(directory / "config.json") as f:
        hf_config = json.load(f)
    with open(directory / "tokenizer_config.json") as f:
        tokenizer_config = json.load(f)
    with open(directory / TENSOR_INDEX_FILE) as f:
        index = json.load(f)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    sources: dict[str, TensorSource] = {}
    for entry in index:
        dtype, shape, offset = np.dtype(entry["dtype"]), tuple(entry["data_shape"]), entry["offset"]
        end = offset + dtype.itemsize * int(np.prod(shape))
        if end > file.size:
            raise ValueError(f"model: {path}: tensor {entry['name']} ends past the file's {file.size} bytes (changed?)")
        data = file[offset:end].view(dtype).reshape(shape)
        tensor_type = GGMLQuantizationType[entry["type"]]
        sources[entry["name"]] = TensorSource(entry["name"], tensor_type, tuple(entry["shape"]), offset, data)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    try:
        tensors = _tensor_plan(hf_config["model_type"], hf_config, sources)
    except ValueError as e:
        raise ValueError(f"model: {path}: {e}") from e
    return GGUFCheckpoint(path, hf_config, tokenizer, tokenizer_config, tensors)


def _remove_outdated(current: Path, real_path: str) -> None:
    """Delete the entries of earlier versions of the same file (reinstalled, rewritten): ~0.5 GB each."""
    for entry in current.parent.glob(f"{Path(real_path).stem}-*"):
        if entry == current:
            continue
        try:
            with open(entry / SOURCE_FILE) as f:
                outdated = json.load(f).get("path") == real_path
        except (OSError, ValueError):
            continue  # someone else's conversion in progress, or not ours
        if outdated:
            shutil.rmtree(entry, ignore_errors=True)


def _is_complete(directory: Path, source: dict[str, Any]) -> bool:
    try:
        with open(directory / SOURCE_FILE) as f:
            return json.load(f) == source
    except (OSError, ValueError):
        return False


def read_gguf(path: str) -> GGUFCheckpoint:
    """Open and check a GGUF file; raises ValueError naming what is wrong with it."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"model: {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except Exception as e:  # the reader fails in many ways on a cut-off file
        size = os.path.getsize(path)
        raise ValueError(f"model: {path} ({size} bytes) is not a readable GGUF file, truncated or corrupt: {e}") from e

    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: {path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    sources = {
        t.name: TensorSource(t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.data_offset), t.data)
        for t in reader.tensors
    }
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise ValueError(
                f"model: {path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which we do not "
                f"dequantise (supported: {', '.join(sorted(TENSOR_TYPES))})"
            )
    if "rope_freqs.weight" in sources:
        raise ValueError(f"model: {path}: per-dimension rope frequency factors (rope_freqs) are not supported")
    if "token_embd.weight" not in sources:
        raise ValueError(f"model: {path}: no token_embd.weight tensor")
    hf_config = _hf_config(path, arch, metadata, sources)
    tokenizer, tokenizer_config = tokenizer_from_gguf(path, metadata)
    try:
        tensors = _tensor_plan(arch, hf_config, sources)
    except ValueError as e:
        raise ValueError(f"model: {path}: {e}") from e
    return GGUFCheckpoint(path, hf_config, tokenizer, tokenizer_config, tensors)


def _hf_config(path: str, arch: str, metadata: dict[str, Any], sources: dict[str, TensorSource]) -> dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if required and value is None:
            raise ValueError(f"model: {path}: metadata {arch}.{key} is missing")
        if value is not None and not isinstance(value, int | float | str):
            raise ValueError(f"model: {path}: metadata {arch}.{key} = {value!r} (per-layer values are not supported)")
        return value

    heads = get("attention.head_count", required=True)
    hidden = get("embedding_length", required=True)
    head_dim = get("attention.key_length") or hidden // heads
    rotary_dim = get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"model: {path}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"model: {path}: rope scaling {scaling!r} is not supported (none, linear)")
    eos = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(sources["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": None if scaling == "none" else {"rope_type": "linear", "factor": get("rope.scaling.factor")},
        "tie_word_embeddings": "output.weight" not in sources,
        "attention_bias": "blk.0.attn_q.bias" in sources,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(t for t in eos if t is not None)),
        "torch_dtype": "float32",
    }


def _tensor_plan(arch: str, config: dict[str, Any], sources: dict[str, TensorSource]) -> tuple[GGUFTensor, ...]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    layer_shapes = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden),
        "attn_v.weight": (kv_rows, hidden),
        "attn_q.bias": (q_rows,),
        "attn_k.bias": (kv_rows,),
        "attn_v.bias": (kv_rows,),
        "attn_output.weight": (hidden, q_rows),
        "ffn_gate.weight": (inter, hidden),
        "ffn_up.weight": (inter, hidden),
        "ffn_down.weight": (hidden, inter),
    }
    global_shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    permute = {"attn_q": heads, "attn_k": kv_heads} if arch in PERMUTED_QK else {}
    plan: list[GGUFTensor] = []
    expected: set[str] = {"token_embd.weight", "output_norm.weight"}
    for name, source in sources.items():
        if name in _GLOBAL_TENSORS:
            plan.append(GGUFTensor(_GLOBAL_TENSORS[name], source, global_shapes[name]))
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _LAYER_TENSORS:
            raise ValueError(f"unexpected tensor {name}")
        layer, suffix = int(parts[1]), parts[2]
        if layer >= config["num_hidden_layers"]:
            raise ValueError(f"tensor {name} is beyond the {config['num_hidden_layers']} layers")
        hf_name = f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
        plan.append(GGUFTensor(hf_name, source, layer_shapes[suffix], permute.get(suffix.split(".")[0])))
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"blk.{layer}.{suffix}" for suffix in _LAYER_TENSORS if not suffix.endswith(".bias"))
        if config["attention_bias"]:
            expected.update(f"blk.{layer}.attn_{p}.bias" for p in "qkv")
    missing = sorted(expected - sources.keys())
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return tuple(plan)


def tokenizer_from_gguf(path: str, metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` and a ``tokenizer_config.json`` from a GGUF file's tokenizer metadata.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) only: vocabulary, merges, the split llama.cpp
    applies before BPE (``tokenizer.ggml.pre``), control tokens as special tokens, user-defined tokens
    matched whole. ``add_bos_token`` follows the file's flag (absent: no BOS, as for GPT-2).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"model: {path}: tokenizer {kind!r} is not supported (byte-level BPE, 'gpt2', only)")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ValueError(f"model: {path}: the tokenizer metadata lacks its tokens or merges")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = metadata.get("tokenizer.ggml.pre", "default")

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))  # stored as text, not byte-spelled
        vocab.setdefault(token, index)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise ValueError(f"model: {path}: a tokenizer merge is not two tokens")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in _GPT2_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_THEN_GPT2_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif _REGEX_SPLIT_ALIASES.get(pre, pre) in _REGEX_SPLITS:
        split = Regex(_REGEX_SPLITS[_REGEX_SPLIT_ALIASES.get(pre, pre)])
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(split, behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"model: {path}: the tokenizer's pre-tokenizer {pre!r} is not supported")
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])

    def token_text(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None

    config = {
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_text("bos_token_id"),
        "eos_token": token_text("eos_token_id"),
        "unk_token": token_text("unknown_token_id"),
        "pad_token": token_text("padding_token_id"),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    return tokenizer, config


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others for code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
