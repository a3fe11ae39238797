"""A running pdserve: Ray actors for the workers, the router and its gRPC server on a background loop.

    with Deployment(DeploymentConfig(mode="disaggregated", num_prefill_workers=1)) as d:
        Client(d.address) ...

Starts a local Ray instance unless one is running or an ``address`` is given; places one actor per
worker (a GPU each when the engine runs on CUDA); stops everything it started on ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.placement import DECODE, PREFILL, place_workers
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.router.policy import RouterConfig
from pdserve.router.router import ModelLimits, Router, WorkerHandle
from pdserve.router.server import start_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeploymentConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = "colocated"  # the default mode; requests may override it
    num_prefill_workers: int = 0
    num_decode_workers: int = 1
    transport: str = "nixl"  # KV transport: nixl or grpc
    transport_config: Any = None  # NixlConfig / GrpcConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    address: str | None = None  # a Ray cluster to join ("auto" or host:port); None = local, started here
    router: RouterConfig | None = None  # None = defaults with `mode` as default_mode
    reservation_timeout_s: float = 120.0
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_decode_workers < 1:
            raise ValueError(f"num_decode_workers must be >= 1, got {self.num_decode_workers}")
        if self.num_prefill_workers < 0:
            raise ValueError(f"num_prefill_workers must be >= 0, got {self.num_prefill_workers}")
        if self.mode != "colocated" and self.num_prefill_workers < 1:
            raise ValueError(f"mode {self.mode!r} needs num_prefill_workers >= 1")
        if self.transport not in ("nixl", "grpc"):
            raise ValueError(f"transport must be nixl or grpc, got {self.transport!r}")

    def router_config(self) -> RouterConfig:
        base = self.router or RouterConfig()
        return RouterConfig(**{**base.__dict__, "default_mode": self.mode, "block_size": self.engine.block_size})


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.decode_workers: list[WorkerHandle] = []
        self.prefill_workers: list[WorkerHandle] = []
        self.router: Router | None = None
        self.port: int | None = None
        self._started_ray = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("deployment not started")
        return f"{self.config.host}:{self.port}"

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
        try:
            placement = place_workers(cfg.num_prefill_workers, cfg.num_decode_workers, use_gpu)  # fails fast
            decode_cls = ray.remote(DecodeWorker).options(**placement.actor_options(DECODE), max_concurrency=10_000)
            prefill_cls = ray.remote(PrefillWorker).options(**placement.actor_options(PREFILL), max_concurrency=10_000)
            for i in range(cfg.num_decode_workers):
                wid = f"decode-{i}"
                actor = decode_cls.remote(
                    wid, engine_config, cfg.transport, cfg.transport_config, cfg.reservation_timeout_s
                )
                self.decode_workers.append(WorkerHandle(wid, "decode", actor))
            for i in range(cfg.num_prefill_workers):
                wid = f"prefill-{i}"
                actor = prefill_cls.remote(wid, engine_config, cfg.transport, cfg.transport_config)
                self.prefill_workers.append(WorkerHandle(wid, "prefill", actor))
            ray.get([w.actor.ready.remote() for w in self.workers], timeout=300)
            tokenizer = load_tokenizer(engine_config.model, model_config.eos_token_id)
            limits = ModelLimits(model_config.vocab_size, engine_config.max_model_len)  # type: ignore[arg-type]
            self.router = Router(cfg.router_config(), self.decode_workers, self.prefill_workers, limits, tokenizer)
            self._start_loop()
            self._server, self.port = self._run(start_server(self.router, cfg.host, cfg.port))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.decode_workers, *self.prefill_workers]

    def stats(self, steps_since: float | None = None) -> list[Any]:
        return ray.get([w.actor.stats.remote(steps_since) for w in self.workers], timeout=60)

    def check_integrity(self) -> None:
        ray.get([w.actor.check_integrity.remote() for w in self.workers], timeout=60)

    def stop(self) -> None:
        """Stop the server, the workers and (if started here) Ray. Safe to call twice."""
        if self._server is not None and self._loop is not None:
            try:
                self._run(self._server.stop(grace=1.0))
            except Exception as e:
                log.warning("router server stop: %s", e)
            self._server = None
        for w in self.workers:
            try:
                ray.get(w.actor.shutdown.remote(), timeout=30)
            except Exception as e:
                log.warning("%s shutdown: %s", w.worker_id, e)
            ray.kill(w.actor)
        self.decode_workers, self.prefill_workers = [], []
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the router's event loop runs in a thread, so a plain script can drive a deployment -----
    def _start_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()

    def _run(self, coro, timeout_s: float = 60.0):
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)
