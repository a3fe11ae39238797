"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn; as vLLM's ``api_server.py``), in the router process,
on the same ``Router``: routes, the body limit and the bearer token here; what each endpoint answers in
``pdserve.router.openai`` (request bodies in ``protocol``, answers in ``serving_*``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``
and ``POST /detokenize`` (vLLM's shapes). ``n`` choices per prompt and lists of prompts (each choice its
own routed request; a seeded request's choice i draws from ``seed + i``), ``echo`` (with ``logprobs``, the
prompt's tokens and log-probabilities come first; ``max_tokens: 0`` answers the prompt alone). Sampling:
``max_tokens`` (chat: also ``max_completion_tokens``; a prompt plus max_tokens over the context is a
400; chat's default is the room the prompt leaves), ``temperature``, ``top_p``, ``seed``, ``stop`` (up to
4 strings; the text is cut before the first match and the request ends with ``finish_reason="stop"``),
``logprobs`` / ``top_logprobs``, ``stream_options.include_usage``. Extensions, as in vLLM: ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (each choice carries the ``token_ids`` it adds),
``prompt_logprobs``; pdserve's own: request fields ``pdserve_mode`` (colocated, disaggregated, auto) and
``stream_interval`` (tokens per streamed chunk after the first), response field ``pdserve_metrics`` (the
``RequestMetrics``, a list by choice index with several choices; on the last chunk of a stream). A client's
``X-Request-Id`` header becomes the request id the router and workers log (else ``cmpl-…`` /
``chatcmpl-…``); the response echoes it.

Limits: a request body over ``RouterConfig.max_request_bytes`` is answered 413 before it is parsed; a
client that disconnects before its answer is complete has its request aborted on the workers (streamed
or not). A POST body sent without a JSON content type is read as JSON. With a bearer token, ``/v1/``,
``/tokenize``, ``/detokenize`` and the explorer's ``/explorer/api/`` need it. With a certificate and key
(``ServerSecurity``) the server speaks HTTPS only.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, whatever the status: a
bad parameter 400, a missing token 401 (with ``WWW-Authenticate``), an unknown model or route 404, a
wrong method 405, a request id in use 409, a body too large 413, overload (RESOURCE_EXHAUSTED, also a
request that waited past ``max_queue_time_s``) 429, no worker or a server shutting down (UNAVAILABLE) 503.
There is no ``/docs`` page (it would load its scripts from a CDN); the schema is ``/openapi.json``. A
failure after a stream has started arrives as a last ``data: {"error": …}`` event, then ``data: [DONE]``.
``code`` is the router's gRPC status name in lower case (``invalid_argument``, …) or ``model_not_found``.
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
from pdserve.router.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    api_error,
    bad_request,
    http_error,
)
from pdserve.router.openai.serving_chat import OpenAIServingChat
from pdserve.router.openai.serving_completion import OpenAIServingCompletion
from pdserve.router.openai.serving_tokenization import OpenAIServingTokenization
from pdserve.router.router import RequestError, Router
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
        # in a thread: tokenizing a long text must not stall the streams
        return await asyncio.to_thread(api.tokenization.tokenize, body)

    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(api.tokenization.detokenize, body)

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


DISCARD_MIN_BYTES = 64 << 20  # a refused body is read and dropped up to this (or 16 x the limit, if more)...
DISCARD_TIMEOUT_S = 30.0  # ...for at most this long
_LENIENT_TYPES = (b"", b"application/x-www-form-urlencoded", b"text/plain")  # curl -d's default, none, plain text


class FrontDoor:
    """ASGI middleware: the bearer token on ``PROTECTED_PREFIXES`` (when set), the request body limit, and JSON
    bodies sent without their content type.

    A body whose ``Content-Length`` is over ``max_body_bytes`` is answered 413 unread; a body without one
    (chunked) is read up to the limit first, then handed on (413 once it passes the limit). The 413 goes out at
    once, and the rest of the body is then read and dropped (up to ``DISCARD_MIN_BYTES`` or 16 times the limit,
    for ``DISCARD_TIMEOUT_S``) before the connection closes: a client that sends its whole body before it reads
    (most do) gets the answer rather than a reset. A POST whose content type is missing, a form's (``curl -d``)
    or plain text is read as JSON, which every endpoint takes. A plain ASGI middleware, so streamed answers and
    client disconnects pass through untouched.
    """

    def __init__(self, app: Any, auth_token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.auth_token = auth_token
        self.max_body_bytes = max_body_bytes
        self.discard_bytes = max(DISCARD_MIN_BYTES, 16 * max_body_bytes)

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
        if scope.get("method") == "POST":
            scope = _as_json(scope, headers)
        declared = headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, bad_request("Content-Length: not a number", None))
                return
            if size > self.max_body_bytes:
                await self._refuse(send, receive, self._too_large(size), drain=size <= self.discard_bytes)
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
                more = message.get("more_body", False)
                await self._refuse(send, receive, self._too_large(size, at_least=True), drain=more, read=size)
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

    async def _refuse(self, send: Send, receive: Receive, error: ApiError, drain: bool, read: int = 0) -> None:
        """Answer ``error`` now and close the connection; with ``drain``, only once the rest of the body (from
        ``read`` bytes on) has been read and dropped, within the discard bounds."""
        response = error.response()
        headers = [*response.raw_headers, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": drain})
        if not drain:
            return
        deadline = time.monotonic() + DISCARD_TIMEOUT_S
        while read < self.discard_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
            if message["type"] != "http.request":
                break
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _as_json(scope: Scope, headers: dict[str, bytes]) -> Scope:
    """``scope`` with a JSON content type where the client sent none, a form's or plain text's."""
    content_type = headers.get("content-type", b"").split(b";")[0].strip().lower()
    if content_type not in _LENIENT_TYPES:
        return scope
    kept = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
    return {**scope, "headers": [*kept, (b"content-type", b"application/json")]}


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
        hint = "send a JSON object, Content-Type: application/json"
        why = f"request body is not valid JSON: {first.get('msg', '')} ({hint})"
        return bad_request(why, None).response()
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("model_attributes_type", "dict_type"):
        why = "request body: a JSON object is expected (send it with Content-Type: application/json)"
        return bad_request(why, None).response()
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
        self.completion = OpenAIServingCompletion(router, model_name)
        self.chat = OpenAIServingChat(router, model_name)
        self.tokenization = OpenAIServingTokenization(router, model_name)

    async def health(self) -> JSONResponse:
        ok, status = await self.router.health()
        return JSONResponse({"ok": ok, "status": status}, status_code=200 if ok else 503)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self.completion.check_model(model_id)
        return self.model_card

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve(request, body, self.completion, "cmpl")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(request, body, self.chat, "chatcmpl")

    async def _serve(
        self,
        request: Request,
        body: Any,
        serving: OpenAIServingCompletion | OpenAIServingChat,
        prefix: str,
    ) -> Response:
        """Route the request's choices and wait for their first events (so that a refusal gets its HTTP status),
        then answer. A client that disconnects before that (or before a whole answer is ready) has its
        requests aborted."""
        request_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        try:
            choices = await _unless_disconnected(request, serving.start(body, request_id))
        except ClientGone:
            return Response(status_code=499)
        headers = {"X-Request-Id": request_id}
        if body.stream:
            return StreamingResponse(
                serving.stream(choices, body, request_id), media_type="text/event-stream", headers=headers
            )
        try:
            whole = await _unless_disconnected(request, serving.whole(choices, body, request_id))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted on the workers
        except RequestError as e:
            raise api_error(e, serving.prompt_param) from None
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


__all__ = ["FrontDoor", "build_app", "metrics_app"]
