"""The benchmarks' second model shape, where weights dominate: a randomly initialised Llama of TinyLlama-1.1B's
shape (22 layers, hidden 2048, MLP 5632, 32 heads / 4 KV heads, 32,000 tokens, untied output), written once
into the benchmarks' cache (``vllm_peer.bench_cache``) as GGUF files by the project's own test writer
(``tests/support/gguf_writer.py``: Q4_0 and F16) and as a Hugging Face safetensors folder for vLLM, converted
by pdserve from the F16 file (the same weights). The tokens it produces mean nothing; only the speed counts.

    python benchmarks/large_shape.py        # writes the files (minutes, ~4 GB of disk), prints their paths
"""

from __future__ import annotations

import sys
from pathlib import Path

import vllm_peer

SHAPE = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab_size=32000)
NAME = "tinyllama-shape-random"
SEED = 0


def _writer():  # type: ignore[no-untyped-def]
    support = Path(__file__).resolve().parent.parent / "tests" / "support"
    if str(support) not in sys.path:
        sys.path.insert(0, str(support))
    import gguf_writer

    return gguf_writer


def gguf_path(matrix_type: str) -> Path:
    """The shape's GGUF file in ``matrix_type`` (Q4_0 or F16), written on first use."""
    path = vllm_peer.bench_cache() / "models" / f"{NAME}.{matrix_type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        _writer().write_gguf(partial, "llama", matrix_type, seed=SEED, context_length=4096, weight_std=0.02, **SHAPE)  # type: ignore[arg-type]
        partial.rename(path)
    return path


def hf_folder() -> Path:
    """vLLM's folder of the shape: pdserve's conversion of the F16 file, in bfloat16."""
    return vllm_peer.hf_folder(str(gguf_path("F16")), f"{NAME}-bf16")


if __name__ == "__main__":
    for kind in ("Q4_0", "F16"):
        print(gguf_path(kind))
    print(hf_folder())
