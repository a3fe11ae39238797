"""A running pdserve: Ray actors for the workers and for the routers (each with its gRPC server).

    with Deployment(DeploymentConfig(mode="disaggregated", num_prefill_workers=1)) as d:
        Client(d.address) ...

Starts a local Ray instance unless one is running or an ``address`` is given; places one actor per
worker (``gpus_per_worker`` GPUs each when the engine runs on CUDA, one by default) and ``num_routers``
router actors on this node, all listening on one port; stops everything it started on ``stop()``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.decode_node.worker import DecodeWorker
from pdserve.deployment_config import DeploymentConfig
from pdserve.engine.config import EngineConfig, ModelConfig, shared_gpu_memory_utilization
from pdserve.explorer.app import add_explorer
from pdserve.messages import WorkerStats
from pdserve.net import PortUnavailable, certificate_name
from pdserve.placement import DECODE, PREFILL, place_workers
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.priority import OMP_SPIN_COUNT_ENV, RAY_WORKER_NICENESS_ENV
from pdserve.router.process import RouterProcess
from pdserve.router.router import WorkerHandle
from pdserve.transport_config import GrpcConfig

log = logging.getLogger(__name__)

WORKER_NAMESPACE = "pdserve"
__all__ = ["Deployment", "DeploymentConfig"]


class Deployment:
    """``progress``, when given, hears one line per start-up stage (Ray, workers placed, model loaded,
    listening)."""

    def __init__(self, config: DeploymentConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._progress = progress
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

    def _stage(self, started: float, text: str) -> None:
        if self._progress is not None:
            self._progress(f"[{time.monotonic() - started:5.1f} s] {text}")

    def start(self) -> Deployment:
        """Start everything; raises ``PortUnavailable`` (before Ray starts) when a port to listen on is taken."""
        cfg = self.config
        started = time.monotonic()
        cfg.check_ports_free()  # before Ray and the model: a taken port fails in a second, not after a minute
        model_config = ModelConfig.load(cfg.engine.model)
        engine_config = cfg.engine.with_model_defaults(model_config)  # fail fast, here, on bad config
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": True, **cfg.ray_init_kwargs}
            if cfg.address is None:  # a local cluster of our own: its workers start at normal priority
                os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
                os.environ[OMP_SPIN_COUNT_ENV] = str(cfg.omp_spin_count)  # and their OpenMP threads spin so long
            ray.init(address=cfg.address, **kwargs)
            self._started_ray = True
        self._stage(started, f"Ray {'started' if self._started_ray else 'joined'} ({cfg.address or 'local'})")
        use_gpu = engine_config.device.startswith("cuda") or (
            engine_config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        if use_gpu and engine_config.gpu_memory_utilization is None and cfg.gpus_per_worker < 1:
            # workers sharing a GPU split its memory: each sizes its KV cache from its own share
            share = shared_gpu_memory_utilization(cfg.gpus_per_worker)
            engine_config = replace(engine_config, gpu_memory_utilization=share)
        if not use_gpu and engine_config.torch_threads is None and cfg.address is None:
            # CPU workers on this machine share its cores: oversubscribed OpenMP threads collapse
            workers = cfg.num_decode_workers + cfg.prefill_worker_count
            engine_config = replace(engine_config, torch_threads=max(1, (os.cpu_count() or 1) // workers))
        transport_config = self._transport_config()
        try:
            placement = place_workers(  # fails fast
                cfg.prefill_worker_count, cfg.num_decode_workers, use_gpu, gpus_per_worker=cfg.gpus_per_worker
            )
            common: dict[str, Any] = {"max_concurrency": 10_000, "max_restarts": cfg.worker_max_restarts}
            if not (self._started_ray and cfg.address is None):
                # libgomp reads it when the process starts: a cluster we did not start gets it per worker (merged
                # with the job's runtime_env; Ray then keeps one more idle worker process for the others)
                common["runtime_env"] = {"env_vars": {OMP_SPIN_COUNT_ENV: str(cfg.omp_spin_count)}}
            decode_cls, prefill_cls = ray.remote(DecodeWorker), ray.remote(PrefillWorker)
            decode_options = {**placement.actor_options(DECODE), **common}
            prefill_options = {**placement.actor_options(PREFILL), **common}
            live = {"engine_stall_timeout_s": cfg.engine_stall_timeout_s}
            for i in range(cfg.num_decode_workers):
                wid = f"decode-{i}"
                actor: Any = decode_cls.options(**decode_options, **self._identity(wid)).remote(
                    wid, engine_config, cfg.transport, transport_config, cfg.reservation_ttl_s, cfg.verify_kv, **live
                )
                self.decode_workers.append(WorkerHandle(wid, "decode", actor))
            for i in range(cfg.prefill_worker_count):
                wid = f"prefill-{i}"
                actor = prefill_cls.options(**prefill_options, **self._identity(wid)).remote(
                    wid, engine_config, cfg.transport, transport_config, cfg.push_timeout_s, cfg.verify_kv, **live
                )
                self.prefill_workers.append(WorkerHandle(wid, "prefill", actor))
            self._stage(started, f"workers placed: {', '.join(w.worker_id for w in self.workers)}")
            self.worker_info = ray.get([w.actor.ready.remote() for w in self.workers], timeout=300)
            self._stage(started, f"model {cfg.engine.model} loaded on {len(self.workers)} workers")
            self._start_routers(engine_config)
            self._stage(started, f"listening on {self.address}")
        except BaseException:
            self.stop()
            raise
        return self

    def _transport_config(self) -> Any:
        """The KV transport's config for the workers. The gRPC transport always gets a secret of this deployment's
        own (only its workers may push), even in a config the caller gave, and the deployment's TLS certificate
        when it has one (the KV service then speaks TLS only, and its senders trust that certificate alone)."""
        cfg = self.config
        if cfg.transport != "grpc":
            return cfg.transport_config
        # a push stream ends when its request fails
        grpc_config = cfg.transport_config or GrpcConfig(host=cfg.kv_host, push_timeout_s=cfg.push_timeout_s)
        if not grpc_config.secret:
            grpc_config = replace(grpc_config, secret=secrets.token_hex(16))
        security = cfg.security()
        if security.tls_cert_chain is not None and security.tls_private_key is not None and not grpc_config.tls:
            grpc_config = replace(
                grpc_config,
                tls_cert_chain=security.tls_cert_chain,
                tls_private_key=security.tls_private_key,
                tls_server_name=grpc_config.tls_server_name or certificate_name(security.tls_cert_chain),
            )
        return grpc_config

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
        router_cls: Any = ray.remote(RouterProcess).options(
            num_cpus=0, scheduling_strategy=here, max_concurrency=100_000
        )
        port, http_port = cfg.port, cfg.http_port
        security = cfg.security()
        for i in range(cfg.num_routers):
            router = router_cls.remote(
                f"router-{i}", cfg.router_config(), engine_config, self.decode_workers, self.prefill_workers, security
            )
            self.routers.append(router)
            metrics_port = cfg.metrics_port + i if cfg.metrics_port else cfg.metrics_port
            site = (
                (cfg.explorer_host, cfg.explorer_port, add_explorer)
                if i == 0 and cfg.explorer_port is not None
                else None
            )
            try:
                ports: dict[str, Any] = ray.get(
                    router.start.remote(cfg.host, port, http_port, metrics_port, site), timeout=120
                )
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, OSError):  # taken since start() checked it
                    raise PortUnavailable(f"router-{i}: {e.cause}") from None
                raise
            port, http_port = ports["grpc"], ports["http"]  # the next routers share these ports
            if ports["metrics"] is not None:
                self.metrics_ports.append(ports["metrics"])
            if ports["site"] is not None:
                self.explorer_port = ports["site"]
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

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server, the workers and (if started here) Ray. Safe to call twice.

        The routers stop together, then the workers shut down together, each group given ``timeout_s``;
        whatever has not finished by then is killed, so a stop takes at most about twice ``timeout_s``.
        """
        self._stop_group("router", [(f"router-{i}", r, r.stop) for i, r in enumerate(self.routers)], timeout_s)
        self.routers = []
        self._stop_group("worker", [(w.worker_id, w.actor, w.actor.shutdown) for w in self.workers], timeout_s)
        self.decode_workers, self.prefill_workers = [], []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    @staticmethod
    def _stop_group(kind: str, actors: list[tuple[str, Any, Any]], timeout_s: float) -> None:
        """Call each actor's stop method at once, wait up to ``timeout_s`` for all of them, then kill them."""
        refs = {name: method.remote() for name, _, method in actors}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for name, ref in refs.items():
            if ref not in ready:
                log.warning("%s %s did not stop within %.0f s: killed", kind, name, timeout_s)
                continue
            try:
                ray.get(ref)
            except Exception as e:
                log.warning("%s %s stop: %s", kind, name, e)
        for _, actor, _ in actors:
            ray.kill(actor)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
