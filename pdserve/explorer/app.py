"""The explorer's routes: one static page and its JSON endpoints, on a FastAPI app.

- ``GET /`` and ``GET /explorer``: the page (``static/index.html``; its script and style under
  ``/explorer/static/``; nothing is loaded from elsewhere).
- ``GET /explorer/api/options``: the profiles, the controls' defaults and limits, whether a deployment
  is attached (the live view).
- ``POST /explorer/api/playground``: a JSON object of ``PlaygroundSettings`` → ``run_playground``'s
  result. Runs go one at a time to a worker process (``PlaygroundRunner``: the simulator is CPU work and
  never holds the router's GIL), each bounded in time; each client has at most one run of each kind
  waiting (a newer one replaces it: 409 for the older), and at most ``MAX_WAITING_RUNS`` runs wait (else 429).
- ``POST /explorer/api/sweep``: the same settings → ``run_chunk_sweep``'s result (the chunk-size sweep),
  through the same worker process and bounds.
- ``GET /explorer/api/live``: ``LiveView.snapshot`` and the recent bursts (409 without a deployment).
- ``POST /explorer/api/burst``: a JSON object of ``BurstSpec`` fields → the burst's status (202); one
  burst at a time per deployment (429 while one runs).

Behind ``pdserve serve``, the ``/explorer/api/`` endpoints need the deployment's bearer token when it has
one (the page asks for it). A bad value answers 400 with ``{"error": {"message", "field"}}``; the page
shows the message.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pdserve.explorer.live import BurstBusy, Bursts, BurstSpec, LiveView
from pdserve.explorer.playground import MAX_CHUNKS, MAX_DECODES, MAX_INSTANCES, PlaygroundSettings, SettingError
from pdserve.messages import Mode
from pdserve.router.router import Router

STATIC = Path(__file__).parent / "static"
MAX_WAITING_RUNS = 8  # playground runs waiting for the worker process (one per client)
RUN_TIMEOUT_S = 60.0  # a playground run taking longer is stopped (its worker process killed)


def build_explorer_app(router: Router | None = None) -> FastAPI:
    """An app with only the explorer (``pdserve sim --serve``: the playground, no deployment); its playground's
    worker process stops with the app."""
    app = FastAPI(title="pdserve explorer", docs_url=None, redoc_url=None, openapi_url=None)
    api = add_explorer(app, router)
    app.router.on_shutdown.append(api.close)
    return app


def add_explorer(app: FastAPI, router: Router | None) -> ExplorerApi:
    """Add the page and its endpoints to ``app``; with ``router``, the live view and bursts work too.
    ``await close()`` the returned API when the server stops (it cancels running bursts)."""
    api = ExplorerApi(router)
    app.get("/", include_in_schema=False)(api.page)
    app.get("/explorer", include_in_schema=False)(api.page)
    app.mount("/explorer/static", StaticFiles(directory=STATIC), name="explorer-static")
    app.get("/explorer/api/options")(api.options)
    app.post("/explorer/api/playground")(api.playground)
    app.post("/explorer/api/sweep")(api.sweep)
    app.get("/explorer/api/live")(api.live)
    app.post("/explorer/api/burst")(api.burst)
    return api


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field}}, status_code=status)


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise SettingError("body", f"not valid JSON: {e}") from None


class ExplorerApi:
    def __init__(self, router: Router | None) -> None:
        self.router = router
        self.bursts = Bursts(router) if router is not None else None
        self.live_view = LiveView(router) if router is not None else None
        self.runner = PlaygroundRunner()

    async def page(self) -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def options(self) -> dict[str, Any]:
        from pdserve.sim import DEFAULT_CALIBRATION
        from pdserve.sim.profiles import CPU_MEASURED, HARDWARE, MODELS

        hardware = list(HARDWARE)
        if os.path.exists(DEFAULT_CALIBRATION):  # `pdserve sim --calibrate` has measured this machine
            hardware.append(CPU_MEASURED)
        return {
            "hardware": hardware,
            "models": {name: {"max_context": m.max_context} for name, m in MODELS.items()},
            "modes": list(Mode),
            "defaults": asdict(PlaygroundSettings()),
            "limits": {"max_chunks": MAX_CHUNKS, "max_decodes": MAX_DECODES, "max_instances": MAX_INSTANCES},
            "live": self.router is not None,
            "burst_defaults": asdict(BurstSpec()),
            "default_mode": self.router.config.default_mode if self.router is not None else None,
        }

    async def playground(self, request: Request) -> JSONResponse:
        try:
            settings = PlaygroundSettings.parse(await _json_body(request))
            result = await self.runner.run(request.client.host if request.client else "", settings)
        except SettingError as e:
            return _error(400, str(e), e.field)
        except PlaygroundRefused as e:
            return _error(e.status, str(e))
        return JSONResponse(result)

    async def sweep(self, request: Request) -> JSONResponse:
        """The page's scenario at every chunk size of the sweep (``run_chunk_sweep``)."""
        try:
            settings = PlaygroundSettings.parse(await _json_body(request))
            result = await self.runner.run(request.client.host if request.client else "", settings, "sweep")
        except SettingError as e:
            return _error(400, str(e), e.field)
        except PlaygroundRefused as e:
            return _error(e.status, str(e))
        return JSONResponse(result)

    async def live(self) -> JSONResponse:
        if self.live_view is None or self.bursts is None:
            return _error(409, "no deployment here: the live view needs `pdserve serve --explorer-port N`")
        snapshot = await self.live_view.snapshot()
        snapshot["bursts"] = self.bursts.to_json()
        return JSONResponse(snapshot)

    async def burst(self, request: Request) -> JSONResponse:
        if self.router is None or self.bursts is None:
            return _error(409, "no deployment here: bursts need `pdserve serve --explorer-port N`")
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise SettingError("body", "expected a JSON object")
            known = {f.name for f in fields(BurstSpec)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise SettingError(unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
            status = self.bursts.start(BurstSpec(**body))
        except BurstBusy as e:
            return _error(429, str(e))
        except SettingError as e:
            return _error(400, str(e), e.field)
        except ValueError as e:
            field, _, _ = str(e).partition(":")
            return _error(400, str(e), field if field in {f.name for f in fields(BurstSpec)} else None)
        return JSONResponse(asdict(status), status_code=202)

    async def close(self) -> None:
        if self.bursts is not None:
            await self.bursts.close()
        self.runner.close()


class PlaygroundRefused(Exception):
    """A playground run that was not run: ``status`` 409 (replaced by a newer one), 429 (busy), 503 (too long)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


RunKind = Literal["playground", "sweep"]


def _run_in_worker(kind: RunKind, settings: PlaygroundSettings) -> tuple[bool, Any]:
    """In the worker process: ``(True, result)``, or ``(False, (field, message))`` for a SettingError."""
    from pdserve.explorer.playground import run_chunk_sweep, run_playground

    try:
        return True, (run_playground if kind == "playground" else run_chunk_sweep)(settings)
    except SettingError as e:
        return False, (e.field, str(e).removeprefix(f"{e.field}: "))


class PlaygroundRunner:
    """Runs ``run_playground`` and ``run_chunk_sweep`` in one worker process (started on first use), one run
    at a time.

    Each client (by address) has at most one run of each kind waiting: a newer one replaces it, and the older is
    answered 409. At most ``max_waiting`` runs wait (429 beyond). A run over ``timeout_s`` is stopped by
    killing the worker process (503); the next run starts a fresh one.
    """

    def __init__(self, max_waiting: int = MAX_WAITING_RUNS, timeout_s: float = RUN_TIMEOUT_S) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._waiting: dict[tuple[str, RunKind], tuple[PlaygroundSettings, asyncio.Future[dict[str, Any]]]] = {}
        self._drainer: asyncio.Task[None] | None = None
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, client: str, settings: PlaygroundSettings, kind: RunKind = "playground") -> dict[str, Any]:
        """The run's result; raises SettingError (the profile cannot take it) or PlaygroundRefused."""
        key = (client, kind)
        older = self._waiting.pop(key, None)
        if older is not None:
            older[1].set_exception(PlaygroundRefused(409, "replaced by a newer playground run from the same client"))
        elif len(self._waiting) >= self.max_waiting:
            raise PlaygroundRefused(429, f"{len(self._waiting)} playground runs are waiting; try again shortly")
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = (settings, answer)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        try:
            return await answer
        finally:
            if self._waiting.get(key, (None, None))[1] is answer:  # its client went away while it waited
                del self._waiting[key]

    async def _drain(self) -> None:
        while self._waiting:
            key = next(iter(self._waiting))
            settings, answer = self._waiting.pop(key)
            if answer.done():
                continue
            try:
                result = await self._in_worker(key[1], settings)
            except Exception as e:
                if not answer.done():
                    answer.set_exception(e)
            else:
                if not answer.done():
                    answer.set_result(result)

    async def _in_worker(self, kind: RunKind, settings: PlaygroundSettings) -> dict[str, Any]:
        if self._pool is None:  # spawned: a fork of a process with Ray's and gRPC's threads is unsafe
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        future = asyncio.get_running_loop().run_in_executor(self._pool, _run_in_worker, kind, settings)
        try:
            ok, value = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            self.close()
            raise PlaygroundRefused(
                503, f"the playground run took over {self.timeout_s:g} s and was stopped: try smaller settings"
            ) from None
        if not ok:
            raise SettingError(*value)
        return value

    def close(self) -> None:
        """Stop the worker process (a run in it is killed)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):  # shutdown() alone waits for a run
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
