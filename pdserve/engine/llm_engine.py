"""The step loop: schedule, run the model, update the requests, emit their outputs. Single process, single device."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.engine import loader, remote_kv
from pdserve.engine.block_manager import BlockManager, BlockUsage
from pdserve.engine.config import PRESETS, EngineConfig, ModelConfig
from pdserve.engine.loader import quantized_checkpoint, resolve_device, resolve_dtype, resolve_quantization
from pdserve.engine.model_runner import (
    ModelRunner,
    StepResult,
    allocate_kv_cache,
    kv_compatibility_key,
    openmp_threads_spin,
    step_threads,
)
from pdserve.engine.pace_probe import PaceProbe
from pdserve.engine.request import FinishReason, Request, RequestStatus, RequestTimes
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, TokenUpdate
from pdserve.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from pdserve.messages import StepStats

log = logging.getLogger(__name__)


class RequestOutput(NamedTuple):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None = None  # per new token, when the request asked for them


class Completion(NamedTuple):
    """A finished request, as ``generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    num_cached_tokens: int
    times: RequestTimes


class Reservation(NamedTuple):
    """Blocks set aside on this engine for a prompt whose KV another worker computes."""

    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens already in this engine's prefix cache


class EngineStats(NamedTuple):
    blocks: BlockUsage
    num_running: int
    num_waiting: int
    num_remote_pending: int
    num_held: int
    tokens_in_flight: int


__all__ = [  # the loader's choices, named here as before
    "Completion",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "Reservation",
    "quantized_checkpoint",
    "resolve_device",
    "resolve_dtype",
    "resolve_quantization",
]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.load(config.model)
        self.config = config.with_model_defaults(self.model_config)
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.threads_spin = openmp_threads_spin()  # small CPU steps then run on every thread
        self.tokenizer = load_tokenizer(self.config.model, self.model_config.eos_token_ids or None)
        self.eos_token_ids = self.model_config.eos_token_ids
        if not self.eos_token_ids and self.tokenizer is not None:
            self.eos_token_ids = self.tokenizer.eos_token_ids
        loaded = loader.load(self.config, self.model_config)
        self.device, self.quantization, self.dtype = loaded.device, loaded.quantization, loaded.dtype
        self.quantized = loaded.quantization == "native"
        self.kv_cache_dtype = loaded.kv_cache_dtype
        self.kv_capacity = loaded.kv_capacity
        model = loaded.model

        block_size, num_blocks = self.config.block_size, loaded.kv_capacity.num_blocks
        self.kv_cache = allocate_kv_cache(self.model_config, num_blocks, block_size, self.kv_cache_dtype, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        budget, max_model_len = self.config.max_num_batched_tokens, self.config.max_model_len
        assert budget is not None and max_model_len is not None  # with_model_defaults sets both
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
                max_chunk_tokens=self.config.max_chunk_tokens,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(model, self.kv_cache, block_size, self.device)
        self._seed_source = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._seeds: dict[str, int] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.held: dict[str, Request] = {}  # finished, blocks kept until release() (KV being pushed)
        self._hold: set[str] = set()
        self.step_history: deque[StepStats] = deque(maxlen=100_000)
        self.pace_probe = PaceProbe(self.config.pace_probe_interval_s)
        self.last_output: SchedulerOutput | None = None
        self.last_logits: dict[str, torch.Tensor] | None = None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        hold_blocks: bool = False,
        detokenize: bool = True,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError, changing nothing, on bad input.

        ``hold_blocks``: when it finishes, keep its KV blocks until ``release(request_id)``.
        ``detokenize=False``: outputs carry no text (a router that detokenizes itself asks for this).
        """
        request = self._make_request(prompt, params, request_id, arrival_time, detokenize)
        self.scheduler.add(request)
        if hold_blocks:
            self._hold.add(request.request_id)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False when the id is unknown."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return self.release(request_id)
        self.scheduler.finish(request, FinishReason.ABORT)
        self._forget(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished request that was added with ``hold_blocks``."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.block_manager.free(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """True when a step would compute something (remote-pending requests wait for their KV)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- remote KV (the decode side of disaggregation) -----------------------------------------
    def reserve_remote(self, prompt: list[int], params: SamplingParams, request_id: str) -> Reservation | None:
        """Allocate blocks for a prompt whose KV will be written into them by another worker.

        Leading full blocks found in the prefix cache are shared and need no transfer. Returns None,
        changing nothing, when there are not enough free blocks now.
        """
        request = self._make_request(prompt, params, request_id, None, detokenize=False)
        num_cached = remote_kv.reserve_remote_blocks(self.scheduler, request, time.time())
        if num_cached is None:
            self._forget(request_id)
            return None
        return Reservation(list(request.block_ids), num_cached)

    def admit_remote(self, request_id: str, first_token: int) -> RequestOutput | None:
        """All of the prompt's KV has arrived: decode from here. The first token is not re-emitted.

        Returns the request's final output when the first token already ends it, else None.
        """
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        reason = remote_kv.admit_remote(self.scheduler, request, first_token, time.time(), self._max_model_len)
        if reason is not None:
            self._forget(request_id)
            return RequestOutput(request_id, [], "", True, reason)
        return None

    # ---- the step ------------------------------------------------------------------------------
    def step(self, keep_logits: bool = False) -> list[RequestOutput]:
        """One step: schedule, run the model, update the requests (the scheduler applies the tokens and its stop
        rule), emit an output per request that got a token or finished."""
        # the wall-clock start first: were another thread to take the interpreter between the two reads, the
        # recorded end (start + duration) falls early, never after the outputs it returns
        started = time.time()
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.last_output = output
        if not output.chunks:
            return []
        result = self._run(output, keep_logits)
        updates = self.scheduler.update_from_output(output, result.tokens, time.time(), keep_blocks=self._hold)
        outputs = self._emit(updates, result)
        self.step_history.append(
            StepStats(
                started,
                time.perf_counter() - t0,
                t1 - t0,
                output.num_prefill_tokens,
                output.num_decode_tokens,
                len(output.chunks),
                len(output.preempted),
                output.num_context_tokens,
                output.num_decode_context_tokens,
                output.num_kv_read_tokens,
                device_s=self.runner.last_device_s,
                cpu_s=time.thread_time() - cpu0,
                step_index=self.scheduler.num_steps - 1,
                pace_s=self.pace_probe.last_s,
            )
        )
        # after the step, outside its clocks: a call that arrives meanwhile is taken in before the next step,
        # as after any step (the loop's gap between two steps holds the probe)
        self.pace_probe.maybe_probe()
        return outputs

    def _run(self, output: SchedulerOutput, keep_logits: bool) -> StepResult:
        """The model over the scheduled chunks; tokens sampled for those that reach their last token."""
        requests = [self.scheduler.requests[c.request_id] for c in output.chunks]
        params = {r.request_id: r.params for r in requests}
        seeds = {r.request_id: self._seeds[r.request_id] for r in requests}
        output_index = {r.request_id: r.num_output_tokens for r in requests}
        with step_threads(output.num_prefill_tokens + output.num_decode_tokens, self.device, self.threads_spin):
            result = self.runner.run(output, params, seeds, output_index, keep_logits)
        self.last_logits = result.logits
        return result

    def _emit(self, updates: list[TokenUpdate], result: StepResult) -> list[RequestOutput]:
        """One output per appended token, with its text; finished requests are forgotten (and held, when
        added with ``hold_blocks``, until ``release``)."""
        outputs = []
        for request, token, reason in updates:
            rid = request.request_id
            detok = self._detokenizers.get(rid)
            text = detok.push([token]) if detok is not None else ""
            if reason is not None:
                text += detok.flush() if detok is not None else ""
                if rid in self._hold:
                    self.held[rid] = request
                self._forget(rid)
            lp = result.logprobs.get(rid)
            outputs.append(RequestOutput(rid, [token], text, reason is not None, reason, None if lp is None else [lp]))
        return outputs

    def generate(
        self, prompts: Sequence[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run prompts to completion (alongside anything already queued); one Completion per prompt."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        requests: list[Request] = []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                requests.append(self._make_request(prompt, sp, None, None))
        except ValueError:
            for request in requests:
                self._forget(request.request_id)
            raise
        for request in requests:
            self.scheduler.add(request)
        pending = {r.request_id for r in requests}
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        while pending:
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.new_text)
                if out.finished:
                    pending.discard(out.request_id)
        return [
            Completion(
                r.request_id,
                r.prompt_token_ids,
                r.output_token_ids,
                "".join(texts[r.request_id]) if self.tokenizer else None,
                r.finish_reason or FinishReason.ABORT,  # every request here has finished: never the fallback
                r.num_cached_tokens,
                r.times,
            )
            for r in requests
        ]

    def stats(self) -> EngineStats:
        s = self.scheduler
        in_flight = sum(r.num_tokens for r in s.requests.values())
        remote = sum(1 for r in s.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KV)
        return EngineStats(
            self.block_manager.usage(), len(s.running), len(s.waiting), remote, len(self.held), in_flight
        )

    @property
    def kv_compatibility(self) -> str:
        """The key of what this engine's KV blocks mean (``model_runner.kv_compatibility_key``): a transfer
        peer's pool must carry the same one."""
        seed = self.config.seed if self.config.model in PRESETS else None
        return kv_compatibility_key(self.config.model, seed, self.model_config, self.dtype, self.kv_cache)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id) or self.held.get(request_id)

    # ---- internals -----------------------------------------------------------------------------
    def _make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        arrival_time: float | None,
        detokenize: bool = True,
    ) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab}), got {bad[:5]!r}")
        max_len = self.config.max_model_len
        assert max_len is not None
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leaves no room to generate within max_model_len={max_len}"
            )
        pool = f"{self.block_manager.num_blocks} blocks of {self.config.block_size} tokens"
        if self.block_manager.blocks_needed(len(token_ids) + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt: {len(token_ids)} tokens need more KV blocks than this engine has ({pool})")
        longest = min(len(token_ids) + params.max_tokens, max_len)
        if self.block_manager.blocks_needed(longest) > self.block_manager.num_blocks:
            room = self.block_manager.num_blocks * self.config.block_size - len(token_ids)
            raise ValueError(  # it could never be scheduled again once it outgrew the pool
                f"max_tokens: {len(token_ids)} prompt tokens + {params.max_tokens} need more KV blocks than this "
                f"engine has ({pool}); at most {room}"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.scheduler.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, self.eos_token_ids, arrival_time)
        self._seeds[request_id] = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        if self.tokenizer is not None and detokenize:
            self._detokenizers[request_id] = self.tokenizer.detokenizer()
        return request

    @property
    def _max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]  # set by with_model_defaults

    def _forget(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        self._hold.discard(request_id)
