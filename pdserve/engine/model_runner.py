"""Turns a scheduler step into tensors, runs the model over the paged KV pool, samples tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.model import (
    FEW_ROWS,
    AttentionMetadata,
    DecodeGroup,
    LlamaForCausalLM,
    PrefillSpan,
    Workspace,
    layer_caches,
)
from pdserve.engine.sampler import TokenLogprobs, prompt_token_logprobs, sample, token_logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.messages import PromptLogprob
from pdserve.priority import OMP_SPIN_COUNT_ENV

DECODE_GROUP_SIZE = 16  # decodes attended per SDPA call (sorted by length, padded within the group)
PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are computed at once (a row is the vocabulary's size)


class PromptTargets(NamedTuple):
    """Which positions of a request's chunk need prompt log-probabilities: rows ``first`` onwards of the chunk,
    each predicting the next prompt token in ``tokens``, with the ``k`` most likely tokens."""

    first: int
    tokens: list[int]
    k: int


def kv_block_shape(config: ModelConfig, block_size: int) -> tuple[int, ...]:
    """One block holds K and V of ``block_size`` tokens for every layer, contiguously."""
    return (config.num_hidden_layers, 2, block_size, config.num_key_value_heads, config.head_dim)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in kv_block_shape(config, block_size):
        n *= d
    return n * torch.empty(0, dtype=dtype).element_size()


def kv_compatibility_key(
    model: str, seed: int | None, config: ModelConfig, dtype: torch.dtype, kv_cache: torch.Tensor
) -> str:
    """A key of what a KV pool's blocks mean: 16 hex digits of a SHA-256 over the model (its name, and
    ``seed`` for random weights), its architecture, the compute dtype, the pool's dtype and block layout.
    Two engines can take each other's KV blocks only under equal keys: equal block bytes alone would let a
    bfloat16 pool fill a float16 one, or one model's KV another's. The weight format is left out: machines
    that serve one GGUF file in formats of their own (``--quantization auto``) hold the same KV, to rounding."""
    fields = {
        "model": model,
        "seed": seed,
        "architecture": dataclasses.asdict(config),
        "dtype": str(dtype),
        "kv_dtype": str(kv_cache.dtype),
        "block_shape": list(kv_cache.shape[1:]),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The block-major pool: ``pool[b]`` is block ``b``, one contiguous region (one transfer descriptor)."""
    return torch.zeros((num_blocks, *kv_block_shape(config, block_size)), dtype=dtype, device=device)


def openmp_threads_spin(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's OpenMP threads (libgomp) wait for the next parallel region spinning, at least
    briefly, rather than going to sleep at once: ``GOMP_SPINCOUNT`` above 0 where it is set, else any
    ``OMP_WAIT_POLICY`` but ``PASSIVE`` (OpenMP's default spins for a few milliseconds)."""
    count = environ.get(OMP_SPIN_COUNT_ENV, "").strip().lower()
    if count in ("infinite", "infinity"):
        return True
    if count:
        with contextlib.suppress(ValueError):
            return float(count.rstrip("kmgt")) > 0
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


@contextlib.contextmanager
def step_threads(num_tokens: int, device: torch.device, threads_spin: bool = False) -> Iterator[None]:
    """Run a CPU step of at most ``FEW_ROWS`` tokens on one intra-op thread where OpenMP threads sleep between
    parallel regions (``threads_spin`` False), every other step on all of them.

    A step that small is a chain of a few hundred short kernels; where each parallel one has to wake the
    other threads first, splitting it costs more than it saves (a one-stream decode step runs faster on one
    thread under ``OMP_WAIT_POLICY=PASSIVE``), and one thread leaves the other cores to the router and the
    clients. Where threads spin between kernels (``GOMP_SPINCOUNT``) there is no wake-up to pay, and all
    threads are the faster."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or num_tokens > FEW_ROWS or threads_spin:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device; a no-op off CUDA (and for a bare ``cuda``).

    CUDA's current device is per thread and starts as GPU 0: anything that takes it implicitly (a pinned host
    allocation, an event, a UCX context probing for GPU memory) would otherwise act on GPU 0, or on no context
    at all, from a thread that has not used the engine's GPU yet (the engine loop's, a Ray actor's)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on the CPU, whose kernels are synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceTimer:
    """The device time of the work queued between ``start()`` and ``stop()``: CUDA events on a GPU (the host's
    clock would time the kernel launches, not the kernels), the host's clock on a CPU (synchronous kernels)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:  # on the device's own stream, whichever device is current on this thread
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start()``; on CUDA waits for the queued kernels to finish."""
        if not self.cuda:
            return time.perf_counter() - self._t0
        self._end.record(torch.cuda.current_stream(self.device))
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class StepResult:
    """Sampled tokens for the chunks that sample, keyed by request id; logits when asked for."""

    __slots__ = ("logits", "logprobs", "prompt_logprobs", "tokens")

    def __init__(
        self,
        tokens: dict[str, int],
        logits: dict[str, torch.Tensor] | None,
        logprobs: dict[str, TokenLogprobs] | None = None,
        prompt_logprobs: dict[str, list[PromptLogprob]] | None = None,
    ) -> None:
        self.tokens = tokens
        self.logits = logits
        self.logprobs = logprobs or {}  # for the requests that asked (SamplingParams.logprobs)
        self.prompt_logprobs = prompt_logprobs or {}  # for the chunks of ``run``'s ``prompt_targets``


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.workspace = Workspace()
        self.layer_caches = layer_caches(kv_cache)
        self.inputs = InputBuffer(device)
        self.timer = DeviceTimer(device)
        self.last_device_s = 0.0  # the device time of the last ``run``
        # CPU only: boolean masks, attended in pieces as ``attention_width`` says, for bitwise invariance.
        # Elsewhere a chunk attends over exactly its keys under the kernel's own causal mask (flash on CUDA).
        self.masked_attention = device.type == "cpu"

    @torch.inference_mode()
    def run(
        self,
        output: SchedulerOutput,
        params: dict[str, SamplingParams],
        seeds: dict[str, int],
        output_index: dict[str, int],
        keep_logits: bool = False,
        prompt_targets: Mapping[str, PromptTargets] | None = None,
    ) -> StepResult:
        """Compute every scheduled chunk; sample for chunks that reach their request's last token.

        ``output_index[rid]`` is the index of the output token being sampled (the draw's seed input).
        ``prompt_targets[rid]``: the chunk's positions whose prompt log-probabilities to compute as well.
        """
        input_ids, positions, meta = self._prepare(output)
        self.timer.start()
        hidden = self.model(input_ids, positions, meta)
        prompt_lps = self._prompt_logprobs(output, hidden, prompt_targets) if prompt_targets else None
        sampling = [c for c in output.chunks if c.samples]
        if not sampling:
            # nothing sampled means nothing waited for the kernels: the KV they write may be pushed next
            self.last_device_s = self.timer.stop()
            synchronize(hidden.device)
            return StepResult({}, {} if keep_logits else None, None, prompt_lps)
        last_index, flat = [], 0
        for chunk in output.chunks:
            flat += len(chunk.token_ids)
            if chunk.samples:
                last_index.append(flat - 1)
        logits = self.model.logits(hidden[torch.tensor(last_index, device=self.device)])
        ids = [c.request_id for c in sampling]
        tokens = sample(logits, [params[r] for r in ids], [seeds[r] for r in ids], [output_index[r] for r in ids])
        self.last_device_s = self.timer.stop()
        kept = {r: logits[i].cpu() for i, r in enumerate(ids)} if keep_logits else None
        logprobs = _logprobs(logits, ids, tokens, params)
        return StepResult(dict(zip(ids, tokens, strict=True)), kept, logprobs, prompt_lps)

    def _prompt_logprobs(
        self, output: SchedulerOutput, hidden: torch.Tensor, targets: Mapping[str, PromptTargets]
    ) -> dict[str, list[PromptLogprob]]:
        """Log-probabilities of the prompt tokens that the chunks in ``targets`` predict, computed from their
        rows' logits a slice of ``PROMPT_LOGITS_ROWS`` at a time (a row is a vocabulary of float32)."""
        out: dict[str, list[PromptLogprob]] = {}
        flat = 0
        for chunk in output.chunks:
            want = targets.get(chunk.request_id)
            if want is not None:
                picked: list[PromptLogprob] = []
                for lo in range(0, len(want.tokens), PROMPT_LOGITS_ROWS):
                    tokens = want.tokens[lo : lo + PROMPT_LOGITS_ROWS]
                    start = flat + want.first + lo
                    logits = self.model.logits(hidden[start : start + len(tokens)])
                    picked += prompt_token_logprobs(logits, tokens, want.k)
                out[chunk.request_id] = picked
            flat += len(chunk.token_ids)
        return out

    @torch.inference_mode()
    def prompt_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (tests compare them against a reference model)."""
        input_ids, positions, meta = self._prepare(output)
        return self.model.logits(self.model(input_ids, positions, meta)[: meta.slot_rows.numel()])

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        block_rows = self.kv_cache.shape[1] * 2 * bs  # rows of one block in pool_rows(kv_cache)
        ids: list[int] = []
        pos: list[int] = []
        slot_rows: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []  # (flat index, context length, blocks)
        prefills: list[tuple[int, int, int, list[int]]] = []  # (lo, hi, start, blocks)
        for chunk in output.chunks:
            lo, n = len(ids), len(chunk.token_ids)
            end = chunk.start + n
            ids.extend(chunk.token_ids)
            pos.extend(range(chunk.start, end))
            slot_rows.extend(chunk.block_ids[p // bs] * block_rows + p % bs for p in range(chunk.start, end))
            blocks = chunk.block_ids[: -(-end // bs)]
            if n == 1 and chunk.start > 0:
                decodes.append((lo, end, blocks))
            else:
                prefills.append((lo, lo + n, chunk.start, blocks))
        decodes.sort(key=lambda d: d[1])
        groups = [decodes[g : g + DECODE_GROUP_SIZE] for g in range(0, len(decodes), DECODE_GROUP_SIZE)]
        widths = [max(len(blocks) for _, _, blocks in part) for part in groups]

        padding = self.model.batch_rows(len(ids)) - len(ids)  # rows computed and dropped (batch_rows)
        lists = [ids + [0] * padding, pos + [0] * padding, slot_rows]
        lists += [blocks for *_, blocks in prefills]
        for part, width in zip(groups, widths, strict=True):
            lists.append([i for i, _, _ in part])
            lists.append([b for _, _, blocks in part for b in blocks + [0] * (width - len(blocks))])
            lists.append([length for _, length, _ in part])
        tensors = iter(self.inputs.upload(lists))
        input_ids, positions, slot_row_t = (next(tensors) for _ in range(3))
        spans = []
        group = self.model.config.num_attention_heads // self.model.config.num_key_value_heads
        for lo, hi, start, blocks in prefills:  # one mask per chunk, for every layer
            block_ids = next(tensors)
            if not self.masked_attention:
                spans.append(PrefillSpan(lo, hi, start, block_ids, None))
                continue
            key_pos = torch.arange(len(blocks) * self.block_size, device=self.device)
            visible = key_pos <= torch.arange(start, start + hi - lo, device=self.device)[:, None]
            spans.append(PrefillSpan(lo, hi, start, block_ids, visible.repeat(group, 1)))
        decode_groups = []
        for part, width in zip(groups, widths, strict=True):
            index, flat, lens = next(tensors), next(tensors), next(tensors)
            key_pos = torch.arange(width * self.block_size, device=self.device)
            mask = (key_pos.unsqueeze(0) < lens.unsqueeze(1)).view(len(part), 1, 1, -1)
            decode_groups.append(DecodeGroup(index, flat, mask))
        meta = AttentionMetadata(slot_row_t, decode_groups, spans, self.workspace, self.layer_caches)
        return input_ids, positions, meta


class InputBuffer:
    """A step's integer inputs (token ids, positions, slots, block tables) as one tensor, ``upload`` returning
    a view per list. On CUDA they pass through one persistent pinned host buffer (on the engine's device) in
    one asynchronous copy; the next upload rewrites the buffer only once that copy has been read (an event
    recorded after it), whether or not the caller waited for the step's results (``prompt_logits`` does not)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.long)
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy out of ``_host``

    def upload(self, lists: list[list[int]]) -> list[torch.Tensor]:
        sizes = [len(values) for values in lists]
        flat = torch.tensor([v for values in lists for v in values], dtype=torch.long)
        if self.device.type == "cpu":  # the tensor itself: one allocation for the step's inputs
            return list(flat.split(sizes))
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < flat.numel():
            with torch.cuda.device(self.device):  # pinned through this device's context, not GPU 0's
                self._host = torch.empty(max(flat.numel(), 2 * self._host.numel()), dtype=torch.long, pin_memory=True)
        host = self._host[: flat.numel()]
        host.copy_(flat)
        uploaded = host.to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return list(uploaded.split(sizes))


def _logprobs(
    logits: torch.Tensor, ids: list[str], tokens: list[int], params: dict[str, SamplingParams]
) -> dict[str, TokenLogprobs] | None:
    """Log-probabilities of the rows whose requests asked for them (none computed otherwise)."""
    rows = [i for i, r in enumerate(ids) if params[r].logprobs is not None]
    if not rows:
        return None
    picked = token_logprobs(logits[rows], [tokens[i] for i in rows], [params[ids[i]].logprobs or 0 for i in rows])
    return {ids[i]: lp for i, lp in zip(rows, picked, strict=True)}


def gather_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The K/V of a request's first ``num_tokens`` tokens: [layers, 2, num_tokens, kv_heads, head_dim]."""
    blocks = kv_cache[torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)]
    layers, _, _, heads, dim = blocks.shape[1:]
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, -1, heads, dim)[:, :, :num_tokens].cpu()
