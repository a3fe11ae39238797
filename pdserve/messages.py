"""Typed messages that cross a boundary: engine → node → router → client, and into the benchmarks.

Plain NamedTuples (cheap to build, pickle through Ray, compare in tests), converted to protobuf only at
the gRPC edge (``pdserve.router.wire``). Data flows one way: a worker reports what it alone knows
(``WorkerRequestStats`` on a request's last update, ``StepStats``/``WorkerStats`` on request), and the
router, which routed the request and holds the prefill worker's answer, composes ``RequestMetrics``.

This module imports nothing from pdserve, so every layer (and a client with neither torch nor Ray) can.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

SHUTTING_DOWN = "server shutting down"  # why a router refuses or ends requests while it stops (UNAVAILABLE)


class Mode(StrEnum):
    """How a request is served: prefilled and decoded on one worker (``colocated``), prefilled on a prefill worker
    that pushes its KV to a decode worker (``disaggregated``), or either, the router choosing per request
    (``auto``). A ``str``: it compares equal to its value and serialises as it."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: str, what: str = "mode") -> Mode:
        """``value`` as a Mode; a ValueError naming ``what`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {', '.join(cls)}, got {value!r}") from None


def worker_key(request_id: str, router_id: str, serial: int) -> str:
    """The id the workers know a request by: the client's id, then the router and its serial number, so that
    a client may reuse an id and two routers never collide (``request_id_of`` gives the client's id back)."""
    return f"{request_id}@{router_id}.{serial}"


def request_id_of(key: str) -> str:
    """The client's request id in a worker's key (``worker_key``; a local retry's ``~local`` suffix too)."""
    return key.rsplit("@", 1)[0]


class StepStats(NamedTuple):
    """One engine step, as the worker that ran it measured it (or the simulator priced it): the only shape
    a step record has, for the engine, the simulator, the benchmarks, reports and plots.

    ``started`` is unix time from a worker, virtual seconds from the simulator: the clock of the run's
    request records either way. Tokens are counted by the shape the model computes them in: a decode token
    is a one-token chunk that samples (one query row against the cache), so a prompt whose last chunk is a
    single token counts that token with the decode tokens; every other computed token is a prefill token."""

    started: float  # unix time
    duration_s: float
    schedule_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_preempted: int = 0
    num_context_tokens: int = 0  # keys attended, summed over the step's tokens (the attention cost driver)
    num_decode_context_tokens: int = 0  # of num_context_tokens, those attended by decode tokens
    num_kv_read_tokens: int = 0  # cached tokens whose KV the step reads (the sum of its chunks' starts)
    worker: str = ""  # the worker (or simulated instance) that ran it; filled in by whoever collects steps
    device_s: float = 0.0  # the model's compute in it: CUDA events on a GPU (not host time, which sees launches)
    # the stepping thread's CPU time over the same span as duration_s (time.thread_time): the step's own work
    # without the time other processes held the core; 0.0 when not recorded (the simulator, older records)
    cpu_s: float = 0.0
    # the worker's latest pace probe before this step: the CPU time of one fixed kernel (``engine.pace_probe``),
    # which moves with the machine's pace and not with the step; 0.0 when the probe is off
    pace_s: float = 0.0

    @property
    def ended(self) -> float:
        return self.started + self.duration_s


class WorkerRequestStats(NamedTuple):
    """What one worker knows of a request it finished; travels on the request's last ``TokenUpdate``."""

    queue_s: float = 0.0  # arrival at this worker -> first scheduled (0 when it did not prefill)
    prefill_s: float = 0.0  # first scheduled -> first token sampled (0 when it did not prefill)
    num_cached_tokens: int = 0  # prompt tokens found in this worker's prefix cache
    kv_transfer_s: float = 0.0  # first token sampled (prefill side) -> all KV here: the exposed transfer time
    kv_transfer_bytes: int = 0
    second_token_time: float = 0.0  # unix time output token #2 was sampled here (0 if none)
    # unix time this worker received the call that started its part of the request (a prompt to prefill here,
    # or the first token after a remote prefill): a busy worker takes the call in only after its step
    call_time: float = 0.0


Logprob = tuple[float, list[tuple[int, float]]]
"""A sampled token's log-probability under the model, and the most likely tokens with theirs, most likely first."""


class PromptLogprob(NamedTuple):
    """A prompt token's log-probability given the tokens before it, its rank among the vocabulary (1: the most
    likely), and the ``k`` most likely tokens at its position with theirs, most likely first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class TokenUpdate(NamedTuple):
    """One request's news from one step: new tokens, and on the last update how it ended."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last update
    error: str | None = None  # the request failed on the worker (finish_reason is then "abort")
    stats: WorkerRequestStats | None = None  # on the last update
    logprobs: list[Logprob] | None = None  # per token, when asked for (SamplingParams.logprobs)
    # with the first token, when asked for (SamplingParams.prompt_logprobs): one per prompt token after the first
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepEvents(NamedTuple):
    """One item on a worker's event stream: every update its steps produced since the previous item.

    A worker emits one per step (several steps coalesce when the reader lags), carrying the updates of
    all the requests of one router; the router demultiplexes them to the requests' client streams.
    """

    worker_id: str
    updates: list[TokenUpdate]
    stalled: str = ""  # why the worker's engine counts as hung (its loop has not turned for the stall timeout)


class RequestMetrics(NamedTuple):
    """How a request was served, as the client sees it on the last message of its stream."""

    request_id: str
    mode: str  # "colocated" or "disaggregated" (auto resolved)
    decode_worker: str
    prefill_worker: str = ""  # empty when prefilled on the decode worker
    router: str = ""
    queue_s: float = 0.0  # arrival at the prefilling worker -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token sampled
    kv_transfer_s: float = 0.0  # first token sampled -> all KV on the decode worker (exposed transfer)
    kv_transfer_bytes: int = 0
    ttft_s: float = 0.0  # router receipt -> first token handed to the client stream
    e2e_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the decode worker's prefix cache
    second_token_time: float = 0.0  # unix time the decode worker sampled output token #2 (0 if none)
    fallback: str = ""  # why a disaggregated request was prefilled locally instead (empty if it was not)
    decode_call_time: float = 0.0  # unix time the decode worker received its call (generate, or decode); 0 if unknown


class AdmissionEvent(NamedTuple):
    """A debug trace entry of a worker's engine: it took a request in at ``time`` (unix, on its engine loop,
    between two steps). ``event``: ``queued`` (its scheduler queued the request: a prompt, or a decode whose
    remote KV arrived) or ``reserved`` (blocks set aside for its remote KV). What a trace replay needs to put
    each admission before the step the worker put it before (``pdserve.bench.runner.admission_steps``)."""

    request_id: str
    event: str
    time: float


class WorkerStats(NamedTuple):
    """A worker's KV usage, queues and (optionally) recent steps, for ``Stats`` and the benchmarks."""

    worker_id: str
    role: str  # "prefill" or "decode"
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_used: int
    num_running: int
    num_waiting: int
    num_remote_pending: int  # decode: reservations waiting for KV; prefill: pushes in flight
    tokens_in_flight: int
    num_steps: int
    kv_bytes_moved: int  # prefill: bytes pushed; decode: bytes received
    steps: tuple[StepStats, ...] = ()
    node: str = ""  # the Ray node the worker runs on: "IP/node-id prefix"
    device: str = ""  # its torch device
    state: str = "serving"  # "serving", or "unavailable" when the worker did not answer
    kv_pushes_refused: int = 0  # decode: incoming KV pushes turned away (no secret, no such reservation)
    # with the steps (asked for with them): when the engine took requests in, a debug trace for trace replay
    admissions: tuple[AdmissionEvent, ...] = ()
    kv_blocks_quarantined: int = 0  # decode: blocks of withdrawn reservations that a push may still reach
    kv_late_writes: int = 0  # decode, with verify_kv: freed blocks found changed before their reuse
