"""A router process: one ``Router`` and its gRPC server in a Ray actor of its own.

``pdserve serve --routers N`` starts N of them in front of the same workers. They bind one port with
``SO_REUSEPORT`` (gRPC sets it by default on Linux), so the kernel spreads client *connections* over
them: a client channel sticks to one router, many channels spread out. Each router subscribes to every
decode worker's event stream under its own id and keeps its own routing view (a hint, as with one).
"""

from __future__ import annotations

import os
import resource
from typing import Any

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.policy import RouterConfig
from pdserve.router.router import ModelLimits, Router, WorkerHandle
from pdserve.router.server import ServerSecurity, start_server


class RouterProcess:
    """A Ray actor (async). ``await start(host, port)`` returns the bound port; ``stop`` before killing it."""

    def __init__(
        self,
        router_id: str,
        config: RouterConfig,
        engine_config: EngineConfig,
        decode_workers: list[WorkerHandle],
        prefill_workers: list[WorkerHandle],
        security: ServerSecurity | None = None,
    ) -> None:
        model_config = ModelConfig.load(engine_config.model)
        limits = ModelLimits(model_config.vocab_size, engine_config.max_model_len)  # type: ignore[arg-type]
        tokenizer = load_tokenizer(engine_config.model, model_config.eos_token_id)
        self.router = Router(config, decode_workers, prefill_workers, limits, tokenizer, router_id)
        self._server: Any = None
        self._security = security

    async def start(self, host: str, port: int) -> int:
        await self.router.start()
        self._server, bound = await start_server(self.router, host, port, self._security)
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.router.close()

    async def usage(self) -> dict[str, float]:
        """This process's CPU seconds and the event-stream items it has received (for the benchmarks)."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"pid": os.getpid(), "cpu_s": ru.ru_utime + ru.ru_stime, "stream_items": self.router.num_stream_items}
