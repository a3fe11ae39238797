"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn), in the router process, on the same ``Router``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events, or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). One choice per
request (``n=1``) and one prompt per request. Sampling: ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop`` (up to 4 strings; the text
is cut before the first match and the request ends with ``finish_reason="stop"``),
``stream_options.include_usage``. Extensions, as in vLLM: ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (each choice carries the ``token_ids`` it adds); pdserve's
own: request field ``pdserve_mode`` (colocated, disaggregated, auto) and response field
``pdserve_metrics`` (the ``RequestMetrics``; on the last chunk of a stream). A client's
``X-Request-Id`` header becomes the request id the router and workers log (else ``cmpl-…`` /
``chatcmpl-…``); the response echoes it.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a bad parameter
400, an unknown model 404, a request id in use 409, overload (RESOURCE_EXHAUSTED) 429, no worker
(UNAVAILABLE) 503. A failure after a stream has started arrives as a last ``data: {"error": …}``
event. ``code`` is the router's gRPC status name in lower case (``invalid_argument``, …) or
``model_not_found``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.metrics import CONTENT_TYPE_LATEST
from pdserve.router.router import GenerateInput, RequestError, Router, RouterEvent
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdserve.messages import RequestMetrics

log = logging.getLogger(__name__)

MODES = ("colocated", "disaggregated", "auto")
MAX_STOP_STRINGS = 4
_INT64 = 1 << 63

_HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "CANCELLED": (499, "cancelled"),
}


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_argument")


def api_error(e: RequestError, prompt_param: str = "prompt") -> ApiError:
    """A router error as an HTTP one; an INVALID_ARGUMENT's ``param`` is the field its message names."""
    status, type_ = _HTTP_STATUS.get(e.code, (500, "server_error"))
    message = str(e)
    param = None
    if e.code == "INVALID_ARGUMENT":
        head = message.split(":", 1)[0]
        if head.isidentifier():
            param = prompt_param if head == "prompt" else head
    return ApiError(status, message, type_, param, e.code.lower())


# ---- request bodies ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored; known ones pdserve lacks are refused."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: StrictInt | None = Field(None, ge=-1)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    return_token_ids: StrictBool = False
    # pdserve's extension
    pdserve_mode: Literal["colocated", "disaggregated", "auto"] | None = None

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise bad_request("n: only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name}: not supported (only 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias: not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise bad_request(f"stop: up to {MAX_STOP_STRINGS} non-empty strings", "stop")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(0, self.top_k or 0),
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=self.seed,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:  # SamplingParams names the field first
            raise bad_request(str(e), str(e).split()[0]) from None


class CompletionRequest(_Sampling):
    prompt: (
        StrictStr
        | list[StrictStr]
        | list[Annotated[int, Field(strict=True)]]
        | list[list[Annotated[int, Field(strict=True)]]]
    )
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("prompt: one prompt per request (batches are not supported)", "prompt")
            p = p[0]
        if not p:
            raise bad_request("prompt: must not be empty", "prompt")
        return p  # type: ignore[return-value]

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("echo: not supported", "echo")
        if self.logprobs is not None:
            raise bad_request("logprobs: not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("best_of: only 1 is supported", "best_of")
        if self.suffix:
            raise bad_request("suffix: not supported", "suffix")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs: not supported", "logprobs")
        if self.tools:
            raise bad_request("tools: not supported", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")


# ---- chat prompts --------------------------------------------------------------------------------------


def render_chat(tokenizer: Any, messages: Iterable[dict[str, str]]) -> str:
    """A chat as one prompt string, ending where the assistant's reply starts.

    With a tokenizer that has a chat template (``apply_chat_template(messages, add_generation_prompt=True)``)
    that renders it. Otherwise a plain format: one ``"<role>: <content>"`` line per message, then
    ``"assistant:"`` (e.g. ``"system: Be brief.\\nuser: Hi\\nassistant:"``).
    """
    messages = list(messages)
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is not None:
        return apply(messages, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


# ---- stop strings --------------------------------------------------------------------------------------


class StopMatcher:
    """Cuts streamed text before the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to release, and whether a stop string matched (the text then ends before it)."""
        buffer = self.pending + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buffer[:cut], True
        hold = 0
        for k in range(min(len(buffer), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(buffer[-k:]) for s in self.stops):
                hold = k
                break
        self.pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


# ---- the app -------------------------------------------------------------------------------------------


class _Job:
    """One request through the router, as both endpoints serve it."""

    def __init__(self, router: Router, request_id: str, body: _Sampling, stream: AsyncIterator[RouterEvent]):
        self.router = router
        self.request_id = request_id
        self.stream = stream
        self.stop = StopMatcher(body.stop_strings()) if body.stop else None
        self.num_tokens = 0

    async def events(self, first: RouterEvent | None) -> AsyncIterator[tuple[str, list[int], str | None, Any]]:
        """(text, token ids, finish reason, metrics) per router event, with stop strings applied."""
        try:
            if first is not None:
                out = self._apply(first)
                yield out
                if out[2] is not None:
                    return
            async for event in self.stream:
                out = self._apply(event)
                yield out
                if out[2] is not None:
                    return
        finally:
            await self.stream.aclose()

    def _apply(self, event: RouterEvent) -> tuple[str, list[int], str | None, Any]:
        self.num_tokens += len(event.token_ids)
        if self.stop is None:
            return event.text, event.token_ids, event.finish_reason, event.metrics
        text, matched = self.stop.push(event.text)
        if matched:
            metrics = event.metrics if event.metrics is not None else self.router.stopped(self.request_id)
            return text, event.token_ids, "stop", metrics
        if event.finish_reason is not None:
            text += self.stop.flush()
        return text, event.token_ids, event.finish_reason, event.metrics


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "abort"


def _usage(metrics: RequestMetrics | None, num_tokens: int) -> dict[str, int]:
    prompt = metrics.num_prompt_tokens if metrics is not None else 0
    output = metrics.num_output_tokens if metrics is not None else num_tokens
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def build_app(router: Router, model_name: str, auth_token: str | None = None) -> FastAPI:
    """The HTTP app serving ``router``'s model under ``model_name`` (the ``model`` clients must send).

    With ``auth_token``, every ``/v1/`` call needs ``Authorization: Bearer <token>`` (an OpenAI client's
    ``api_key``); ``/health`` and ``/metrics`` stay open for probes and scrapers.
    """
    app = FastAPI(title="pdserve", description=__doc__, docs_url="/docs", redoc_url=None)
    expected = f"Bearer {auth_token}".encode() if auth_token else None

    @app.middleware("http")
    async def _bearer_token(request: Request, call_next: Any) -> Any:
        if expected is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                message = "missing or wrong bearer token (Authorization header / api_key)"
                return ApiError(401, message, "invalid_request_error", None, "invalid_api_key").response()
        return await call_next(request)

    created = int(time.time())
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "pdserve"}

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"request body is not valid JSON: {first.get('msg', '')}", None).response()
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return bad_request(message, param).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", None, "internal").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, status = await router.health()
        return JSONResponse({"ok": ok, "status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.scrape(router), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(model_id)
        return model_card

    def _check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    async def _start(
        request: Request, body: _Sampling, prompt: str | list[int], max_tokens: int, prefix: str, prompt_param: str
    ) -> tuple[_Job, RouterEvent | None]:
        """Route the request and wait for its first event, so that a refusal gets its HTTP status."""
        request_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        params = body.sampling_params(max_tokens)
        stream = router.generate(GenerateInput(request_id, prompt, params, body.pdserve_mode))
        job = _Job(router, request_id, body, stream)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        except RequestError as e:
            raise api_error(e, prompt_param) from None
        return job, first

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        body.check()
        prompt = body.single_prompt()
        job, first = await _start(request, body, prompt, body.max_tokens or 16, "cmpl", "prompt")
        base = {"id": job.request_id, "object": "text_completion", "created": int(time.time()), "model": model_name}
        headers = {"X-Request-Id": job.request_id}
        if body.stream:
            return StreamingResponse(
                _stream_completion(job, first, base, body), media_type="text/event-stream", headers=headers
            )
        text, token_ids, reason, metrics = await _collect(job, first)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(reason)}
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        return JSONResponse(
            {**base, "choices": [choice], "usage": _usage(metrics, job.num_tokens), **_ext(metrics)}, headers=headers
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        body.check()
        tokenizer = router.tokenizer
        if tokenizer is None:
            raise bad_request("messages: this model has no tokenizer, so it cannot chat", "messages")
        prompt = render_chat(tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens or router.limits.max_model_len
        job, first = await _start(request, body, prompt, max_tokens, "chatcmpl", "messages")
        base = {"id": job.request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        headers = {"X-Request-Id": job.request_id}
        if body.stream:
            base["object"] = "chat.completion.chunk"
            return StreamingResponse(
                _stream_chat(job, first, base, body), media_type="text/event-stream", headers=headers
            )
        text, token_ids, reason, metrics = await _collect(job, first)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": _finish_reason(reason),
        }
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        return JSONResponse(
            {**base, "choices": [choice], "usage": _usage(metrics, job.num_tokens), **_ext(metrics)}, headers=headers
        )

    return app


def _ext(metrics: RequestMetrics | None) -> dict[str, Any]:
    return {"pdserve_metrics": metrics._asdict()} if metrics is not None else {}


async def _collect(job: _Job, first: RouterEvent | None) -> tuple[str, list[int], str | None, RequestMetrics | None]:
    texts: list[str] = []
    token_ids: list[int] = []
    reason, metrics = None, None
    try:
        async with contextlib.aclosing(job.events(first)) as events:
            async for text, ids, finish, meta in events:
                texts.append(text)
                token_ids.extend(ids)
                reason, metrics = finish, meta
    except RequestError as e:
        raise api_error(e) from None
    return "".join(texts), token_ids, reason, metrics


async def _stream_completion(
    job: _Job, first: RouterEvent | None, base: dict[str, Any], body: _Sampling
) -> AsyncIterator[str]:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    metrics = None
    try:
        async with contextlib.aclosing(job.events(first)) as events:
            async for text, ids, reason, metrics in events:
                if not text and reason is None and not (body.return_token_ids and ids):
                    continue
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": _finish_reason(reason),
                }
                if body.return_token_ids:
                    choice["token_ids"] = ids
                yield _sse({**base, "choices": [choice], **extra, **(_ext(metrics) if reason is not None else {})})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(metrics, job.num_tokens)})
    except RequestError as e:
        yield _sse(api_error(e).body())
    yield "data: [DONE]\n\n"


async def _stream_chat(
    job: _Job, first: RouterEvent | None, base: dict[str, Any], body: _Sampling
) -> AsyncIterator[str]:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    metrics = None
    role_sent = False
    try:
        async with contextlib.aclosing(job.events(first)) as events:
            async for text, ids, reason, metrics in events:
                if not text and reason is None and not (body.return_token_ids and ids):
                    continue
                if not role_sent:
                    delta: dict[str, Any] = {"role": "assistant", "content": text}
                    role_sent = True
                else:
                    delta = {"content": text} if text or reason is None else {}
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": _finish_reason(reason),
                }
                if body.return_token_ids:
                    choice["token_ids"] = ids
                yield _sse({**base, "choices": [choice], **extra, **(_ext(metrics) if reason is not None else {})})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(metrics, job.num_tokens)})
    except RequestError as e:
        yield _sse(api_error(e, "messages").body())
    yield "data: [DONE]\n\n"


# ---- serving -------------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn in a Ray actor's event loop: the process's signal handlers stay Ray's."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so several router processes can share ``port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class HttpServer:
    """An ASGI app served by uvicorn on a socket bound here; ``await start()``, then ``await stop()``."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.sock = reuse_port_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self._server = _Server(config)
        self._task: Any = None

    async def start(self, timeout_s: float = 30.0) -> int:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP server did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()


def metrics_app(router: Router) -> FastAPI:
    """Just ``GET /metrics`` (for ``--metrics-port``)."""
    app = FastAPI(title="pdserve metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.scrape(router), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = [
    "MODES",
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "HttpServer",
    "StopMatcher",
    "build_app",
    "metrics_app",
    "render_chat",
]
