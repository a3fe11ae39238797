"""What the engine does differently on CUDA, tested on a CPU: the thread-to-GPU binding, the KV pool sized from
the GPU's memory (with a faked memory figure), the weight formats chosen for a CUDA device, the attention over
exact spans under the kernel's causal mask, and the key that KV transfer peers must share."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from support.prompt_logits import engine_prompt_logits

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.config import ModelConfig, gguf_file, shared_gpu_memory_utilization
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.gguf import open_gguf
from pdserve.engine.kv_capacity import (
    CPU_KV_CACHE_MEMORY_GB,
    DeviceMemory,
    KVCapacity,
    plan_kv_capacity,
    profile_step,
)
from pdserve.engine.llm_engine import resolve_device, resolve_quantization
from pdserve.engine.model_runner import kv_block_bytes, use_device
from pdserve.engine.quantization import INT4_KINDS, INT8_KINDS, Int4Linear, native_weight_kinds
from pdserve.engine.weights import build_model
from pdserve.kv_transfer import ChunkNotification, make_transport

CPU = torch.device("cpu")
GiB = 2**30


# ---- every thread of an engine on its own GPU ----------------------------------------------------------------
@pytest.fixture
def set_device_calls(monkeypatch) -> list[tuple[str, torch.device]]:
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    return calls


def test_use_device_binds_the_thread_to_a_numbered_gpu_only(set_device_calls, monkeypatch):
    use_device(torch.device("cuda", 1))
    use_device(CPU)
    use_device(torch.device("cuda"))  # no index: whatever GPU is current stays current
    assert set_device_calls == [(threading.current_thread().name, torch.device("cuda", 1))]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)  # so that the engine's threads name the same GPU
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cpu") == CPU


def test_the_engine_loop_thread_binds_to_the_engines_gpu(set_device_calls):
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=16, max_model_len=256))
    engine.device = torch.device("cuda", 2)  # what it would be on GPU 2; with no work it never steps
    loop = EngineLoop(engine, name="loop-under-test")
    try:
        deadline = time.monotonic() + 10
        while not set_device_calls and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert set_device_calls == [("loop-under-test", torch.device("cuda", 2))]


# ---- the KV pool from the GPU's memory ------------------------------------------------------------------------
class FakeMeter:
    """A GPU of ``total`` bytes, ``free`` of them free after the profile, on which the model's weights take
    ``weights`` bytes and a step ``step`` more; counts the profiled steps."""

    def __init__(self, total: int, free: int, weights: int, step: int) -> None:
        self.total, self.free, self.weights, self.step = total, free, weights, step
        self.resets = 0

    def device_memory(self) -> DeviceMemory:
        return DeviceMemory(self.total, self.free)

    def allocated(self) -> int:
        return self.weights

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return self.weights + self.step

    def empty_cache(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny():
    model_config = ModelConfig.preset("tiny")
    model = build_model("tiny", model_config, torch.float32, CPU)
    return model_config, model


def _plan(tiny, meter: FakeMeter | None, **overrides) -> KVCapacity:
    model_config, model = tiny
    config = EngineConfig(model="tiny", device="cpu", **overrides).with_model_defaults(model_config)
    return plan_kv_capacity(config, model, model_config, torch.bfloat16, CPU, meter)


@pytest.mark.slow
def test_the_kv_pool_takes_what_the_gpus_share_leaves_after_weights_and_a_step(tiny):
    block_bytes = kv_block_bytes(tiny[0], 16, torch.bfloat16)
    h200 = FakeMeter(total=140 * GiB, free=120 * GiB, weights=16 * GiB, step=2 * GiB)
    capacity = _plan(tiny, h200)
    assert h200.resets == 1  # one profiled step ran, through the model
    assert capacity.num_blocks == int(140 * GiB * 0.9 - 18 * GiB) // block_bytes
    assert capacity.profile is not None and capacity.profile.step_peak == 2 * GiB
    half = _plan(tiny, h200, gpu_memory_utilization=0.5)
    assert half.num_blocks == int(70 * GiB - 18 * GiB) // block_bytes
    crowded = FakeMeter(total=140 * GiB, free=30 * GiB, weights=16 * GiB, step=2 * GiB)  # others hold the rest
    assert _plan(tiny, crowded).num_blocks == 28 * GiB // block_bytes
    full = FakeMeter(total=20 * GiB, free=4 * GiB, weights=16 * GiB, step=2 * GiB)  # 18 GiB share, all taken
    with pytest.raises(ValueError, match=r"fewer than max_model_len 4096\. Raise --gpu-memory-utilization"):
        _plan(tiny, full)


def test_a_size_given_wins_and_a_cpu_keeps_its_own(tiny):
    h200 = FakeMeter(total=140 * GiB, free=120 * GiB, weights=16 * GiB, step=2 * GiB)
    block_bytes = kv_block_bytes(tiny[0], 16, torch.bfloat16)
    assert _plan(tiny, h200, num_kv_blocks=100) == KVCapacity(100, 100 * block_bytes)
    assert _plan(tiny, h200, kv_cache_memory_gb=2.0).num_blocks == 2 * GiB // block_bytes
    assert h200.resets == 0  # neither profiled a step
    assert _plan(tiny, None).num_blocks == int(CPU_KV_CACHE_MEMORY_GB * GiB) // block_bytes
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_dtype="bfloat16"))
    assert engine.block_manager.num_blocks == int(CPU_KV_CACHE_MEMORY_GB * GiB) // block_bytes
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)


def test_the_profiled_step_is_the_largest_the_scheduler_can_make():
    step = profile_step(budget=512, max_num_seqs=128, max_model_len=4096, block_size=16)
    assert step.num_tokens == 512 and len(step.chunks) == 128 and all(c.samples for c in step.chunks)
    assert len(step.chunks[0].token_ids) == 385 and step.chunks[0].start == 4096 - 385
    assert all(c.start + len(c.token_ids) == 4096 and len(c.block_ids) == 256 for c in step.chunks)
    assert len(profile_step(64, 128, 100, 16).chunks) == 64  # no more sampled rows than tokens


def test_workers_sharing_a_gpu_split_its_memory():
    assert shared_gpu_memory_utilization(1.0) == pytest.approx(0.9)
    assert shared_gpu_memory_utilization(0.25) == pytest.approx(0.225)
    assert shared_gpu_memory_utilization(0.4) == pytest.approx(0.45)  # Ray puts two on a GPU, not 2.5


# ---- quantized checkpoints on CUDA ----------------------------------------------------------------------------
CUDA = torch.device("cuda")
H200, T4 = (9, 0), (7, 5)


def test_on_cuda_only_q4_stays_quantized_and_only_where_the_int4_kernel_runs():
    assert native_weight_kinds(CPU, torch.float32) == (INT4_KINDS | INT8_KINDS, "")
    kept = native_weight_kinds(CUDA, torch.bfloat16, H200, "2.11.0+cu130")
    assert kept.kinds == INT4_KINDS and "Q8_0" in kept.why_not
    for dtype, capability, version, why in (
        (torch.float16, H200, "2.11.0", "takes bfloat16 activations, not float16"),
        (torch.bfloat16, H200, "2.4.1", "needs torch 2.5 or later"),
        (torch.bfloat16, T4, "2.11.0", "needs compute capability 8.0"),
    ):
        kept = native_weight_kinds(CUDA, dtype, capability, version)
        assert kept.kinds == frozenset() and why in kept.why_not and "Q8_0" in kept.why_not


def test_a_torch_without_the_weight_only_kernels_dequantises_those_kinds(monkeypatch):
    """``pyproject.toml`` admits torch 2.4, which lacks the CPU int4 kernel and has an older CUDA one."""
    assert native_weight_kinds(CPU, torch.float32).kinds == INT4_KINDS | INT8_KINDS  # this torch has both
    old_torch_ops = SimpleNamespace(_weight_int8pack_mm=torch.ops.aten._weight_int8pack_mm)
    monkeypatch.setattr(torch.ops, "aten", old_torch_ops)
    kept = native_weight_kinds(CPU, torch.float32)
    assert kept == (INT8_KINDS, "Q4_0/Q4_1: this torch has no _weight_int4pack_mm_for_cpu")
    assert native_weight_kinds(CUDA, torch.bfloat16, H200, "2.11.0").kinds == frozenset()


def test_the_quantization_asked_of_a_cuda_device_dequantises_what_no_good_kernel_takes(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.llm_engine"):
        picked, checkpoint = resolve_quantization("auto", "smollm2", CUDA)
    assert picked == "native" and checkpoint is not None  # its Q4_1 matrices; its Q8_0 embedding dequantised
    assert "Q8_0 weights dequantised to bfloat16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.llm_engine"):
        assert resolve_quantization("native", "smollm2", CUDA, "float16") == ("none", None)
    assert "Q4_1, Q8_0 weights dequantised to float16 (Q4: torch's CUDA int4 GEMM takes bfloat16" in caplog.text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: T4)
    assert resolve_quantization("auto", "smollm2", CUDA) == ("none", None)


def test_blocks_of_kinds_not_kept_are_dequantised_where_they_load():
    """The CUDA choice for SmolLM2's file (Q4_1 matrices, a tied Q8_0 embedding), built on a CPU."""
    config = ModelConfig.load("smollm2")
    checkpoint = open_gguf(gguf_file("smollm2"))  # type: ignore[arg-type]
    model = build_model(
        "smollm2",
        config,
        torch.float32,
        CPU,
        quantized=checkpoint,
        kernel_dtype=torch.bfloat16,
        native_kinds=INT4_KINDS,
    )
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_proj, Int4Linear) and isinstance(layer.self_attn.o_proj, Int4Linear)
    embedding = model.model.embed_tokens
    assert type(embedding) is torch.nn.Embedding and model.lm_head.weight is embedding.weight  # still tied
    [table] = [t for t in checkpoint.tensors if t.hf_name == "model.embed_tokens.weight"]
    assert table.kind == "Q8_0" and torch.equal(embedding.weight, torch.from_numpy(table.dequantize()))


# ---- attention over exact spans -------------------------------------------------------------------------------
def _tiny_engine(pad: bool, **overrides) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(model="tiny", device="cpu", num_kv_blocks=256, max_num_batched_tokens=96, **overrides)
    )
    engine.runner.masked_attention = pad
    return engine


def test_off_the_cpu_a_chunk_attends_over_exactly_its_keys_under_the_kernels_causal_mask():
    prompt = torch.randint(0, 250, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    exact, padded = _tiny_engine(pad=False), _tiny_engine(pad=True)
    step = exact.scheduler.schedule
    exact.add_request(prompt[:300], SamplingParams(max_tokens=1))
    output = step()
    _, _, meta = exact.runner._prepare(output)
    [span] = meta.prefills
    assert span.mask is None and span.block_ids.numel() == 6  # 96 tokens: 6 blocks, not rounded up
    exact.abort(output.chunks[0].request_id)
    # chunks of 96 tokens at starts 0, 96, ... 672: each attends its request's keys so far, lower-right causal
    ours, reference = engine_prompt_logits(exact, prompt), engine_prompt_logits(padded, prompt)
    assert ours.shape == reference.shape == (700, ModelConfig.preset("tiny").vocab_size)
    assert (ours - reference).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_exact_spans_decode_the_same_greedy_tokens_in_a_batch():
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 230, 600)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    exact = [c.token_ids for c in _tiny_engine(pad=False).generate(prompts, greedy)]
    padded = [c.token_ids for c in _tiny_engine(pad=True).generate(prompts, greedy)]
    assert exact == padded


# ---- the key KV peers share -----------------------------------------------------------------------------------
def test_engines_whose_blocks_mean_something_else_have_other_keys_and_cannot_push():
    def engine(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=16, **overrides))

    bf16 = engine(dtype="bfloat16")
    assert bf16.kv_compatibility == engine(dtype="bfloat16").kv_compatibility
    fp16 = engine(dtype="float16")  # the same block bytes: only the key tells them apart
    assert fp16.kv_cache.shape == bf16.kv_cache.shape and fp16.kv_cache.dtype != bf16.kv_cache.dtype
    others = [fp16, engine(dtype="bfloat16", seed=1), engine(dtype="bfloat16", block_size=32)]
    others.append(engine(dtype="bfloat16", kv_cache_dtype="float32"))
    keys = {bf16.kv_compatibility, *(e.kv_compatibility for e in others)}
    assert len(keys) == 5 and all(len(k) == 16 for k in keys)

    note = ChunkNotification("req-1", 0, 16, True)
    for receiver_engine, refused in ((fp16, True), (engine(dtype="bfloat16"), False)):
        sender, receiver = make_transport("grpc"), make_transport("grpc")
        try:
            sender.register_pool(bf16.kv_cache, bf16.kv_compatibility)
            receiver.register_pool(receiver_engine.kv_cache, receiver_engine.kv_compatibility)
            target = receiver.describe()
            assert target.kv_compatibility == receiver_engine.kv_compatibility
            bf16.kv_cache[3].fill_(1.5)
            if refused:
                with pytest.raises(ValueError, match="KV compatibility mismatch"):
                    sender.push(target, [3], [5], note)
                assert not receiver_engine.kv_cache[5].any() and receiver.poll_notifications() == []
            else:
                sender.push(target, [3], [5], note).wait(10.0)
                assert torch.equal(receiver_engine.kv_cache[5], bf16.kv_cache[3])
        finally:
            sender.close()
            receiver.close()
