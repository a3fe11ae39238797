"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn), in the router process, on the same ``Router``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``
and ``POST /detokenize`` (vLLM's shapes). ``n`` choices per prompt and lists of prompts (each choice its
own routed request; a seeded request's choice i draws from ``seed + i``), ``echo``. Sampling:
``max_tokens`` (chat: also ``max_completion_tokens``; a prompt plus max_tokens over the context is a
400; chat's default is the room the prompt leaves), ``temperature``, ``top_p``, ``seed``, ``stop`` (up to
4 strings; the text is cut before the first match and the request ends with ``finish_reason="stop"``),
``stream_options.include_usage``. Extensions, as in vLLM: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (each choice carries the ``token_ids`` it adds); pdserve's
own: request fields ``pdserve_mode`` (colocated, disaggregated, auto) and ``stream_interval`` (tokens per
streamed chunk after the first), response field ``pdserve_metrics`` (the ``RequestMetrics``, a list by
choice index with several choices; on the last chunk of a stream). A client's
``X-Request-Id`` header becomes the request id the router and workers log (else ``cmpl-…`` /
``chatcmpl-…``); the response echoes it.

Chat requests without ``max_tokens`` / ``max_completion_tokens`` get at most
``RouterConfig.default_chat_max_tokens``, and no more than the room the prompt leaves in the context
(completions: 16, as OpenAI's). A request that asks for more than that room is refused (400).

Limits: a request body over ``RouterConfig.max_request_bytes`` is answered 413 before it is parsed; a
client that disconnects before its answer is complete has its request aborted on the workers (streamed
or not). With a bearer token, ``/v1/``, ``/tokenize``, ``/detokenize`` and the explorer's ``/explorer/api/``
need it. With a certificate
and key (``ServerSecurity``) the server speaks HTTPS only.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, whatever the status: a
bad parameter 400, a missing token 401 (with ``WWW-Authenticate``), an unknown model or route 404, a
wrong method 405, a request id in use 409, a body too large 413, overload (RESOURCE_EXHAUSTED, also a
request that waited past ``max_queue_time_s``) 429, no worker (UNAVAILABLE) 503. There is no ``/docs``
page (it would load its scripts from a CDN); the schema is ``/openapi.json``. A failure after a stream
has started arrives as a last ``data: {"error": …}`` event. ``code`` is the router's gRPC status name in
lower case (``invalid_argument``, …) or ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.metrics import CONTENT_TYPE_LATEST
from pdserve.router.openai_protocol import (
    CHAT,
    COMPLETION,
    Answer,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StopMatcher,
    TokenizeRequest,
    bad_request,
    detokenize,
    http_error,
    render_chat,
    reply,
    start_jobs,
    stream_reply,
    tokenize,
)
from pdserve.router.router import Router
from pdserve.router.server import has_bearer_token

log = logging.getLogger(__name__)


# behind the bearer token, when one is set
PROTECTED_PREFIXES = ("/v1/", "/explorer/api/", "/tokenize", "/detokenize")


def build_app(router: Router, model_name: str, auth_token: str | None = None) -> FastAPI:
    """The HTTP app serving ``router``'s model under ``model_name`` (the ``model`` clients must send).

    With ``auth_token``, every ``/v1/``, ``/tokenize``, ``/detokenize`` (and explorer ``/explorer/api/``) call
    needs ``Authorization: Bearer <token>`` (an OpenAI client's ``api_key``); ``/health`` and ``/metrics`` stay
    open for probes and scrapers. A body over ``router.config.max_request_bytes`` is refused (413) before it is parsed.
    """
    # No /docs page: FastAPI's loads its scripts from a CDN (blank offline); the schema is at /openapi.json.
    app = FastAPI(title="pdserve", description=__doc__, docs_url=None, redoc_url=None)
    app.add_middleware(FrontDoor, auth_token=auth_token, max_body_bytes=router.config.max_request_bytes)
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]  # Starlette types handlers by Exception
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    api = _Endpoints(router, model_name)
    app.get("/health")(api.health)
    _add_metrics(app, router)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    _add_tokenizer_routes(app, api)
    return app


def _add_tokenizer_routes(app: FastAPI, api: _Endpoints) -> None:
    """vLLM's ``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1/``)."""

    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            api._check_model(body.model)
        return await asyncio.to_thread(tokenize, api.router, body)  # a long text must not stall the streams

    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            api._check_model(body.model)
        return await asyncio.to_thread(detokenize, api.router, body)

    for prefix in ("", "/v1"):
        app.post(f"{prefix}/tokenize")(tokenize_route)
        app.post(f"{prefix}/detokenize")(detokenize_route)


def metrics_app(router: Router) -> FastAPI:
    """Just ``GET /metrics`` (for ``--metrics-port``)."""
    app = FastAPI(title="pdserve metrics", docs_url=None, redoc_url=None, openapi_url=None)
    _add_metrics(app, router)
    return app


def _add_metrics(app: FastAPI, router: Router) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.scrape(router), media_type=CONTENT_TYPE_LATEST)


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class FrontDoor:
    """ASGI middleware: the bearer token on ``PROTECTED_PREFIXES`` (when set), and the request body limit.

    A body whose ``Content-Length`` is over ``max_body_bytes`` is answered 413 unread; a body without one
    (chunked) is read up to the limit first, then handed on (413 once it passes the limit). A plain ASGI
    middleware, so streamed answers and client disconnects pass through untouched.
    """

    def __init__(self, app: Any, auth_token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.auth_token = auth_token
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        if self.auth_token is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            if not has_bearer_token(headers.get("authorization", b""), self.auth_token):
                why = "missing or wrong bearer token (Authorization header / api_key)"
                challenge = {"WWW-Authenticate": 'Bearer realm="pdserve"'}
                await _send_error(send, ApiError(401, why, "invalid_request_error", None, "invalid_api_key", challenge))
                return
        declared = headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, bad_request("Content-Length: not a number", None))
                return
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large(size))
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        size = 0
        while True:  # a chunked body: read it under the limit before anything parses it
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large(size, at_least=True))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> ApiError:
        over = f"over {size - 1}" if at_least else str(size)
        return ApiError(
            413,
            f"request body: {over} bytes is over the limit of {self.max_body_bytes} bytes (max_request_bytes)",
            "invalid_request_error",
            None,
            "request_too_large",
        )


async def _send_error(send: Send, error: ApiError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return e.response()


async def _http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (no such route 404, method not allowed 405, …) in OpenAI's error shape."""
    detail = e.detail if isinstance(e.detail, str) else str(e.detail)
    if e.status_code == 404:
        detail = f"{request.method} {request.url.path}: no such route"
    elif e.status_code == 405:
        detail = (
            f"{request.method} {request.url.path}: method not allowed (allowed: {(e.headers or {}).get('allow', '')})"
        )
    return http_error(e.status_code, detail, dict(e.headers) if e.headers else None).response()


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg', '')}", None).response()
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
    return bad_request(message, param).response()


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("HTTP %s %s failed", request.method, request.url.path)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", None, "internal").response()


class _Endpoints:
    """The endpoints of one app: ``router``'s model served under ``model_name``."""

    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pdserve"}

    async def health(self) -> JSONResponse:
        ok, status = await self.router.health()
        return JSONResponse({"ok": ok, "status": status}, status_code=200 if ok else 503)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self.model_card

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check()
        prompts = body.prompts()
        return await self._serve(request, body, prompts, body.max_tokens or 16, "cmpl", COMPLETION)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check()
        tokenizer = self.router.tokenizer
        if tokenizer is None:
            raise bad_request("messages: this model has no tokenizer, so it cannot chat", "messages")
        prompt = render_chat(tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens
        default = min(self.router.config.default_chat_max_tokens, self.router.limits.max_model_len)
        fit = max_tokens is None  # the default shrinks to the room the prompt leaves; an explicit value must fit
        return await self._serve(request, body, [prompt], max_tokens or default, "chatcmpl", CHAT, fit)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[str | list[int]],
        max_tokens: int,
        prefix: str,
        answer: Answer,
        fit_max_tokens: bool = False,
    ) -> Response:
        """Route the request's choices and wait for their first events (so that a refusal gets its HTTP status),
        then answer. A client that disconnects before that (or before a whole answer is ready) has its
        requests aborted."""
        request_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        echo = bool(getattr(body, "echo", False))
        starting = start_jobs(
            self.router, request_id, body, prompts, max_tokens, answer.prompt_param, fit_max_tokens, echo
        )
        try:
            jobs = await _unless_disconnected(request, starting)
        except ClientGone:
            return Response(status_code=499)
        base = {
            "id": request_id,
            "object": answer.chunk_object if body.stream else answer.object,
            "created": int(time.time()),
            "model": self.model_name,
        }
        headers = {"X-Request-Id": request_id}
        if body.stream:
            events = stream_reply(jobs, base, body, answer)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            whole = await _unless_disconnected(request, reply(jobs, base, body, answer))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted on the workers
        return JSONResponse(whole, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or ClientGone (``work`` cancelled) once the client has disconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read: the server's next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- serving -------------------------------------------------------------------------------------------


__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "FrontDoor",
    "StopMatcher",
    "build_app",
    "metrics_app",
    "render_chat",
]
