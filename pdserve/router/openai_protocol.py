"""The OpenAI wire protocol of the HTTP front door (``http_api``): request bodies, errors, stop strings, answers.

Request models check what pdserve serves (one choice, one prompt, no penalties, …) and refuse the rest with
OpenAI's error body (``ApiError``). ``reply`` and ``stream_reply`` turn one routed request into a whole
answer or server-sent events; ``COMPLETION`` and ``CHAT`` say how each endpoint words them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Annotated, Any, Literal, NamedTuple

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import RequestMetrics
from pdserve.router.router import RequestError, Router, RouterEvent

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
    """A chat as one prompt string, ending where the assistant's reply starts: the model's chat template
    (from its GGUF file or ``tokenizer_config.json``), or for models without one the tokenizer's plain
    template, one ``"<role>: <content>"`` line per message then ``"assistant: "``."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)


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


# ---- answers -------------------------------------------------------------------------------------------


class Job:
    """One request through the router, as both endpoints serve it."""

    def __init__(self, router: Router, request_id: str, body: _Sampling, stream: AsyncGenerator[RouterEvent, None]):
        self.router = router
        self.request_id = request_id
        self.stream = stream
        self.stop = StopMatcher(body.stop_strings()) if body.stop else None
        self.num_tokens = 0

    async def events(self, first: RouterEvent | None) -> AsyncGenerator[tuple[str, list[int], str | None, Any], None]:
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


class Answer(NamedTuple):
    """How an endpoint words its answer: object names, a choice's content, the field a bad prompt is."""

    object: str
    chunk_object: str  # when streamed
    prompt_param: str  # names the prompt in a refusal before the first event
    content: Callable[[str], dict[str, Any]]  # a whole answer's choice content
    deltas: Callable[[], Callable[[str, str | None], dict[str, Any]]]  # per stream: its chunks' choice content


def _text(text: str, reason: str | None = None) -> dict[str, Any]:
    return {"text": text}


def _chat_deltas() -> Callable[[str, str | None], dict[str, Any]]:
    """The first chunk carries the assistant's role; the last only its finish reason (unless it has text)."""
    role_sent = False

    def delta(text: str, reason: str | None) -> dict[str, Any]:
        nonlocal role_sent
        if not role_sent:
            role_sent = True
            return {"delta": {"role": "assistant", "content": text}}
        return {"delta": {"content": text} if text or reason is None else {}}

    return delta


COMPLETION = Answer("text_completion", "text_completion", "prompt", _text, lambda: _text)
CHAT = Answer(
    "chat.completion",
    "chat.completion.chunk",
    "messages",
    lambda text: {"message": {"role": "assistant", "content": text}},
    _chat_deltas,
)


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "abort"


def _choice(content: dict[str, Any], token_ids: list[int], reason: str | None, body: _Sampling) -> dict[str, Any]:
    choice = {"index": 0, **content, "logprobs": None, "finish_reason": _finish_reason(reason)}
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def _usage(metrics: RequestMetrics | None, num_tokens: int) -> dict[str, int]:
    prompt = metrics.num_prompt_tokens if metrics is not None else 0
    output = metrics.num_output_tokens if metrics is not None else num_tokens
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def _ext(metrics: RequestMetrics | None) -> dict[str, Any]:
    return {"pdserve_metrics": metrics._asdict()} if metrics is not None else {}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def reply(
    job: Job, first: RouterEvent | None, base: dict[str, Any], body: _Sampling, answer: Answer
) -> dict[str, Any]:
    """The whole answer, once the request has ended."""
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
    choice = _choice(answer.content("".join(texts)), token_ids, reason, body)
    return {**base, "choices": [choice], "usage": _usage(metrics, job.num_tokens), **_ext(metrics)}


async def stream_reply(
    job: Job, first: RouterEvent | None, base: dict[str, Any], body: _Sampling, answer: Answer
) -> AsyncIterator[str]:
    """The answer as server-sent events: a chunk per router event with news, usage if asked, ``[DONE]``."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    content = answer.deltas()
    metrics = None
    try:
        async with contextlib.aclosing(job.events(first)) as events:
            async for text, ids, reason, metrics in events:
                if not text and reason is None and not (body.return_token_ids and ids):
                    continue
                choice = _choice(content(text, reason), ids, reason, body)
                yield _sse({**base, "choices": [choice], **extra, **(_ext(metrics) if reason is not None else {})})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(metrics, job.num_tokens)})
    except RequestError as e:
        yield _sse(api_error(e, answer.prompt_param).body())
    yield "data: [DONE]\n\n"


__all__ = [
    "CHAT",
    "COMPLETION",
    "MAX_STOP_STRINGS",
    "MODES",
    "Answer",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Job",
    "StopMatcher",
    "api_error",
    "bad_request",
    "render_chat",
    "reply",
    "stream_reply",
]
