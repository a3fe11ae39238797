"""Small GGUF files for tests, written the way llama.cpp's converter writes them (``gguf.GGUFWriter``).

Weights are seeded random numbers in Hugging Face's layout; Llama's Q/K rows are permuted into
llama.cpp's order here, independently of the engine's loader, which must undo it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["the quick brown fox jumps over the lazy dog", "chunked prefill splits prompts", "naïve café, 2024"] * 20
SPECIAL_TOKENS = ["<s>", "</s>", "<|eot|>"]  # BOS, EOS, end of turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_vocabulary(vocab_size: int = 320) -> tuple[list[str], list[str]]:
    """Tokens (byte-level spelling, specials first) and merges of a BPE trained on a small corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's two halves of rows interleaved, pair by pair."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q4_K data (gguf-py dequantises it but cannot quantise): random 4-bit values and 6-bit scales
    under a small super-block scale and a minimum that centres the values (the first two float16s)."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.array([2e-4, 1.5e-3], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str = "llama",
    matrix_type: str = "Q8_0",
    *,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = False,
    add_bos: bool = True,
    tokenizer_model: str = "gpt2",
    drop_tensors: tuple[str, ...] = (),
    integer_tensor: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    context_length: int = 512,
    weight_std: float = 0.08,
) -> Path:
    """A random ``arch`` model (llama or qwen2; any name is written as given) with its tokenizer and chat template.

    ``vocab_size``: pad the tokenizer's vocabulary with tokens no merge produces, to a model-sized table.
    """
    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocabulary()
    if vocab_size is not None:
        tokens += [f"<|filler_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = len(tokens)
    head_dim = hidden // heads
    qtype = gguf.GGMLQuantizationType[matrix_type]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, weight_std, (rows, cols)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": matrix(vocab, hidden)}
    tensors["output_norm.weight"] = rng.normal(1.0, 0.1, hidden).astype(np.float32)
    if not tied:
        tensors["output.weight"] = matrix(vocab, hidden)
    for i in range(layers):
        q, k = matrix(heads * head_dim, hidden), matrix(kv_heads * head_dim, hidden)
        if arch == "llama":
            q, k = llama_cpp_permute(q, heads), llama_cpp_permute(k, kv_heads)
        p = f"blk.{i}."
        tensors.update(
            {
                p + "attn_norm.weight": rng.normal(1.0, 0.1, hidden).astype(np.float32),
                p + "ffn_norm.weight": rng.normal(1.0, 0.1, hidden).astype(np.float32),
                p + "attn_q.weight": q,
                p + "attn_k.weight": k,
                p + "attn_v.weight": matrix(kv_heads * head_dim, hidden),
                p + "attn_output.weight": matrix(hidden, heads * head_dim),
                p + "ffn_gate.weight": matrix(intermediate, hidden),
                p + "ffn_up.weight": matrix(intermediate, hidden),
                p + "ffn_down.weight": matrix(hidden, intermediate),
            }
        )
        if arch == "qwen2":
            for name, rows in (("attn_q", q.shape[0]), ("attn_k", k.shape[0]), ("attn_v", k.shape[0])):
                tensors[p + name + ".bias"] = rng.normal(0.0, 0.5, rows).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    writer.add_eot_token_id(tokens.index("<|eot|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors.items():
        if name in drop_tensors:
            continue
        if name == integer_tensor:
            writer.add_tensor(name, np.zeros(array.shape, dtype=np.int32))
        elif array.ndim == 2 and qtype == gguf.GGMLQuantizationType.Q4_K:
            writer.add_tensor(name, random_q4_k_blocks(rng, *array.shape), raw_dtype=qtype)
        elif array.ndim == 2 and qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        elif array.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
