"""A running pdserve: Ray actors for the workers and for the routers (each with its gRPC server).

    with Deployment(DeploymentConfig(mode="disaggregated", num_prefill_workers=1)) as d:
        Client(d.address) ...

Starts a local Ray instance unless one is running or an ``address`` is given; places one actor per
worker (a GPU each when the engine runs on CUDA) and ``num_routers`` router actors on this node, all
listening on one port; stops everything it started on ``stop()``.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.kv_transfer.grpc_transport import GrpcConfig
from pdserve.messages import WorkerStats
from pdserve.placement import DECODE, PREFILL, place_workers
from pdserve.prefill_node.worker import PUSH_MARGIN_S, PrefillWorker
from pdserve.router.policy import RouterConfig
from pdserve.router.process import RouterProcess
from pdserve.router.router import WorkerHandle
from pdserve.router.server import ServerSecurity

log = logging.getLogger(__name__)

WORKER_NAMESPACE = "pdserve"


@dataclass(frozen=True)
class DeploymentConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = "colocated"  # the default mode; requests may override it
    num_prefill_workers: int = 0
    num_decode_workers: int = 1
    transport: str = "nixl"  # KV transport: nixl or grpc
    transport_config: Any = None  # NixlConfig / GrpcConfig
    verify_kv: bool = field(
        default=False,
        metadata={"help": "send a CRC-32 of every pushed KV block and check it before decoding (slower)"},
    )
    kv_host: str = field(
        default="",
        metadata={"help": "address the gRPC KV transport binds to and advertises; default: this node's address"},
    )
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    num_routers: int = 1  # router processes, all on `port` (SO_REUSEPORT)
    http_port: int | None = None  # the OpenAI-compatible HTTP API, every router on it; None = off, 0 = any free
    metrics_port: int | None = None  # Prometheus /metrics of router i on metrics_port + i; None = off, 0 = any free
    explorer_port: int | None = None  # the explorer page, served by router 0; None = off, 0 = any free
    explorer_host: str = "127.0.0.1"  # loopback by default: its bursts and playground need no token
    address: str | None = None  # a Ray cluster to join ("auto" or host:port); None = local, started here
    router: RouterConfig | None = None  # None = defaults with `mode` as default_mode
    reservation_ttl_s: float = 60.0  # a decode reservation whose KV has not all arrived by then is freed
    push_timeout_s: float = 20.0  # a KV push in flight longer fails its request (must end well before the TTL)
    worker_max_restarts: int = 3  # Ray restarts a worker whose process died this often
    # Named, detached workers outlive the process that started them: a router process that restarts
    # (`pdserve serve --address auto` again) finds the running workers instead of starting a second set.
    detached_workers: bool = False
    auth_token: str | None = None  # clients must send `authorization: Bearer <token>`
    tls_cert_file: str | None = None  # PEM certificate chain and key: the client API speaks TLS
    tls_key_file: str | None = None
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.push_timeout_s < self.reservation_ttl_s - PUSH_MARGIN_S:
            raise ValueError(
                f"push_timeout_s must be > 0 and end {PUSH_MARGIN_S} s before reservation_ttl_s "
                f"({self.reservation_ttl_s}), got {self.push_timeout_s}"
            )
        if self.num_decode_workers < 1:
            raise ValueError(f"num_decode_workers must be >= 1, got {self.num_decode_workers}")
        if self.num_prefill_workers < 0:
            raise ValueError(f"num_prefill_workers must be >= 0, got {self.num_prefill_workers}")
        if self.mode != "colocated" and self.num_prefill_workers < 1:
            raise ValueError(f"mode {self.mode!r} needs num_prefill_workers >= 1")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if self.transport not in ("nixl", "grpc"):
            raise ValueError(f"transport must be nixl or grpc, got {self.transport!r}")
        if self.explorer_port is not None and self.auth_token and not _is_loopback(self.explorer_host):
            raise ValueError(
                f"explorer_host {self.explorer_host!r}: with an auth token the explorer listens on loopback only "
                "(its page sends bursts without a token); reach it through an SSH tunnel"
            )

    def security(self) -> ServerSecurity:
        """What the routers' gRPC servers require of clients; reads the TLS files (fails fast if unreadable)."""
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


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.decode_workers: list[WorkerHandle] = []
        self.prefill_workers: list[WorkerHandle] = []
        self.routers: list[Any] = []  # RouterProcess actor handles
        self.worker_info: list[dict[str, Any]] = []  # what each worker said when ready
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_ports: list[int] = []  # per router, when metrics_port is set
        self.explorer_port: int | None = None
        self._started_ray = False

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("deployment not started")
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """``http://host:port`` of the OpenAI-compatible API (its base URL for clients is this + ``/v1``)."""
        if self.http_port is None:
            raise RuntimeError("deployment not started, or started without http_port")
        return f"http://{self.config.host}:{self.http_port}"

    @property
    def explorer_url(self) -> str:
        """``http://host:port/`` of the explorer page."""
        if self.explorer_port is None:
            raise RuntimeError("deployment not started, or started without explorer_port")
        return f"http://{self.config.explorer_host}:{self.explorer_port}/"

    def start(self) -> Deployment:
        cfg = self.config
        model_config = ModelConfig.load(cfg.engine.model)
        engine_config = cfg.engine.with_model_defaults(model_config)  # fail fast, here, on bad config
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": True, **cfg.ray_init_kwargs}
            ray.init(address=cfg.address, **kwargs)
            self._started_ray = True
        use_gpu = engine_config.device.startswith("cuda") or (
            engine_config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        if not use_gpu and engine_config.torch_threads is None and cfg.address is None:
            # CPU workers on this machine share its cores: oversubscribed OpenMP threads collapse
            workers = cfg.num_decode_workers + cfg.num_prefill_workers
            engine_config = replace(engine_config, torch_threads=max(1, (os.cpu_count() or 1) // workers))
        transport_config = cfg.transport_config
        if transport_config is None and cfg.transport == "grpc":
            # a push stream ends when its request fails; only this deployment's workers may push
            transport_config = GrpcConfig(
                host=cfg.kv_host, push_timeout_s=cfg.push_timeout_s, secret=secrets.token_hex(16)
            )
        try:
            placement = place_workers(cfg.num_prefill_workers, cfg.num_decode_workers, use_gpu)  # fails fast
            common = {"max_concurrency": 10_000, "max_restarts": cfg.worker_max_restarts}
            decode_cls, prefill_cls = ray.remote(DecodeWorker), ray.remote(PrefillWorker)
            decode_options = {**placement.actor_options(DECODE), **common}
            prefill_options = {**placement.actor_options(PREFILL), **common}
            for i in range(cfg.num_decode_workers):
                wid = f"decode-{i}"
                actor = decode_cls.options(**decode_options, **self._identity(wid)).remote(
                    wid, engine_config, cfg.transport, transport_config, cfg.reservation_ttl_s, cfg.verify_kv
                )
                self.decode_workers.append(WorkerHandle(wid, "decode", actor))
            for i in range(cfg.num_prefill_workers):
                wid = f"prefill-{i}"
                actor = prefill_cls.options(**prefill_options, **self._identity(wid)).remote(
                    wid, engine_config, cfg.transport, transport_config, cfg.push_timeout_s, cfg.verify_kv
                )
                self.prefill_workers.append(WorkerHandle(wid, "prefill", actor))
            self.worker_info = ray.get([w.actor.ready.remote() for w in self.workers], timeout=300)
            self._start_routers(engine_config)
        except BaseException:
            self.stop()
            raise
        return self

    def _identity(self, worker_id: str) -> dict[str, Any]:
        """Actor options naming a worker: detached workers outlive the router process and are found again."""
        if not self.config.detached_workers:
            return {}
        return {
            "name": f"pdserve-{worker_id}",
            "namespace": WORKER_NAMESPACE,
            "lifetime": "detached",
            "get_if_exists": True,
        }

    def _start_routers(self, engine_config: EngineConfig) -> None:
        cfg = self.config
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        router_cls = ray.remote(RouterProcess).options(num_cpus=0, scheduling_strategy=here, max_concurrency=100_000)
        port, http_port = cfg.port, cfg.http_port
        security = cfg.security()
        for i in range(cfg.num_routers):
            router = router_cls.remote(
                f"router-{i}", cfg.router_config(), engine_config, self.decode_workers, self.prefill_workers, security
            )
            self.routers.append(router)
            metrics_port = cfg.metrics_port + i if cfg.metrics_port else cfg.metrics_port
            explorer = (cfg.explorer_host, cfg.explorer_port) if i == 0 and cfg.explorer_port is not None else None
            ports = ray.get(router.start.remote(cfg.host, port, http_port, metrics_port, explorer), timeout=120)
            port, http_port = ports["grpc"], ports["http"]  # the next routers share these ports
            if ports["metrics"] is not None:
                self.metrics_ports.append(ports["metrics"])
            if ports["explorer"] is not None:
                self.explorer_port = ports["explorer"]
        self.port, self.http_port = port, http_port

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.decode_workers, *self.prefill_workers]

    def router_usage(self) -> list[dict[str, float]]:
        """Per router process: pid, CPU seconds so far, event-stream items received."""
        return ray.get([r.usage.remote() for r in self.routers], timeout=60)

    def stats(self, steps_since: float | None = None) -> list[WorkerStats]:
        return ray.get([w.actor.stats.remote(steps_since) for w in self.workers], timeout=60)

    def check_integrity(self) -> None:
        ray.get([w.actor.check_integrity.remote() for w in self.workers], timeout=60)

    def stop(self) -> None:
        """Stop the server, the workers and (if started here) Ray. Safe to call twice."""
        for router in self.routers:
            try:
                ray.get(router.stop.remote(), timeout=30)
            except Exception as e:
                log.warning("router stop: %s", e)
            ray.kill(router)
        self.routers = []
        for w in self.workers:
            try:
                ray.get(w.actor.shutdown.remote(), timeout=30)
            except Exception as e:
                log.warning("%s shutdown: %s", w.worker_id, e)
            ray.kill(w.actor)
        self.decode_workers, self.prefill_workers = [], []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
