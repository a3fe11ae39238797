"""The KV hand-off's settings, declared once: which transport moves KV from prefill to decode workers, and
its two deadlines. ``DeploymentConfig`` has these fields (it extends ``TransportConfig``), the workers and
the router take their defaults from here, and every command's ``--transport``, ``--push-timeout-s`` and
``--reservation-ttl-s`` come from these fields (``pdserve.options``). ``GrpcConfig``, the gRPC transport's
knobs, lives here too, so that the process that builds a deployment never loads the transport (or torch).

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.options import option

TRANSPORTS = ("nixl", "grpc")
DEFAULT_PUSH_TIMEOUT_S = 20.0
DEFAULT_RESERVATION_TTL_S = 60.0
PUSH_MARGIN_S = 2.0  # a push must be over (done or timed out) this long before the reservation expires
_MIB = 1 << 20
GRPC_MESSAGE_HEADROOM = 64 * 1024  # protobuf framing and the other fields of a KV message


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


@dataclass(frozen=True)
class GrpcConfig:
    """Knobs of the gRPC transport.

    Attributes:
        host: interface the receiver's server binds to and advertises. Empty (the default): this
            node's address, ``ray.util.get_node_ip_address()`` (``127.0.0.1`` outside Ray), so that
            senders on other nodes can reach it.
        port: server port; 0 binds any free port (reported by ``describe()``).
        message_bytes: senders pack whole blocks into messages of up to this many payload bytes
            (at least one block per message). Messages of a few MiB amortise gRPC's per-message
            cost without holding a large buffer; ``benchmarks/kv_transfer_bench.py --grpc-message-mib``
            compares sizes on the machine at hand.
        max_message_bytes: gRPC send/receive message limit on both sides (raised from gRPC's
            4 MiB default); a block must fit in one message.
        server_threads: receiver thread pool size (concurrent incoming pushes).
        push_timeout_s: gRPC deadline of one push stream.
        secret: a deployment's shared secret. Senders prove they hold it with every push (an HMAC of
            the push's target, request and sender ids: the secret itself never travels), and a receiver
            with a secret refuses (UNAUTHENTICATED, counted) any push that does not. A deployment
            always sets one.
        tls_cert_chain, tls_private_key: PEM. With both, the receiver serves TLS only, and senders
            trust that certificate chain (and no other) for it.
        tls_server_name: the name senders check the receiver's certificate against, when it names
            something other than the address they dial (a node's IP address); empty: the address.
    """

    host: str = ""
    port: int = 0
    message_bytes: int = 2 * _MIB
    max_message_bytes: int = 64 * _MIB
    server_threads: int = 4
    push_timeout_s: float = DEFAULT_PUSH_TIMEOUT_S
    secret: str = field(default="", repr=False)
    tls_cert_chain: bytes | None = field(default=None, repr=False)
    tls_private_key: bytes | None = field(default=None, repr=False)
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.message_bytes < 1 or self.message_bytes > self.max_message_bytes - GRPC_MESSAGE_HEADROOM:
            raise ValueError("need 1 <= message_bytes <= max_message_bytes - 64 KiB")
        if self.server_threads < 1:
            raise ValueError("server_threads must be >= 1")
        if self.push_timeout_s <= 0:
            raise ValueError("push_timeout_s must be > 0")
        if (self.tls_cert_chain is None) != (self.tls_private_key is None):
            raise ValueError("tls_cert_chain and tls_private_key go together")

    @property
    def tls(self) -> bool:
        return self.tls_cert_chain is not None

    def bind_host(self) -> str:
        """The host the receiver binds to and advertises (``host``, or this node's address)."""
        if self.host:
            return self.host
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

    def channel_options(self) -> list[tuple[str, int | str]]:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options
