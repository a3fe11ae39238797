"""A router process: one ``Router`` and its gRPC server in a Ray actor of its own.

The decode workers hold a handle to it (they ask ``alive()`` to learn when it died), and Ray loads this
module wherever a handle is deserialised: the HTTP API (FastAPI, a heavy import) loads only when a server starts.

``pdserve serve --routers N`` starts N of them in front of the same workers. They bind one port with
``SO_REUSEPORT`` (gRPC sets it by default on Linux), so the kernel spreads client *connections* over
them: a client channel sticks to one router, many channels spread out. Each router subscribes to every
decode worker's event stream under its own id and keeps its own routing view (a hint, as with one).

With ``http_port`` the router also serves the OpenAI-compatible HTTP API (``router/http_api.py``) on it,
every router on the same port (``SO_REUSEPORT`` again). With ``metrics_port`` router ``i`` serves its
own Prometheus ``/metrics`` on ``metrics_port + i`` (each router has its own registry, so each needs
its own port to be scraped; the HTTP API's ``/metrics`` answers for whichever router took the connection).
With ``site``, the router also serves one more HTTP app on an address of its own: the HTTP API plus
whatever the site's function adds to it (the deployment passes the explorer page's, ``pdserve.explorer``,
to router 0; the router knows nothing of what it adds).
With a TLS certificate and key (``ServerSecurity``) every one of these HTTP servers speaks HTTPS, as gRPC
speaks TLS.
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Callable
from typing import Any, Protocol

import ray

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.net import HttpServer, server_tls_context
from pdserve.priority import restore_normal_priority
from pdserve.router.config import RouterConfig
from pdserve.router.router import ModelLimits, Router, WorkerHandle
from pdserve.router.server import GrpcServer, ServerSecurity, start_server


class Closeable(Protocol):
    async def close(self) -> None: ...


AddSite = Callable[[Any, Router], Closeable]
"""Adds routes to a FastAPI app (the HTTP API's) for this router; what it returns is closed when the router stops."""


class RouterProcess:
    """A Ray actor (async). ``await start(host, port, ...)`` returns the bound ports; ``stop`` before killing it."""

    def __init__(
        self,
        router_id: str,
        config: RouterConfig,
        engine_config: EngineConfig,
        decode_workers: list[WorkerHandle],
        prefill_workers: list[WorkerHandle],
        security: ServerSecurity | None = None,
    ) -> None:
        # Ray starts workers at niceness 15: next to busy engine workers on a small machine, a niced router
        # gets the CPU in slices so rare that every token waits in it (seconds on 2 cores)
        restore_normal_priority()
        model_config = ModelConfig.load(engine_config.model)
        limits = ModelLimits(model_config.vocab_size, engine_config.max_model_len)  # type: ignore[arg-type]
        tokenizer = load_tokenizer(engine_config.model, model_config.eos_token_ids or None)
        self.router = Router(config, decode_workers, prefill_workers, limits, tokenizer, router_id)
        self.router.handle = ray.get_runtime_context().current_actor  # the workers watch it for the router's death
        self.model_name = engine_config.model
        self._server: GrpcServer | None = None
        self._http: list[HttpServer] = []
        self._site: Closeable | None = None
        self._security = security

    async def start(
        self,
        host: str,
        port: int,
        http_port: int | None = None,
        metrics_port: int | None = None,
        site: tuple[str, int, AddSite] | None = None,
    ) -> dict[str, Any]:
        """Serve gRPC on ``port``, and HTTP / metrics / the site (``(host, port, add_site)``) when given
        (port 0 = any free port; None = off).

        Returns the bound ports: ``{"grpc": int, "http", "metrics", "site": int | None}``.
        """
        await self.router.start()
        self._server = await start_server(self.router, host, port, self._security)
        ports: dict[str, Any] = {"grpc": self._server.port, "http": None, "metrics": None, "site": None}
        security = self._security or ServerSecurity()
        tls = None
        if security.tls_cert_chain is not None and security.tls_private_key is not None:
            tls = server_tls_context(security.tls_cert_chain, security.tls_private_key)
        for name, address, app in (
            ("http", (host, http_port), self._http_app),
            ("metrics", (host, metrics_port), self._metrics_app),
            ("site", site[:2] if site else (host, None), lambda: self._site_app(site[2])),  # type: ignore[index]
        ):
            bind_host, bind_port = address
            if bind_port is not None:
                server = HttpServer(app(), bind_host, bind_port, tls=tls)
                self._http.append(server)
                ports[name] = await server.start()
        restore_normal_priority()  # and the threads its servers started
        return ports

    def _http_app(self) -> Any:
        from pdserve.router.http_api import build_app

        return build_app(self.router, self.model_name, self._security.auth_token if self._security else None)

    def _metrics_app(self) -> Any:
        from pdserve.router.http_api import metrics_app

        return metrics_app(self.router)

    def _site_app(self, add_site: AddSite) -> Any:
        app = self._http_app()
        self._site = add_site(app, self.router)
        return app

    async def stop(self, grace_s: float = 1.0) -> None:
        """Drain, then stop serving: new requests are refused (UNAVAILABLE, "server shutting down"), open ones
        get ``grace_s`` to finish, and the rest end with that error as the last event of their streams (an
        error event then ``[DONE]`` over HTTP, that status over gRPC); then the servers close."""
        await self.router.drain(grace_s, timeout_s=2.0)
        if self._site is not None:
            await self._site.close()
        await asyncio.gather(*(http.stop() for http in self._http))  # each waits up to 2 s for its streams
        self._http = []
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.router.close()

    async def alive(self) -> bool:
        """The decode workers ask this to learn that the router's process still lives (Ray says when it died)."""
        return True

    async def usage(self) -> dict[str, float]:
        """This process's CPU seconds and the event-stream items it has received (for the benchmarks)."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"pid": os.getpid(), "cpu_s": ru.ru_utime + ru.ru_stime, "stream_items": self.router.num_stream_items}
