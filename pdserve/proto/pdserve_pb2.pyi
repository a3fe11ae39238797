from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    COLOCATED: _ClassVar[Mode]
    DISAGGREGATED: _ClassVar[Mode]
    AUTO: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
COLOCATED: Mode
DISAGGREGATED: Mode
AUTO: Mode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "stop", "logprobs", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "mode", "stream_interval", "apply_chat_template", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    mode: Mode
    stream_interval: int
    apply_chat_template: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., stream_interval: _Optional[int] = ..., apply_chat_template: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "rank", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class RequestMetadata(_message.Message):
    __slots__ = ("request_id", "mode", "prefill_worker", "decode_worker", "queue_s", "prefill_s", "kv_transfer_s", "kv_transfer_bytes", "ttft_s", "e2e_s", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "second_token_time", "router", "fallback", "decode_call_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECOND_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALL_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mode: Mode
    prefill_worker: str
    decode_worker: str
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_transfer_bytes: int
    ttft_s: float
    e2e_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    second_token_time: float
    router: str
    fallback: str
    decode_call_time: float
    def __init__(self, request_id: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., second_token_time: _Optional[float] = ..., router: _Optional[str] = ..., fallback: _Optional[str] = ..., decode_call_time: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "metadata", "index", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    metadata: RequestMetadata
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., metadata: _Optional[_Union[RequestMetadata, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "status", "num_prefill_workers", "num_decode_workers", "default_mode")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    status: str
    num_prefill_workers: int
    num_decode_workers: int
    default_mode: Mode
    def __init__(self, ok: _Optional[bool] = ..., status: _Optional[str] = ..., num_prefill_workers: _Optional[int] = ..., num_decode_workers: _Optional[int] = ..., default_mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("include_steps", "steps_since")
    INCLUDE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_SINCE_FIELD_NUMBER: _ClassVar[int]
    include_steps: bool
    steps_since: float
    def __init__(self, include_steps: _Optional[bool] = ..., steps_since: _Optional[float] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("started", "duration_s", "num_prefill_tokens", "num_decode_tokens", "num_seqs", "num_context_tokens", "schedule_s", "num_preempted", "num_decode_context_tokens", "num_kv_read_tokens", "worker", "device_s", "cpu_s", "pace_s")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    PACE_S_FIELD_NUMBER: _ClassVar[int]
    started: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_context_tokens: int
    schedule_s: float
    num_preempted: int
    num_decode_context_tokens: int
    num_kv_read_tokens: int
    worker: str
    device_s: float
    cpu_s: float
    pace_s: float
    def __init__(self, started: _Optional[float] = ..., duration_s: _Optional[float] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_tokens: _Optional[int] = ..., num_seqs: _Optional[int] = ..., num_context_tokens: _Optional[int] = ..., schedule_s: _Optional[float] = ..., num_preempted: _Optional[int] = ..., num_decode_context_tokens: _Optional[int] = ..., num_kv_read_tokens: _Optional[int] = ..., worker: _Optional[str] = ..., device_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., pace_s: _Optional[float] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "blocks_total", "blocks_free", "blocks_cached", "blocks_used", "num_running", "num_waiting", "num_remote_pending", "tokens_in_flight", "num_steps", "kv_bytes_moved", "steps", "node", "device", "state", "kv_pushes_refused", "admissions", "kv_blocks_quarantined", "kv_late_writes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PENDING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    KV_LATE_WRITES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_used: int
    num_running: int
    num_waiting: int
    num_remote_pending: int
    tokens_in_flight: int
    num_steps: int
    kv_bytes_moved: int
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    node: str
    device: str
    state: str
    kv_pushes_refused: int
    admissions: _containers.RepeatedCompositeFieldContainer[AdmissionEvent]
    kv_blocks_quarantined: int
    kv_late_writes: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., blocks_total: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., blocks_used: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_remote_pending: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., num_steps: _Optional[int] = ..., kv_bytes_moved: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., node: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[str] = ..., kv_pushes_refused: _Optional[int] = ..., admissions: _Optional[_Iterable[_Union[AdmissionEvent, _Mapping]]] = ..., kv_blocks_quarantined: _Optional[int] = ..., kv_late_writes: _Optional[int] = ...) -> None: ...

class AdmissionEvent(_message.Message):
    __slots__ = ("request_id", "event", "time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event: str
    time: float
    def __init__(self, request_id: _Optional[str] = ..., event: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("workers", "num_active_requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    num_active_requests: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., num_active_requests: _Optional[int] = ...) -> None: ...
