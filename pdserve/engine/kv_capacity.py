"""How many blocks an engine's KV pool holds.

``--num-kv-blocks`` gives the count and ``--kv-cache-memory-gb`` the size. Without either, a CPU engine takes
``CPU_KV_CACHE_MEMORY_GB`` and a CUDA engine what its share of the GPU leaves, as vLLM sizes it: the share is
``--gpu-memory-utilization`` of the GPU's memory, and from it go the weights (what torch holds once the model
is built) and the peak of one profiled step, the largest the scheduler can make (a full token budget at the
longest context, with as many sampled rows as requests allowed per step). The CUDA context and the kernel
images, outside torch's allocator, come out of the rest of the GPU. The pool never takes more than is free
once that step's peak is set aside, so workers that share a GPU each keep to their own share.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from pdserve.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig, ModelConfig
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache, kv_block_bytes, synchronize
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput

CPU_KV_CACHE_MEMORY_GB = 0.5
PROFILE_POOL_BLOCKS = 64  # the profiled step's block tables cycle over this many blocks of a temporary pool


class DeviceMemory(NamedTuple):
    """A device's memory in bytes, every process counted."""

    total: int
    free: int


class MemoryProfile(NamedTuple):
    """What an engine's process holds of its device, in bytes (``profile_memory``)."""

    weights: int  # torch's allocations once the model is built (weights, rotary tables)
    step_peak: int  # the most the profiled step allocated on top of them
    memory: DeviceMemory  # the device after the step, torch's cache emptied


class KVCapacity(NamedTuple):
    """The pool's size, and the profile it came from (None where the size was given or on a CPU)."""

    num_blocks: int
    kv_bytes: int
    profile: MemoryProfile | None = None


class MemoryMeter(Protocol):
    """A device's memory as torch's allocator and the driver see it (``CudaMemoryMeter``; tests fake it)."""

    def device_memory(self) -> DeviceMemory: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...

    def empty_cache(self) -> None: ...


class CudaMemoryMeter:
    """``MemoryMeter`` of one GPU: ``torch.cuda.mem_get_info`` and the caching allocator's statistics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def device_memory(self) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total, free)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def kv_bytes_for(profile: MemoryProfile, utilization: float) -> int:
    """The bytes a KV pool may take: the share less the weights and a step's peak, and never more than is
    free with that peak set aside (negative when nothing is left)."""
    share = int(profile.memory.total * utilization) - profile.weights - profile.step_peak
    return min(share, profile.memory.free - profile.step_peak)


def profile_step(budget: int, max_num_seqs: int, max_model_len: int, block_size: int) -> SchedulerOutput:
    """The largest step the scheduler can make: ``budget`` tokens, ``min(max_num_seqs, budget)`` of them
    sampling, every request at the longest context: one prompt chunk ending at ``max_model_len`` and the rest
    decodes there. Block tables cycle over ``PROFILE_POOL_BLOCKS`` blocks (the values read do not matter)."""
    sampled = min(max_num_seqs, budget)
    chunk = budget - (sampled - 1)
    context = max(max_model_len, chunk + 1)
    table = [b % PROFILE_POOL_BLOCKS for b in range(-(-context // block_size))]
    chunks = [ScheduledChunk("profile-0", [0] * chunk, context - chunk, table, True)]
    chunks += [ScheduledChunk(f"profile-{i}", [0], context - 1, table, True) for i in range(1, sampled)]
    return SchedulerOutput(chunks, [])


def profile_memory(
    model: LlamaForCausalLM,
    config: EngineConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    meter: MemoryMeter,
) -> MemoryProfile:
    """Run ``profile_step`` once through a ``ModelRunner`` over a temporary pool, sampling every row with
    top-k and top-p (the sampler's largest path), and measure. ``config`` has its model defaults."""
    assert config.max_num_batched_tokens is not None and config.max_model_len is not None
    weights = meter.allocated()
    pool = allocate_kv_cache(model_config, PROFILE_POOL_BLOCKS, config.block_size, kv_dtype, device)
    runner = ModelRunner(model, pool, config.block_size, device)
    step = profile_step(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, config.block_size)
    ids = [c.request_id for c in step.chunks]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    before = meter.allocated()
    meter.reset_peak()
    runner.run(step, dict.fromkeys(ids, params), dict.fromkeys(ids, 0), dict.fromkeys(ids, 0))
    synchronize(device)
    step_peak = max(0, meter.peak() - before)
    del runner, pool
    meter.empty_cache()
    return MemoryProfile(weights, step_peak, meter.device_memory())


def plan_kv_capacity(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    meter: MemoryMeter | None = None,
) -> KVCapacity:
    """The pool of an engine whose ``model`` is built (see the module docstring); ``config`` has its model
    defaults. ``meter`` defaults to the GPU's own on CUDA; given one, a CPU engine is sized the same way.

    Raises ValueError when the share leaves no room for the KV of one ``max_model_len`` request.
    """
    block_bytes = kv_block_bytes(model_config, config.block_size, kv_dtype)
    if config.num_kv_blocks is not None:
        return KVCapacity(config.num_kv_blocks, config.num_kv_blocks * block_bytes)
    if meter is None and device.type == "cuda" and config.kv_cache_memory_gb is None:
        meter = CudaMemoryMeter(device)
    if meter is None or config.kv_cache_memory_gb is not None:
        size_gb = config.kv_cache_memory_gb if config.kv_cache_memory_gb is not None else CPU_KV_CACHE_MEMORY_GB
        num_blocks = max(1, int(size_gb * 2**30) // block_bytes)
        return KVCapacity(num_blocks, num_blocks * block_bytes)
    utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    profile = profile_memory(model, config, model_config, kv_dtype, device, meter)
    kv_bytes = kv_bytes_for(profile, utilization)
    num_blocks = max(0, kv_bytes) // block_bytes
    assert config.max_model_len is not None
    if num_blocks * config.block_size < config.max_model_len:
        gib = 2**30
        raise ValueError(
            f"KV cache: --gpu-memory-utilization {utilization:g} of {profile.memory.total / gib:.1f} GiB, less "
            f"{profile.weights / gib:.2f} GiB of weights and a {profile.step_peak / gib:.2f} GiB step "
            f"({profile.memory.free / gib:.1f} GiB free on {device}), leaves {max(0, kv_bytes) / gib:.2f} GiB: "
            f"{num_blocks * config.block_size} tokens of KV, fewer than max_model_len {config.max_model_len}. "
            "Raise --gpu-memory-utilization, or lower --max-model-len or --max-num-batched-tokens"
        )
    return KVCapacity(num_blocks, num_blocks * block_bytes, profile)
