"""The OpenAI API's request bodies and errors (as vLLM's ``protocol.py``): what a client may send, checked.

Request models accept what pdserve serves and refuse the rest (penalties, tools, ...) with OpenAI's error
body (``ApiError``), naming the field. Unknown fields are ignored, as OpenAI's own server does. The serving
modules (``serving_completion``, ``serving_chat``, ``serving_tokenization``) turn checked bodies into routed
requests and answers.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.messages import Mode
from pdserve.router.choices import MAX_CHOICES, MAX_STOP_STRINGS
from pdserve.router.router import RequestError

_INT64 = 1 << 63

_HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "CANCELLED": (499, "cancelled"),
}
_HTTP_TYPES = {
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def http_error(status: int, detail: str, headers: dict[str, str] | None = None) -> ApiError:
    """An HTTP-level refusal (no such route, method not allowed, …) in OpenAI's shape; ``code`` is its name."""
    try:
        name = HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        name = f"http_{status}"
    type_ = _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ApiError(status, detail, type_, None, name, headers)


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


class SamplingRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored; known ones pdserve lacks are refused."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: StrictInt | None = Field(None, ge=-1)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    return_token_ids: StrictBool = False
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # pdserve's extensions
    stream_interval: StrictInt | None = Field(None, ge=1)  # tokens per streamed chunk after the first
    pdserve_mode: Mode | None = None

    def check_common(self) -> None:
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

    def logprob_count(self) -> int | None:
        """How many most-likely tokens to report beside each sampled one; None: no log-probabilities."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """How many most-likely tokens to report beside each prompt token; None: no prompt log-probabilities."""
        return self.prompt_logprobs

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters for each choice (``Choices`` gives choice i the seed ``seed + i``)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(0, self.top_k or 0),
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=self.seed,
                logprobs=self.logprob_count(),
                prompt_logprobs=self.prompt_logprob_count(),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:  # SamplingParams names the field first
            raise bad_request(str(e), str(e).split()[0]) from None


class CompletionRequest(SamplingRequest):
    prompt: (
        StrictStr
        | list[StrictStr]
        | list[Annotated[int, Field(strict=True)]]
        | list[list[Annotated[int, Field(strict=True)]]]
    )
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo, the prompt alone (its log-probabilities)
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string, a list of strings, a list of token ids or a list of those."""
        p = self.prompt
        batch: list[Any] = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if not one:
                where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
                raise bad_request(f"{where}: must not be empty", "prompt")
        if len(batch) * (self.n or 1) > MAX_CHOICES:
            raise bad_request(
                f"prompt: {len(batch)} prompts x n={self.n or 1} is over the limit of {MAX_CHOICES} choices", "prompt"
            )
        return batch

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt (and its log-probabilities), nothing more."""
        return bool(self.echo) and self.max_tokens == 0

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        """vLLM's rule: ``prompt_logprobs`` when given, else with ``echo`` the ``logprobs`` count."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def check(self) -> None:
        self.check_common()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens: 0 only with echo (the prompt alone, to score it), else >= 1", "max_tokens")
        if self.best_of not in (None, 1):
            raise bad_request("best_of: not supported (only 1); for several completions use n", "best_of")
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: needs logprobs to be true", "top_logprobs")
        if self.tools:
            raise bad_request("tools: not supported", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    """``{"prompt": ...}`` or ``{"messages": [...]}`` (rendered with the chat template, as for chat)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[int, Field(strict=True, ge=0)]]


__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "SamplingRequest",
    "TokenizeRequest",
    "api_error",
    "bad_request",
    "http_error",
]
