"""``DeploymentConfig``: what ``pdserve serve`` deploys, declared once (``pdserve.deployment`` runs it).

Its fields with a help text are the deployment's command-line options (``pdserve.options``): ``pdserve
serve``, ``pdserve bench`` and ``pdserve sim`` take their ``--prefill-workers``, ``--decode-workers``,
``--transport``, ... from here. It extends ``TransportConfig`` (the KV hand-off's transport and deadlines).
Light to import (no Ray, no torch): every command builds its parser from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.async_engine import DEFAULT_ENGINE_STALL_TIMEOUT_S
from pdserve.engine.config import EngineConfig
from pdserve.messages import Mode
from pdserve.net import is_loopback
from pdserve.options import option
from pdserve.router.config import RouterConfig
from pdserve.transport_config import TransportConfig

if TYPE_CHECKING:
    from pdserve.router.server import ServerSecurity

DEFAULT_PORT = 50051  # the command line's gRPC port (`pdserve serve --port`, `pdserve generate --target`)
AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"
MIN_GPU_FRACTION = 0.0001  # Ray's resource precision
# spins that outlast the gaps between the kernels of a step and end long before the gaps between steps
DEFAULT_OMP_SPIN_COUNT = 20_000


@dataclass(frozen=True)
class DeploymentConfig(TransportConfig):
    """A deployment: its workers, routers, addresses and access; ``engine`` and ``router`` are the
    workers' and the routers' own settings. ``num_prefill_workers=None`` means 0 in colocated mode and
    1 otherwise. Raises ``ValueError`` for settings no deployment can take."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = option("colocated", "the mode of requests that ask for none", choices=list(Mode))
    num_prefill_workers: int | None = option(
        None, "prefill workers (default: 0 in colocated mode, else 1)", flag="--prefill-workers"
    )
    num_decode_workers: int = option(
        1, "decode workers (in colocated mode, the workers that do both)", flag="--decode-workers"
    )
    gpus_per_worker: float = option(
        1.0,
        "GPUs each worker takes when the engine runs on CUDA (unused on CPU): a fraction to share a GPU "
        "(0.25: four workers on one, so every mode runs on a single GPU) or a whole number",
    )
    transport_config: Any = None  # NixlConfig / GrpcConfig
    host: str = option("127.0.0.1", "the routers' address")
    port: int = option(0, "the routers' gRPC port (0: any free port)")
    num_routers: int = option(1, "router processes, all on --port (SO_REUSEPORT)", flag="--routers")
    http_port: int | None = option(
        None, "also serve the OpenAI-compatible HTTP API (and /metrics) on --host at this port (0: any free)"
    )
    metrics_port: int | None = option(
        None, "Prometheus /metrics of router i on this port + i (/metrics is on --http-port too)"
    )
    explorer_port: int | None = option(
        None, "serve the explorer page (playground and live view) on --explorer-host at this port"
    )
    explorer_host: str = option("127.0.0.1", "the explorer's address (loopback by default)")
    address: str | None = option(None, "Ray cluster to join ('auto' or host:port; default: start one here)")
    router: RouterConfig | None = None  # None = defaults with `mode` as default_mode
    worker_max_restarts: int = option(3, "Ray restarts a worker whose process died this many times")
    engine_stall_timeout_s: float = option(
        DEFAULT_ENGINE_STALL_TIMEOUT_S,
        "a worker whose engine loop has not stepped for this many seconds counts as hung: its requests fail with "
        "UNAVAILABLE naming it, nothing is routed to it and health says so, until it steps again",
    )
    omp_spin_count: int = option(
        DEFAULT_OMP_SPIN_COUNT,
        "GOMP_SPINCOUNT of the engine workers: how long their OpenMP threads wait for the next parallel kernel "
        "before they sleep, in spins of libgomp's busy-wait loop (0: sleep at once, a wake-up per kernel)",
    )
    # Named, detached workers outlive the process that started them: a router process that restarts
    # (`pdserve serve --address auto` again) finds the running workers instead of starting a second set.
    detached_workers: bool = False
    auth_token: str | None = option(
        None, "clients must send this bearer token (authorization: Bearer ...)", env=AUTH_TOKEN_ENV
    )
    tls_cert_file: str | None = option(
        None, "PEM certificate chain: serve the client API (gRPC and HTTP) over TLS", flag="--tls-cert"
    )
    tls_key_file: str | None = option(None, "PEM private key of --tls-cert", flag="--tls-key")
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_prefill_workers is None:
            object.__setattr__(self, "num_prefill_workers", 0 if self.mode == "colocated" else 1)
        if self.num_decode_workers < 1:
            raise ValueError(f"num_decode_workers must be >= 1, got {self.num_decode_workers}")
        if self.prefill_worker_count < 0:
            raise ValueError(f"num_prefill_workers must be >= 0, got {self.num_prefill_workers}")
        Mode.parse(self.mode)
        if self.mode != "colocated" and self.prefill_worker_count < 1:
            raise ValueError(f"mode {self.mode!r} needs num_prefill_workers >= 1")
        check_gpus_per_worker(self.gpus_per_worker)
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if not self.engine_stall_timeout_s > 0:
            raise ValueError(f"engine_stall_timeout_s must be > 0, got {self.engine_stall_timeout_s!r}")
        if self.omp_spin_count < 0:
            raise ValueError(f"omp_spin_count must be >= 0, got {self.omp_spin_count}")
        self._check_ports()
        tls = self.tls_cert_file is not None and self.tls_key_file is not None
        servers = (
            ("port (gRPC)", self.port, self.host),
            ("http_port", self.http_port, self.host),
            ("explorer_port", self.explorer_port, self.explorer_host),
        )
        for name, port, host in servers:
            if port is not None and self.auth_token and not tls and not is_loopback(host):
                raise ValueError(
                    f"{name} on {host!r}: a token-protected server off loopback needs TLS "
                    "(tls_cert_file and tls_key_file), or the token crosses the network in the clear"
                )

    def _check_ports(self) -> None:
        """Every port a number (0: any free one), and no two servers on one port of one host."""
        from pdserve.net import MAX_PORT, check_port  # loads uvicorn: not for every command's parser

        for name in ("port", "http_port", "metrics_port", "explorer_port"):
            check_port(name, getattr(self, name))
        if self.metrics_port and self.metrics_port + self.num_routers - 1 > MAX_PORT:
            raise ValueError(
                f"metrics_port {self.metrics_port} + one port per router ({self.num_routers}) passes {MAX_PORT}"
            )
        taken: dict[tuple[str, int], str] = {}
        for name, host, port in self.listening():
            if port and (host, port) in taken:
                raise ValueError(
                    f"{name} {port} is also the {taken[host, port]} on {host}: give each server its own port"
                )
            taken[host, port] = name

    def listening(self) -> list[tuple[str, str, int]]:
        """``(option, host, port)`` of every server this deployment listens on (port 0: any free one)."""
        out = [("port", self.host, self.port)]
        if self.http_port is not None:
            out.append(("http_port", self.host, self.http_port))
        if self.metrics_port is not None:
            out += [("metrics_port", self.host, self.metrics_port + i if self.metrics_port else 0)
                    for i in range(self.num_routers)]  # fmt: skip
        if self.explorer_port is not None:
            out.append(("explorer_port", self.explorer_host, self.explorer_port))
        return out

    def check_ports_free(self) -> None:
        """Raise ``PortUnavailable`` (one line: the option, the address, what to do) unless every port asked for
        can be listened on now; port 0 (any free one) always can."""
        from pdserve.net import check_free

        for name, host, port in self.listening():
            if port:
                check_free(host, port, name)

    @property
    def prefill_worker_count(self) -> int:
        """``num_prefill_workers`` as resolved on construction (None became 0 or 1)."""
        if self.num_prefill_workers is None:
            raise AssertionError("resolved in __post_init__")
        return self.num_prefill_workers

    def security(self) -> ServerSecurity:
        """What the routers' gRPC servers require of clients; reads the TLS files (fails fast if unreadable)."""
        from pdserve.router.server import ServerSecurity

        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        cert = Path(self.tls_cert_file).read_bytes() if self.tls_cert_file else None
        key = Path(self.tls_key_file).read_bytes() if self.tls_key_file else None
        return ServerSecurity(self.auth_token, cert, key)

    def router_config(self) -> RouterConfig:
        base = self.router or RouterConfig()
        return RouterConfig(
            **{
                **base.__dict__,
                "default_mode": self.mode,
                "block_size": self.engine.block_size,
                "prefix_caching": self.engine.enable_prefix_caching,
                "abort_fence_s": self.reservation_ttl_s,
            }
        )


def check_gpus_per_worker(gpus: float) -> None:
    """Raise ``ValueError`` unless ``gpus`` is what Ray can give one actor: a fraction of one GPU
    (0 < gpus <= 1, the GPU shared with other workers) or a whole number of GPUs."""
    if isinstance(gpus, bool) or not isinstance(gpus, int | float) or not math.isfinite(gpus) or gpus <= 0:
        raise ValueError(f"gpus_per_worker must be > 0, got {gpus!r}")
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(
            f"gpus_per_worker must be at most 1 (workers sharing a GPU) or a whole number of GPUs, got {gpus:g}"
        )
    if gpus < MIN_GPU_FRACTION:
        raise ValueError(f"gpus_per_worker must be at least {MIN_GPU_FRACTION} (Ray's precision), got {gpus!r}")
