"""The explorer's routes: one static page and its JSON endpoints, on a FastAPI app.

- ``GET /`` and ``GET /explorer``: the page (``static/index.html``; its script and style under
  ``/explorer/static/``; nothing is loaded from elsewhere).
- ``GET /explorer/api/options``: the profiles, the controls' defaults and limits, whether a deployment
  is attached (the live view).
- ``POST /explorer/api/playground``: a JSON object of ``PlaygroundSettings`` → ``run_playground``'s
  result. One run at a time, in a thread (the simulator is CPU work; the router's loop keeps serving).
- ``GET /explorer/api/live``: ``LiveView.snapshot`` and the recent bursts (409 without a deployment).
- ``POST /explorer/api/burst``: a JSON object of ``BurstSpec`` fields → the burst's status (202).

A bad value answers 400 with ``{"error": {"message", "field"}}``; the page shows the message.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pdserve.explorer.live import Bursts, BurstSpec, LiveView
from pdserve.explorer.playground import MAX_CHUNKS, MAX_DECODES, MAX_INSTANCES, MODES, PlaygroundSettings, SettingError
from pdserve.router.router import Router

STATIC = Path(__file__).parent / "static"


def build_explorer_app(router: Router | None = None) -> FastAPI:
    """An app with only the explorer (``pdserve sim --serve``: the playground, no deployment)."""
    app = FastAPI(title="pdserve explorer", docs_url=None, redoc_url=None, openapi_url=None)
    add_explorer(app, router)
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
        self._sim_lock = asyncio.Lock()

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
            "modes": list(MODES),
            "defaults": asdict(PlaygroundSettings()),
            "limits": {"max_chunks": MAX_CHUNKS, "max_decodes": MAX_DECODES, "max_instances": MAX_INSTANCES},
            "live": self.router is not None,
            "burst_defaults": asdict(BurstSpec()),
            "default_mode": self.router.config.default_mode if self.router is not None else None,
        }

    async def playground(self, request: Request) -> JSONResponse:
        from pdserve.explorer.playground import run_playground

        try:
            settings = PlaygroundSettings.parse(await _json_body(request))
            async with self._sim_lock:
                result = await asyncio.to_thread(run_playground, settings)
        except SettingError as e:
            return _error(400, str(e), e.field)
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
        except SettingError as e:
            return _error(400, str(e), e.field)
        except ValueError as e:
            field, _, _ = str(e).partition(":")
            return _error(400, str(e), field if field in {f.name for f in fields(BurstSpec)} else None)
        return JSONResponse(asdict(status), status_code=202)

    async def close(self) -> None:
        if self.bursts is not None:
            await self.bursts.close()
