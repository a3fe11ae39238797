"""A request is two counters over one token list: ``num_computed_tokens`` and ``num_tokens``.

There is no prefill phase or decode phase. A step computes some of the tokens that are known but
not yet computed; chunked prefill is just computing fewer than all of them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import PromptLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's waiting queue (new, preempted, or remote KV arrived)
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, KV being pushed by a prefill worker
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class RequestTimes:
    """Wall-clock timestamps (``time.time()``) of a request's life inside one engine."""

    arrival: float = field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)  # one per output token
    finished: float | None = None


class Request:
    """One sequence: prompt + outputs, how much of it is computed, and the KV blocks that hold it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | Collection[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """``eos_token_id``: the stop token, or several (generation stops on any of them)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids: frozenset[int] = frozenset(
            () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
        )
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.num_registered_blocks = 0  # leading blocks known to be in the prefix cache's map (block manager)
        self.num_preemptions = 0
        self.times = RequestTimes() if arrival_time is None else RequestTimes(arrival=arrival_time)
        # with params.prompt_logprobs: one per prompt token after the first, filled in as its chunks are computed
        self.prompt_logprobs: list[PromptLogprob] | None = [] if params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether some prompt position's log-probabilities are still to compute: its prompt then takes no
        prefix-cache hit (a cached position computes no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )
