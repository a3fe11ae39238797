"""The KV hand-off's settings, declared once: which transport moves KV from prefill to decode workers, and
its two deadlines. ``DeploymentConfig`` has these fields (it extends ``TransportConfig``), the workers and
the router take their defaults from here, and every command's ``--transport``, ``--push-timeout-s`` and
``--reservation-ttl-s`` come from these fields (``pdserve.options``).

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.options import option

TRANSPORTS = ("nixl", "grpc")
DEFAULT_PUSH_TIMEOUT_S = 20.0
DEFAULT_RESERVATION_TTL_S = 60.0
PUSH_MARGIN_S = 2.0  # a push must be over (done or timed out) this long before the reservation expires


@dataclass(frozen=True)
class TransportConfig:
    """How KV blocks travel from a prefill worker to a decode worker.

    A decode worker's reservation whose KV has not all arrived within ``reservation_ttl_s`` is given up
    (the router's abort of a request waits as long for the prefill side to confirm); a push in flight
    longer than ``push_timeout_s`` fails its request, which must happen ``PUSH_MARGIN_S`` before the TTL.
    Raises ``ValueError`` for an unknown transport or deadlines out of that order.
    """

    transport: str = option("nixl", "KV transport between prefill and decode workers", choices=TRANSPORTS)
    push_timeout_s: float = option(
        DEFAULT_PUSH_TIMEOUT_S, "a KV push in flight longer than this many seconds fails its request"
    )
    reservation_ttl_s: float = option(
        DEFAULT_RESERVATION_TTL_S,
        "seconds a decode worker holds blocks for KV that has not all arrived (and an abort waits for the "
        "prefill worker to confirm its pushes are over)",
    )
    verify_kv: bool = option(False, "send a CRC-32 of every pushed KV block and check it before decoding (slower)")
    kv_host: str = option("", "the address the gRPC KV transport binds to and advertises (default: this node's)")

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not 0 < self.push_timeout_s < self.reservation_ttl_s - PUSH_MARGIN_S:
            raise ValueError(
                f"push_timeout_s must be > 0 and end {PUSH_MARGIN_S} s before reservation_ttl_s "
                f"({self.reservation_ttl_s}), got {self.push_timeout_s}"
            )
