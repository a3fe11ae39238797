#!/usr/bin/env python3
"""The CUDA paths in one run of a few minutes on one GPU, without Ray and without network; a report in a folder.

    python3 scripts/gpu_check.py --out DIR          # on a machine with an NVIDIA GPU (bash scripts/gpu_check.sh)
    python3 scripts/gpu_check.py --cpu --out DIR    # the same checks on the CPU, at toy sizes (CI runs this)

Checks, in this order, each on its own (one failing does not stop the others):

1. environment: Python, torch and CUDA, the GPU, the driver, the packages the checks use;
2. ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matrix-product rate;
3. parity: the engine against ``transformers`` in bfloat16 on a small random Llama and a small random Qwen2:
   prompt logits (chunked prefill) no further from transformers' float32 logits than transformers' own bf16
   logits are (within 2x), greedy tokens equal to transformers' bf16 greedy tokens or parting at a near-tie;
4. speed: a randomly initialised model of Llama-3-8B's shape, written as a safetensors checkpoint and loaded
   by the engine with its KV cache sized from the GPU's memory: decode ms/step at 1, 16 and 64 requests and
   prefill chunks of 512 and 2048 tokens against a roofline (bytes over the measured bandwidth, FLOPs over
   the measured bf16 rate), kernels per decode step, and whether prefill attention runs the flash kernel;
   (before it, ``quantized``: small Q4_0 and Q8_0 GGUF files under ``--quantization auto``, on CUDA Q4_0 on
   torch's int4 kernel and Q8_0 dequantised, against the same files dequantised);
5. identity: one request's bfloat16 greedy tokens alone, batched with 15 others, and prefilled in 256-token
   chunks: the first token where they part and the logit gap there (a near-tie, or a real difference);
6. transports: 768 MiB of KV blocks from one process's pool to another's on the same GPU, over NIXL (VRAM to
   VRAM) and over gRPC (staged through pinned host memory): bytes exact (per-block CRC-32), GB/s.

The report is ``gpu_check.md`` (a table, then each check's figures) and ``gpu_check.json`` in ``--out``,
rewritten after every check, so a run cut short leaves what it measured. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.abc
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # pdserve from this checkout: it is not installed on the GPU machine

LLAMA3_8B = dict(  # the shape of Llama-3-8B (its weights here are random)
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
TOY = dict(  # the same roles at toy sizes, for --cpu
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=500000.0,
)


@dataclass(frozen=True)
class Sizes:
    """Everything whose size differs between the GPU run and the CPU dry run."""

    device: str
    copy_bytes: int
    matmul_n: int
    parity_model: dict[str, int]
    parity_prompt: int
    parity_tokens: int
    big_model: dict[str, Any]
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int
    prefill_chunks: tuple[int, ...]
    identity_prompt: int
    identity_tokens: int
    identity_companions: int
    identity_chunk: int
    transfer_block_shape: tuple[int, ...]
    transfer_blocks: int
    transfer_push_blocks: int
    transfer_pushes: int
    transfer_reps: int


GPU = Sizes(
    device="cuda",
    copy_bytes=2 * 2**30,
    matmul_n=8192,
    parity_model=dict(hidden=512, intermediate=1024, layers=4, heads=8, kv_heads=2, vocab=1024),
    parity_prompt=300,
    parity_tokens=32,
    big_model=LLAMA3_8B,
    decode_batches=(1, 16, 64),
    decode_prompt=512,
    decode_steps=20,
    prefill_chunks=(512, 2048),
    identity_prompt=1000,
    identity_tokens=32,
    identity_companions=15,
    identity_chunk=256,
    transfer_block_shape=(32, 2, 16, 8, 128),  # one 16-token block of the 8B model's KV in bf16: 2 MiB
    transfer_blocks=512,
    transfer_push_blocks=32,
    transfer_pushes=12,
    transfer_reps=4,
)
CPU = Sizes(
    device="cpu",
    copy_bytes=32 * 2**20,
    matmul_n=256,
    parity_model=dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=512),
    parity_prompt=150,
    parity_tokens=8,
    big_model=TOY,
    decode_batches=(1, 16, 64),
    decode_prompt=24,
    decode_steps=3,
    prefill_chunks=(512, 2048),
    identity_prompt=200,
    identity_tokens=8,
    identity_companions=3,
    identity_chunk=64,
    transfer_block_shape=(2, 2, 16, 2, 64),
    transfer_blocks=128,
    transfer_push_blocks=8,
    transfer_pushes=8,
    transfer_reps=3,
)


class Check(NamedTuple):
    name: str
    status: str  # PASS, MISS (ran, a target missed), FAIL (broke), SKIP (could not run here), INFO
    summary: str
    details: dict[str, Any]
    seconds: float


class Report:
    """The checks so far, written to ``out`` after each one."""

    def __init__(self, out: Path, mode: str) -> None:
        self.out = out
        self.mode = mode
        self.checks: list[Check] = []
        self.started = time.time()
        out.mkdir(parents=True, exist_ok=True)

    def add(self, check: Check) -> None:
        self.checks.append(check)
        print(f"{check.status:4}  {check.name} ({check.seconds:.0f} s): {check.summary}", flush=True)
        self.write()

    def write(self) -> None:
        body = {
            "mode": self.mode,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "checks": [c._asdict() for c in self.checks],
        }
        (self.out / "gpu_check.json").write_text(json.dumps(body, indent=2, default=str))
        lines = [
            f"# pdserve device check ({self.mode})",
            "",
            f"Started {body['started']}, {body['seconds']} s so far.",
            "",
            "| check | status | seconds | summary |",
            "|---|---|---|---|",
        ]
        lines += [f"| {c.name} | {c.status} | {c.seconds:.0f} | {c.summary.replace('|', '/')} |" for c in self.checks]
        for c in self.checks:
            lines += ["", f"## {c.name}", "", "```", json.dumps(c.details, indent=2, default=str), "```"]
        (self.out / "gpu_check.md").write_text("\n".join(lines) + "\n")

    def detail(self, name: str, key: str, default: Any = None) -> Any:
        for c in self.checks:
            if c.name == name:
                return c.details.get(key, default)
        return default


def log(message: str) -> None:
    print(f"      {time.strftime('%H:%M:%S')} {message}", flush=True)


def free_device_memory() -> None:
    """Collect what the last check left (an engine's pool may sit in reference cycles) and hand torch's cached
    GPU memory back, so that the next engine sizing its KV cache from the free memory finds it free."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_check(report: Report, name: str, deadline: float, fn: Callable[[], tuple[str, str, dict[str, Any]]]) -> None:
    """Run one check and record it; an exception is a FAIL with its traceback, a check past the deadline a SKIP."""
    if time.monotonic() > deadline:
        report.add(Check(name, "SKIP", "not run: the time budget is spent", {}, 0.0))
        return
    started = time.monotonic()
    try:
        status, summary, details = fn()
    except Exception as e:
        status, summary, details = "FAIL", f"{type(e).__name__}: {e}"[:300], {"traceback": traceback.format_exc()}
        print(details["traceback"], flush=True)
    report.add(Check(name, status, summary, details, time.monotonic() - started))
    free_device_memory()


# ---- helpers ---------------------------------------------------------------------------------------------------
def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` ones (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def random_prompt(generator: Any, length: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one is a prefix), or None."""
    shorter = min(len(a), len(b))
    return next((k for k in range(shorter) if a[k] != b[k]), None if len(a) == len(b) else shorter)


def importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:
        return False


def version_of(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


# ---- 1. environment --------------------------------------------------------------------------------------------
def check_environment(sizes: Sizes) -> tuple[str, str, dict[str, Any]]:
    import torch

    details: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {
            p: version_of(p)
            for p in ("transformers", "safetensors", "tokenizers", "numpy", "grpcio", "protobuf", "nixl", "ray")
        },
        "UCX_TLS": os.environ.get("UCX_TLS"),
    }
    try:
        details["pdserve_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        details["pdserve_commit"] = "unknown"
    if sizes.device == "cpu":
        details["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        return "PASS", f"CPU dry run: torch {torch.__version__}, Python {details['python']}", details
    if not torch.cuda.is_available():
        return "FAIL", "no CUDA device", details
    props = torch.cuda.get_device_properties(0)
    details |= {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
    }
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        details["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        details["nvidia_smi"] = repr(e)
    summary = f"{props.name} (sm {props.major}{props.minor}, {details['memory_gib']} GiB), torch {torch.__version__}"
    return "PASS", summary, details


# ---- 2. ceilings -----------------------------------------------------------------------------------------------
def check_ceilings(sizes: Sizes) -> tuple[str, str, dict[str, Any]]:
    import torch

    device = torch.device(sizes.device)
    src = torch.randint(0, 255, (sizes.copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = statistics.median(timed(lambda: dst.copy_(src), device, reps=10))
    bandwidth = 2 * sizes.copy_bytes / copy_s  # read + write
    n = sizes.matmul_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = statistics.median(timed(lambda: a @ b, device, reps=10))
    flops = 2 * n**3 / matmul_s
    details = {
        "copy_bytes": sizes.copy_bytes,
        "copy_s": copy_s,
        "bandwidth_GBps": bandwidth / 1e9,
        "matmul_n": n,
        "matmul_s": matmul_s,
        "bf16_TFLOPs": flops / 1e12,
    }
    return "PASS", f"copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", details


# ---- 3. parity against transformers ----------------------------------------------------------------------------
def engine_prompt_logits(engine: Any, prompt: list[int]) -> Any:
    """The engine's logits for every prompt position, through its own scheduler (chunked by its budget)."""
    import torch

    from pdserve.engine import SamplingParams

    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    rows = []
    while engine.get_request(request_id) is not None:
        output = engine.scheduler.schedule()
        rows.append(engine.runner.prompt_logits(output).float().cpu())
        engine.scheduler.update_after_step(output)
        if engine.get_request(request_id).num_computed_tokens == len(prompt):
            engine.abort(request_id)
    return torch.cat(rows)


def hf_greedy(model: Any, prompt: list[int], tokens: int, device: Any) -> tuple[list[int], list[Any]]:
    """transformers' greedy tokens (the whole sequence recomputed each step) and each step's logits."""
    import torch

    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            row = model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


def parity_one(arch: str, sizes: Sizes, workdir: Path) -> dict[str, Any]:
    import torch
    import transformers

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    device = torch.device(sizes.device)
    m = sizes.parity_model
    common = dict(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=2048,
        eos_token_id=m["vocab"] - 1,
        bos_token_id=m["vocab"] - 2,
    )
    torch.manual_seed(0)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    hf = hf.eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
            elif p.dim() == 1 and not p.eq(1).all():  # biases (Qwen2's q/k/v)
                p.normal_(0, 0.05)
    path = workdir / f"parity-{arch}"
    hf.save_pretrained(path)
    prompt = random_prompt(torch.Generator().manual_seed(1), sizes.parity_prompt, m["vocab"] - 2)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        reference32 = hf.to(device, torch.float32)(ids).logits[0].float().cpu()
        hf16 = hf.to(torch.bfloat16)
        reference16 = hf16(ids).logits[0].float().cpu()
    want, want_logits = hf_greedy(hf16, prompt, sizes.parity_tokens, device)
    engine = LLMEngine(
        EngineConfig(
            model=str(path), device=sizes.device, dtype="bfloat16", max_num_batched_tokens=128, num_kv_blocks=256
        )
    )
    ours = engine_prompt_logits(engine, prompt)
    [got] = engine.generate([prompt], SamplingParams(max_tokens=sizes.parity_tokens, temperature=0.0, ignore_eos=True))
    error_ours = (ours - reference32).abs().max().item()
    error_hf = (reference16 - reference32).abs().max().item()
    part = first_difference(got.token_ids, want)
    gap = None
    if part is not None and part < len(want):
        row = want_logits[part]
        gap = abs(row[want[part]] - row[got.token_ids[part]]).item()
    noise = 2 * error_hf + 1e-3
    ok = error_ours <= noise and (part is None or (part >= 4 and gap is not None and gap <= noise))
    del engine
    return {
        "ok": ok,
        "max_abs_logit_error_engine_vs_fp32": error_ours,
        "max_abs_logit_error_hf_bf16_vs_fp32": error_hf,
        "greedy_tokens_equal": part is None,
        "first_difference": part,
        "logit_gap_at_difference": gap,
        "tokens_engine": got.token_ids,
        "tokens_hf_bf16": want,
    }


def check_parity(sizes: Sizes, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    details = {arch: parity_one(arch, sizes, workdir) for arch in ("llama", "qwen2")}
    parts = []
    for arch, d in details.items():
        tokens = "tokens equal" if d["greedy_tokens_equal"] else f"tokens part at {d['first_difference']}"
        parts.append(
            f"{arch}: max logit error {d['max_abs_logit_error_engine_vs_fp32']:.3g} "
            f"(hf bf16 {d['max_abs_logit_error_hf_bf16_vs_fp32']:.3g}), {tokens}"
        )
    return ("PASS" if all(d["ok"] for d in details.values()) else "MISS"), "; ".join(parts), details


def check_quantized(sizes: Sizes, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    """Small GGUF files (Q4_0, Q8_0) served under ``--quantization auto`` against the same files dequantised."""
    if not importable("gguf"):
        return "SKIP", "gguf is not installed: carry its wheel (docs/development.md, The device check)", {}
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from support.gguf_writer import write_gguf

    from pdserve.engine import EngineConfig, LLMEngine

    os.environ["PDSERVE_CACHE_DIR"] = str(workdir / "gguf-cache")
    details: dict[str, Any] = {}
    for matrix_type in ("Q4_0", "Q8_0"):
        path = write_gguf(workdir / f"{matrix_type}.gguf", "llama", matrix_type)
        common = dict(
            model=str(path), device=sizes.device, dtype="bfloat16", max_num_batched_tokens=64, num_kv_blocks=128
        )
        auto = LLMEngine(EngineConfig(quantization="auto", **common))
        exact = LLMEngine(EngineConfig(quantization="none", **common))
        prompt = auto.tokenizer.encode("the quick brown fox jumps over the lazy dog, chunked prefill " * 3)
        ours, reference = engine_prompt_logits(auto, prompt), engine_prompt_logits(exact, prompt)
        layer = auto.runner.model.model.layers[0]
        details[matrix_type] = {
            "quantization": auto.quantization,
            "mlp_down_proj": type(layer.mlp.down_proj).__name__,
            "max_abs_logit_difference": (ours - reference).abs().max().item(),
            "top1_agreement": (ours.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        }
        del auto, exact
    ok = all(d["top1_agreement"] >= 0.9 for d in details.values())
    if sizes.device == "cuda":  # Q4 on torch's int4 kernel, Q8_0 dequantised to bfloat16
        ok = ok and details["Q4_0"]["mlp_down_proj"] == "Int4Linear" and details["Q8_0"]["quantization"] == "none"
    summary = "; ".join(
        f"{k}: {d['quantization']} ({d['mlp_down_proj']}), top-1 {d['top1_agreement']:.0%} of the dequantised"
        for k, d in details.items()
    )
    return ("PASS" if ok else "MISS"), summary, details


# ---- 4. the 8B-shaped model ------------------------------------------------------------------------------------
def llama_tensors(shape: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama checkpoint's tensors (Hugging Face's names)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_random_checkpoint(path: Path, shape: dict[str, Any], device: Any, shard_bytes: int = 4 * 2**30) -> int:
    """A Llama checkpoint of random bfloat16 weights, drawn on ``device``: norms 1, matrices N(0, 1/fan_in), the
    output projection 4x that (logits of a few units: fewer near-ties between the top tokens). Returns bytes."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        **shape,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": shape["vocab_size"] - 2,
        "eos_token_id": shape["vocab_size"] - 1,
    }
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_size = total = 0

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(path / name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_size = {}, 0

    for name, dims in llama_tensors(shape):
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            std = (4.0 if name == "lm_head.weight" else 1.0) / math.sqrt(dims[1])
            if name == "model.embed_tokens.weight":
                std = 1.0
            drawn = torch.randn(dims, device=device, dtype=torch.bfloat16, generator=generator)
            tensor = drawn.mul_(std).cpu()
        shard[name] = tensor
        shard_size += tensor.numel() * 2
        total += tensor.numel() * 2
        if shard_size >= shard_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def checkpoint_folder(need_bytes: int) -> Path:
    """A fresh folder on /dev/shm when it has room (memory-backed: fast to write and map), else in the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        if stat.f_bavail * stat.f_frsize > 1.5 * need_bytes:
            return Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))


def model_figures(engine: Any) -> dict[str, float]:
    """Bytes and FLOPs per token of the engine's model: what a roofline needs."""
    c = engine.model_config
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * engine.kv_cache.element_size()
    matmul_params = (
        c.num_hidden_layers
        * (
            c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
            + c.num_attention_heads * c.head_dim * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.vocab_size * c.hidden_size
    )
    element = 2  # bf16 weights
    return {
        "kv_bytes_per_token": kv_per_token,
        "matmul_params": matmul_params,
        "streamed_weight_bytes": matmul_params * element,  # every matrix once per step (the embedding: rows only)
        "attention_flops_per_key": 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim,
    }


def roofline(flops: float, nbytes: float, ceilings: dict[str, float]) -> dict[str, float]:
    compute_s, memory_s = flops / ceilings["flops"], nbytes / ceilings["bandwidth"]
    return {"floor_ms": 1e3 * max(compute_s, memory_s), "compute_ms": 1e3 * compute_s, "memory_ms": 1e3 * memory_s}


def profile_step(engine: Any, device: Any) -> dict[str, Any]:
    """One engine step under torch's profiler: device kernels (on CUDA) or operators (on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        names = sorted({e.name for e in kernels})
        return {"kernels": len(kernels), "distinct": len(names), "names": names[:60]}
    ops = [e for e in events if e.name.startswith("aten::")]
    return {"operators": len(ops), "distinct": len({e.name for e in ops})}


def check_speed(sizes: Sizes, report: Report, state: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    device = torch.device(sizes.device)
    shape = sizes.big_model
    params = sum(math.prod(d) for _, d in llama_tensors(shape))
    folder = checkpoint_folder(2 * params)
    state["checkpoint"] = folder
    t0 = time.monotonic()
    written = write_random_checkpoint(folder, shape, device)
    t1 = time.monotonic()
    log(f"speed: {written / 2**30:.1f} GiB checkpoint written to {folder} in {t1 - t0:.0f} s; loading")
    budget = max(sizes.prefill_chunks)
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device=sizes.device,
            dtype="bfloat16",
            max_num_batched_tokens=budget,
            max_num_seqs=max(sizes.decode_batches),
            enable_prefix_caching=False,
        )
    )
    t2 = time.monotonic()
    state["engine"] = engine
    log(f"speed: engine loaded in {t2 - t1:.0f} s, {engine.kv_capacity.num_blocks} KV blocks")
    capacity = engine.kv_capacity
    ceilings = {
        "bandwidth": (report.detail("ceilings", "bandwidth_GBps") or 4800.0) * 1e9,
        "flops": (report.detail("ceilings", "bf16_TFLOPs") or 989.0) * 1e12,
    }
    figures = model_figures(engine)
    details: dict[str, Any] = {
        "parameters": params,
        "checkpoint_bytes": written,
        "checkpoint_folder": str(folder),
        "write_checkpoint_s": t1 - t0,
        "load_engine_s": t2 - t1,
        "kv_blocks": capacity.num_blocks,
        "kv_gib": capacity.kv_bytes / 2**30,
        "kv_tokens": capacity.num_blocks * engine.config.block_size,
        "memory_profile": capacity.profile._asdict() if capacity.profile else None,
        "ceilings_used": ceilings,
        "figures": figures,
        "decode": {},
        "prefill": {},
    }
    generator = torch.Generator().manual_seed(2)
    vocab = shape["vocab_size"] - 2
    lines = []
    for batch in sizes.decode_batches:
        steps = sizes.decode_steps
        params_ = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(random_prompt(generator, sizes.decode_prompt, vocab), params_) for _ in range(batch)]
        while any(engine.get_request(r).num_output_tokens == 0 for r in ids):  # type: ignore[union-attr]
            engine.step()
        for _ in range(2):
            engine.step()
        walls, device_times = [], []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
            device_times.append(engine.runner.last_device_s)
            assert engine.last_output is not None and engine.last_output.num_decode_tokens == batch
        context = sizes.decode_prompt + 3 + steps // 2
        nbytes = figures["streamed_weight_bytes"] + batch * context * figures["kv_bytes_per_token"]
        flops = 2 * figures["matmul_params"] * batch + batch * context * figures["attention_flops_per_key"]
        kernels = profile_step(engine, device) if batch == 16 else None
        for r in ids:
            engine.abort(r)
        entry = {
            "wall_ms": 1e3 * statistics.median(walls),
            "device_ms": 1e3 * statistics.median(device_times),
            "wall_ms_all": [round(1e3 * w, 3) for w in walls],
            **roofline(flops, nbytes, ceilings),
            "kernels_per_step": kernels,
        }
        entry["x_floor"] = entry["wall_ms"] / entry["floor_ms"]
        details["decode"][batch] = entry
        log(f"speed: decode at {batch}: {entry['wall_ms']:.2f} ms/step")
        lines.append(f"decode {batch}: {entry['wall_ms']:.1f} ms/step ({entry['x_floor']:.1f}x floor)")
    for chunk in sizes.prefill_chunks:
        walls, device_times = [], []
        kernels = None
        for rep in range(3):
            rid = engine.add_request(random_prompt(generator, chunk, vocab), SamplingParams(max_tokens=1))
            if rep == 2:
                kernels = profile_step(engine, device)
            else:
                started = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - started)
                device_times.append(engine.runner.last_device_s)
            assert engine.get_request(rid) is None, "the prompt did not fit one step"
        flops = 2 * figures["matmul_params"] * chunk + chunk * (chunk + 1) / 2 * figures["attention_flops_per_key"]
        entry = {
            "wall_ms": 1e3 * walls[-1],
            "device_ms": 1e3 * device_times[-1],
            "wall_ms_all": [round(1e3 * w, 3) for w in walls],
            **roofline(flops, figures["streamed_weight_bytes"], ceilings),
            "kernels": kernels,
        }
        if kernels and "names" in kernels:
            marks = ("flash", "fmha", "attention", "attn", "cudnn", "sdpa")
            entry["attention_kernels"] = [n for n in kernels["names"] if any(m in n.lower() for m in marks)]
            entry["flash_attention"] = any("flash" in n.lower() for n in entry["attention_kernels"])
        entry["x_floor"] = entry["wall_ms"] / entry["floor_ms"]
        details["prefill"][chunk] = entry
        lines.append(f"prefill {chunk}: {entry['wall_ms']:.1f} ms ({entry['x_floor']:.1f}x floor)")
    summary = f"{params / 1e9:.2f}B params, KV {details['kv_gib']:.1f} GiB; " + "; ".join(lines)
    return "INFO", summary, details


# ---- 5. token identity in bf16 ---------------------------------------------------------------------------------
def greedy_run(
    engine: Any, prompt: list[int], tokens: int, companions: list[list[int]], chunk: int | None
) -> tuple[list[int], list[Any]]:
    """The greedy tokens of ``prompt`` and each one's logits, beside ``companions`` (greedy, running longer),
    its prefill cut into ``chunk``-token pieces (None: the step budget)."""
    from pdserve.engine import SamplingParams

    saved = engine.scheduler.config
    engine.scheduler.config = saved._replace(max_chunk_tokens=chunk)
    try:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        others = [
            engine.add_request(p, SamplingParams(max_tokens=tokens + 16, temperature=0.0, ignore_eos=True))
            for p in companions
        ]
        got: list[int] = []
        logits: list[Any] = []
        deadline = time.monotonic() + 300
        while len(got) < tokens and time.monotonic() < deadline:
            for out in engine.step(keep_logits=True):
                if out.request_id == rid:
                    got += out.new_token_ids
                    logits.append(engine.last_logits[rid])
        for r in others:
            engine.abort(r)
        return got, logits
    finally:
        engine.scheduler.config = saved


def compare_runs(alone: tuple[list[int], list[Any]], other: tuple[list[int], list[Any]]) -> dict[str, Any]:
    tokens_a, logits_a = alone
    tokens_b, logits_b = other
    part = first_difference(tokens_a, tokens_b)
    upto = len(tokens_a) if part is None else part + 1
    noise = max(((logits_a[k] - logits_b[k]).abs().max().item() for k in range(min(upto, len(logits_b)))), default=0.0)
    gap = None
    if part is not None and part < len(tokens_b):
        row = logits_a[part]
        gap = abs(row[tokens_a[part]] - row[tokens_b[part]]).item()
    return {
        "identical": part is None,
        "first_difference": part,
        "logit_gap_at_difference": gap,
        "max_logit_difference_up_to_it": noise,
        "near_tie": part is None or (gap is not None and gap <= 2 * noise + 1e-6),
        "tokens": tokens_b,
    }


def check_identity(sizes: Sizes, state: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    import torch

    engine = state.get("engine")
    if engine is None:
        return "SKIP", "no model: the speed check did not load it", {}
    vocab = engine.model_config.vocab_size - 2
    generator = torch.Generator().manual_seed(3)
    prompt = random_prompt(generator, sizes.identity_prompt, vocab)
    companions = [
        random_prompt(generator, n, vocab)
        for n in torch.randint(16, sizes.identity_prompt, (sizes.identity_companions,), generator=generator).tolist()
    ]
    alone = greedy_run(engine, prompt, sizes.identity_tokens, [], None)
    chunk = sizes.identity_chunk
    runs = {
        "batched": greedy_run(engine, prompt, sizes.identity_tokens, companions, None),
        f"chunks_of_{chunk}": greedy_run(engine, prompt, sizes.identity_tokens, [], chunk),
    }
    details: dict[str, Any] = {"alone": alone[0]}
    parts = []
    for name, run in runs.items():
        d = details[name] = compare_runs(alone, run)
        if d["identical"]:
            parts.append(f"{name}: identical")
        else:
            gap = d["logit_gap_at_difference"]
            parts.append(
                f"{name}: part at token {d['first_difference']} (gap {gap if gap is None else round(gap, 4)}, "
                f"logits differ by up to {d['max_logit_difference_up_to_it']:.3g})"
            )
    status = "PASS" if all(d["near_tie"] for d in details.values() if isinstance(d, dict)) else "MISS"
    return status, "; ".join(parts), details


# ---- 6. transports between two processes -----------------------------------------------------------------------
def transfer_peer(role: str, kind: str, device_name: str, sizes: Sizes, conn: Any) -> None:
    """One end of a transfer, in its own process: a pool on ``device_name`` and a transport of ``kind``."""
    import torch

    from pdserve.kv_transfer import make_transport
    from pdserve.kv_transfer.base import block_checksums, pool_bytes_view

    transport = None
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a CUDA context on this thread before the agent brings up UCX
        pool = torch.zeros((sizes.transfer_blocks, *sizes.transfer_block_shape), dtype=torch.bfloat16, device=device)
        transport = make_transport(kind)
        transport.register_pool(pool, "gpu-check")
        if role == "receiver":
            conn.send(("target", transport.describe()))
            expected, timeout_s = conn.recv()
            notes: list[Any] = []
            deadline = time.monotonic() + timeout_s
            while len(notes) < expected and time.monotonic() < deadline:
                got = transport.poll_notifications()
                notes += got
                if not got:
                    time.sleep(0.0002)
            conn.send(("notes", notes))
            blocks = conn.recv()
            conn.send(("sums", block_checksums(pool, blocks), bool(pool[: sizes.transfer_blocks // 8].any())))
        else:
            view = pool_bytes_view(pool)
            generator = torch.Generator(device=device).manual_seed(7)
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, device=device, generator=generator))
            target, reps = conn.recv()
            seconds = []
            for pushes in reps:
                started = time.perf_counter()
                handles = [transport.push(target, src, dst, note) for src, dst, note in pushes]
                for handle in handles:
                    handle.wait(120.0)
                seconds.append(time.perf_counter() - started)
            sources = [b for src, _, _ in reps[0] for b in src]
            conn.send(("done", seconds, block_checksums(pool, sources)))
        conn.recv()  # stay until told: the other side may still be reading this pool
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()


def expect(conn: Any, what: str, timeout_s: float) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {what} from the peer process after {timeout_s:.0f} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"peer process failed:\n{message[1]}")
    if message[0] != what:
        raise RuntimeError(f"expected {what} from the peer process, got {message[0]}")
    return message[1:]


def transfer_between_processes(kind: str, sizes: Sizes) -> dict[str, Any]:
    from pdserve.kv_transfer import ChunkNotification

    spawn = multiprocessing.get_context("spawn")
    ends = {role: spawn.Pipe() for role in ("receiver", "sender")}
    processes = {
        role: spawn.Process(target=transfer_peer, args=(role, kind, sizes.device, sizes, ends[role][1]), daemon=True)
        for role in ends
    }
    for p in processes.values():
        p.start()
    receiver, sender = ends["receiver"][0], ends["sender"][0]
    try:
        (target,) = expect(receiver, "target", 120)
        n, per = sizes.transfer_pushes, sizes.transfer_push_blocks
        offset = sizes.transfer_blocks // 8  # the receiver's first blocks stay untouched: checked below
        reps = []
        for rep in range(sizes.transfer_reps):
            pushes = []
            for k in range(n):
                src = list(range(k * per, (k + 1) * per))
                dst = [offset + b for b in reversed(src)]  # scattered the other way round
                note = ChunkNotification(f"gpu-check-{rep}", k, (k + 1) * per * 16, k == n - 1)
                pushes.append((src, dst, note))
            reps.append(pushes)
        receiver.send((n * sizes.transfer_reps, 240.0))
        sender.send((target, reps))
        seconds, sums = expect(sender, "done", 300)
        (notes,) = expect(receiver, "notes", 300)
        destinations = [b for _, dst, _ in reps[0] for b in dst]
        receiver.send(destinations)
        received, touched = expect(receiver, "sums", 120)
        for end in (receiver, sender):
            end.send("close")
    finally:
        for p in processes.values():
            p.join(30)
            if p.is_alive():
                p.kill()
    block_bytes = 2 * math.prod(sizes.transfer_block_shape)
    pushed = n * per * block_bytes
    steady = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    exact = list(received) == list(sums) and not touched and len(notes) == n * sizes.transfer_reps
    return {
        "ok": exact,
        "bytes_per_rep": pushed,
        "block_bytes": block_bytes,
        "pushes_per_rep": n,
        "seconds": seconds,
        "GBps_first": pushed / seconds[0] / 1e9,
        "GBps": pushed / steady / 1e9,
        "checksums_equal": list(received) == list(sums),
        "blocks_outside_untouched": not touched,
        "notifications": len(notes),
    }


def check_transport(kind: str, sizes: Sizes) -> tuple[str, str, dict[str, Any]]:
    if kind == "nixl" and not importable("nixl"):
        return "SKIP", "nixl is not installed: carry its wheels (docs/development.md, The device check)", {}
    d = transfer_between_processes(kind, sizes)
    where = "VRAM to VRAM" if sizes.device == "cuda" else "DRAM to DRAM"
    summary = (
        f"{where}, {d['bytes_per_rep'] / 2**20:.0f} MiB in {d['pushes_per_rep']} pushes: {d['GBps']:.2f} GB/s "
        f"(first {d['GBps_first']:.2f}), bytes {'exact' if d['ok'] else 'WRONG'}"
    )
    return ("PASS" if d["ok"] else "FAIL"), summary, d


# ---- main ------------------------------------------------------------------------------------------------------
class ForbiddenImports(importlib.abc.MetaPathFinder):
    """Fails the import of the named top-level packages: a machine that lacks them, played on one that has them."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ImportError(f"{fullname} is not available here (--forbid-imports)")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.md and gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="dry run: every check on the CPU at toy sizes")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no check starts after this many seconds")
    parser.add_argument("--only", nargs="*", help="run only these checks (by name)")
    parser.add_argument(
        "--forbid-imports", default="", help="comma-separated packages whose import fails (play a bare machine)"
    )
    args = parser.parse_args(argv)
    if args.forbid_imports:
        sys.meta_path.insert(0, ForbiddenImports(set(args.forbid_imports.split(","))))
    sizes = CPU if args.cpu else GPU
    report = Report(Path(args.out), "CPU dry run" if args.cpu else "GPU")
    deadline = time.monotonic() + args.budget_s
    state: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-work-"))
    checks: list[tuple[str, Callable[[], tuple[str, str, dict[str, Any]]]]] = [
        ("environment", lambda: check_environment(sizes)),
        ("ceilings", lambda: check_ceilings(sizes)),
        ("parity", lambda: check_parity(sizes, workdir)),
        ("quantized", lambda: check_quantized(sizes, workdir)),
        ("speed", lambda: check_speed(sizes, report, state)),
        ("identity", lambda: check_identity(sizes, state)),
        ("release", lambda: release(state, sizes)),
        ("nixl", lambda: check_transport("nixl", sizes)),
        ("grpc", lambda: check_transport("grpc", sizes)),
    ]
    for name, fn in checks:
        if args.only and name not in args.only and name != "release":
            continue
        run_check(report, name, deadline, fn)
    release(state, sizes)
    print(f"report: {report.out / 'gpu_check.md'}", flush=True)
    return 1 if any(c.status == "FAIL" for c in report.checks) else 0


def release(state: dict[str, Any], sizes: Sizes) -> tuple[str, str, dict[str, Any]]:
    """Free the big model's GPU memory and its checkpoint before the transports need room."""
    import shutil

    import torch

    state.pop("engine", None)
    gc.collect()
    if sizes.device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    folder = state.pop("checkpoint", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    free = torch.cuda.mem_get_info()[0] / 2**30 if sizes.device == "cuda" and torch.cuda.is_available() else None
    return "INFO", "model and checkpoint released" + (f", {free:.0f} GiB free" if free else ""), {"free_gib": free}


if __name__ == "__main__":
    sys.exit(main())
