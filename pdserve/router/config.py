"""A router's policy and limits, one frozen config the deployment builds and passes down."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.messages import Mode
from pdserve.options import option
from pdserve.transport_config import DEFAULT_RESERVATION_TTL_S


@dataclass(frozen=True)
class RouterConfig:
    """A router's policy and limits. Fields with a help text are command-line options (``pdserve.options``);
    the deployment sets the others from its own settings."""

    default_mode: str = "colocated"
    block_size: int = 16
    auto_min_remote_tokens: int = option(
        512, "auto mode: prefill remotely when a prompt has more uncached tokens than this..."
    )
    auto_max_prefill_queue_tokens: int = option(
        16384, "...and some prefill worker has fewer prompt tokens queued than this"
    )
    max_active_requests: int = option(4096, "requests in flight through one router; beyond this, RESOURCE_EXHAUSTED")
    max_queued_requests: int = option(512, "requests waiting for their first token; beyond this, RESOURCE_EXHAUSTED")
    max_queued_prompt_tokens: int = option(
        262144, "prompt tokens of the requests waiting for their first token; beyond this, RESOURCE_EXHAUSTED"
    )
    max_request_bytes: int = option(8 << 20, "a larger request body is refused before it is parsed (gRPC and HTTP)")
    default_chat_max_tokens: int = option(1024, "HTTP chat requests that name no max_tokens get at most this many")
    reserve_timeout_s: float = option(60.0, "seconds a prefill may wait for its decode worker to have room")
    abort_fence_s: float = DEFAULT_RESERVATION_TTL_S  # an abort waits this long for the prefill worker's confirmation
    stream_idle_timeout_s: float = option(600.0, "a stream with no token for this many seconds fails with UNAVAILABLE")
    decode_silence_timeout_s: float = option(
        5.0,
        "a decode worker whose event stream is silent this long (an idle one sends a heartbeat every 0.5 s), or a "
        "prefill worker that does not answer the router's probe (twice a second) for this long, counts as hung: its "
        "requests fail with UNAVAILABLE and nothing is routed to it until it answers again",
    )
    max_queue_time_s: float | None = option(
        None,
        "refuse (RESOURCE_EXHAUSTED / HTTP 429) a request still without its first token after this many seconds, "
        "and abort it on its workers, rather than serve it late; default: no bound",
    )
    prefix_index_blocks: int = option(65536, "prompt blocks the router remembers per decode worker (prefix routing)")
    prefix_caching: bool = True  # the workers cache prefixes; if not, the view remembers nothing
    stream_interval: int = option(
        1, "tokens per streamed message after the first (a request may ask for its own); 1: every token"
    )

    def __post_init__(self) -> None:
        Mode.parse(self.default_mode, "default_mode")
        for name in (
            "block_size",
            "max_active_requests",
            "max_queued_requests",
            "max_queued_prompt_tokens",
            "max_request_bytes",
            "default_chat_max_tokens",
            "prefix_index_blocks",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.auto_min_remote_tokens < 0 or self.auto_max_prefill_queue_tokens < 0:
            raise ValueError("auto thresholds must be >= 0")
        for name in ("reserve_timeout_s", "abort_fence_s", "stream_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.decode_silence_timeout_s >= 1.0:  # several heartbeats must fit in it
            raise ValueError(f"decode_silence_timeout_s must be >= 1, got {self.decode_silence_timeout_s!r}")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0 (or None), got {self.max_queue_time_s!r}")
