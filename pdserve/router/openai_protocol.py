"""The OpenAI wire protocol of the HTTP front door (``http_api``): request bodies, errors, stop strings, answers.

Request models check what pdserve serves (no penalties, no tools, …) and refuse the rest with OpenAI's
error body (``ApiError``). One HTTP request becomes one routed request per (prompt, choice): ``start_jobs``
routes them all and waits for each one's first event (so that a refusal gets its HTTP status), then
``reply`` and ``stream_reply`` turn them into a whole answer or server-sent events; ``COMPLETION`` and
``CHAT`` say how each endpoint words them. ``tokenize`` and ``detokenize`` answer vLLM's ``/tokenize``
and ``/detokenize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Annotated, Any, Literal, NamedTuple

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.messages import Mode, RequestMetrics
from pdserve.router.router import GenerateInput, Logprob, RequestError, Router, RouterEvent

MAX_STOP_STRINGS = 4
MAX_CHOICES = 64  # prompts x n in one request
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
    from http import HTTPStatus

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


class _Sampling(BaseModel):
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

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``choice`` of a prompt: a seeded request's choices draw from
        ``seed + choice`` (as vLLM's), so they differ yet reproduce."""
        seed = self.seed
        if seed is not None and choice:
            seed = (seed + choice + _INT64) % (2 * _INT64) - _INT64
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(0, self.top_k or 0),
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=seed,
                logprobs=self.logprob_count(),
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

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        self.check_common()
        if self.logprobs is not None and self.echo:
            raise bad_request(
                "logprobs: not served with echo (the prompt's log-probabilities are not computed)", "logprobs"
            )
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


class ChatCompletionRequest(_Sampling):
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


_JobEvent = tuple[str, list[int], str | None, Any, list[Logprob] | None]


class Job:
    """One routed request (one choice of one prompt), as both endpoints serve it."""

    def __init__(
        self,
        router: Router,
        request_id: str,
        body: _Sampling,
        stream: AsyncGenerator[RouterEvent, None],
        index: int = 0,
        echo: str = "",
    ):
        self.router = router
        self.request_id = request_id
        self.stream = stream
        self.index = index  # the choice's index in the answer
        self.echo = echo  # text the choice starts with (completions' echo: the prompt)
        self.stop = StopMatcher(body.stop_strings()) if body.stop else None
        self.num_tokens = 0
        self.first: RouterEvent | None = None
        self.metrics: RequestMetrics | None = None

    async def start(self) -> None:
        """Route the request: returns once its first event is here; raises RequestError if it was refused."""
        try:
            self.first = await anext(self.stream)
        except StopAsyncIteration:
            self.first = None

    async def events(self) -> AsyncGenerator[_JobEvent, None]:
        """(text, token ids, finish reason, metrics, logprobs) per router event, with stop strings applied."""
        try:
            if self.first is not None:
                out = self._apply(self.first)
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

    def _apply(self, event: RouterEvent) -> _JobEvent:
        self.num_tokens += len(event.token_ids)
        out = self._stopped(event)
        if out[3] is not None:
            self.metrics = out[3]
        return out

    def _stopped(self, event: RouterEvent) -> _JobEvent:
        if self.stop is None:
            return event.text, event.token_ids, event.finish_reason, event.metrics, event.logprobs
        text, matched = self.stop.push(event.text)
        if matched:
            metrics = event.metrics if event.metrics is not None else self.router.stopped(self.request_id)
            return text, event.token_ids, "stop", metrics, event.logprobs
        if event.finish_reason is not None:
            text += self.stop.flush()
        return text, event.token_ids, event.finish_reason, event.metrics, event.logprobs


async def start_jobs(
    router: Router,
    request_id: str,
    body: _Sampling,
    prompts: list[str | list[int]],
    max_tokens: int,
    prompt_param: str,
    fit_max_tokens: bool = False,
    echo: bool = False,
) -> list[Job]:
    """Route one request per (prompt, choice), all at once, and wait for each one's first event.

    One choice keeps ``request_id``; several are ``<request_id>-<index>``, index = prompt * n + choice
    (OpenAI's order). If any is refused, the others are ended and the refusal is raised as an ApiError.
    With ``echo`` each choice starts with its prompt's text.
    """
    n = body.n or 1
    many = len(prompts) * n > 1
    jobs = []
    for p, prompt in enumerate(prompts):
        echoed = _prompt_text(router, prompt) if echo else ""
        for c in range(n):
            index = p * n + c
            rid = f"{request_id}-{index}" if many else request_id
            params = body.sampling_params(max_tokens, c)
            stream = router.generate(
                GenerateInput(rid, prompt, params, body.pdserve_mode, fit_max_tokens, body.stream_interval or 0)
            )
            jobs.append(Job(router, rid, body, stream, index, echoed))
    try:
        started = await asyncio.gather(*(job.start() for job in jobs), return_exceptions=True)
    except BaseException:  # cancelled (the client left): end every choice's request now
        await asyncio.gather(*(job.stream.aclose() for job in jobs), return_exceptions=True)
        raise
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(job.stream.aclose() for job in jobs), return_exceptions=True)
        error = next((e for e in failed if isinstance(e, RequestError)), failed[0])
        if isinstance(error, RequestError):
            raise api_error(error, prompt_param) from None
        raise error
    return jobs


def _prompt_text(router: Router, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if router.tokenizer is None:
        raise bad_request("echo: this model has no tokenizer to turn token ids into text", "echo")
    return router.tokenizer.decode(list(prompt))


class Answer(NamedTuple):
    """How an endpoint words its answer: object names, a choice's content, the field a bad prompt is."""

    object: str
    chunk_object: str  # when streamed
    prompt_param: str  # names the prompt in a refusal before the first event
    content: Callable[[str], dict[str, Any]]  # a whole answer's choice content
    deltas: Callable[[], Callable[[str, str | None], dict[str, Any]]]  # per stream: its chunks' choice content
    logprobs: Callable[[Any, list[int], list[Logprob], int], dict[str, Any]]  # a choice's (or chunk's) logprobs


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


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else ""


def _completion_logprobs(tokenizer: Any, ids: list[int], logprobs: list[Logprob], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token text: logprob}, and each
    token's character offset in the choice's text (from ``offset``)."""
    tokens = [_token_text(tokenizer, t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [{_token_text(tokenizer, t): v for t, v in top} for _, top in logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(tokenizer: Any, ids: list[int], logprobs: list[Logprob], offset: int) -> dict[str, Any]:
    """The chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**entry(t, lp), "top_logprobs": [entry(alt, v) for alt, v in top]}
        for t, (lp, top) in zip(ids, logprobs, strict=False)
    ]
    return {"content": content}


COMPLETION = Answer("text_completion", "text_completion", "prompt", _text, lambda: _text, _completion_logprobs)
CHAT = Answer(
    "chat.completion",
    "chat.completion.chunk",
    "messages",
    lambda text: {"message": {"role": "assistant", "content": text}},
    _chat_deltas,
    _chat_logprobs,
)


def _finish_reason(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "abort"


def _choice(
    index: int,
    content: dict[str, Any],
    token_ids: list[int],
    reason: str | None,
    body: _Sampling,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": _finish_reason(reason)}
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def _usage(jobs: list[Job], n: int) -> dict[str, int]:
    """Prompt tokens count once per prompt (not per choice), completion tokens once per choice."""
    prompt = sum(j.metrics.num_prompt_tokens for j in jobs[::n] if j.metrics is not None)
    output = sum(j.metrics.num_output_tokens if j.metrics is not None else j.num_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def _ext(jobs: list[Job]) -> dict[str, Any]:
    """``pdserve_metrics``: the request's metrics, or with several choices a list of them by choice index."""
    if len(jobs) == 1:
        return {"pdserve_metrics": jobs[0].metrics._asdict()} if jobs[0].metrics is not None else {}
    return {"pdserve_metrics": [j.metrics._asdict() if j.metrics is not None else None for j in jobs]}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _collect(job: Job) -> tuple[str, list[int], str | None, list[Logprob] | None]:
    texts: list[str] = [job.echo]
    token_ids: list[int] = []
    reason = None
    logprobs: list[Logprob] | None = None
    async with contextlib.aclosing(job.events()) as events:
        async for text, ids, finish, _, lps in events:
            texts.append(text)
            token_ids.extend(ids)
            reason = finish
            if lps is not None:
                logprobs = (logprobs or []) + lps
    return "".join(texts), token_ids, reason, logprobs


async def reply(jobs: list[Job], base: dict[str, Any], body: _Sampling, answer: Answer) -> dict[str, Any]:
    """The whole answer, once every choice has ended."""
    tasks = [asyncio.ensure_future(_collect(job)) for job in jobs]
    try:
        results = await asyncio.gather(*tasks)
    except RequestError as e:
        raise api_error(e) from None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokenizer = jobs[0].router.tokenizer
    choices = [
        _choice(
            job.index,
            answer.content(text),
            ids,
            reason,
            body,
            None if lps is None else answer.logprobs(tokenizer, ids, lps, len(job.echo)),
        )
        for job, (text, ids, reason, lps) in zip(jobs, results, strict=True)
    ]
    return {**base, "choices": choices, "usage": _usage(jobs, body.n or 1), **_ext(jobs)}


_Event = tuple[Job, str, list[int], str | None, list[Logprob] | None]


async def _merged(jobs: list[Job]) -> AsyncGenerator[_Event, None]:
    """Every job's events as they come (one job: directly, without tasks)."""
    if len(jobs) == 1:
        async with contextlib.aclosing(jobs[0].events()) as events:
            async for text, ids, reason, _, lps in events:
                yield jobs[0], text, ids, reason, lps
        return
    queue: asyncio.Queue[_Event | BaseException | None] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with contextlib.aclosing(job.events()) as events:
                async for text, ids, reason, _, lps in events:
                    await queue.put((job, text, ids, reason, lps))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_reply(jobs: list[Job], base: dict[str, Any], body: _Sampling, answer: Answer) -> AsyncIterator[str]:
    """The answer as server-sent events: a chunk per router event with news (each carrying its choice's
    index, and ``usage: null``), then the usage if asked, then ``[DONE]``."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    deltas = {job.index: answer.deltas() for job in jobs}
    pending_echo = {job.index: job.echo for job in jobs if job.echo}
    offsets = dict.fromkeys(deltas, 0)  # per choice: characters sent so far (the logprobs' text_offset)
    tokenizer = jobs[0].router.tokenizer
    try:
        async with contextlib.aclosing(_merged(jobs)) as events:
            async for job, text, ids, reason, lps in events:
                if pending_echo:
                    text = pending_echo.pop(job.index, "") + text
                if not text and reason is None and not lps and not (body.return_token_ids and ids):
                    continue
                logprobs = None if lps is None else answer.logprobs(tokenizer, ids, lps, offsets[job.index])
                offsets[job.index] += len(text)
                choice = _choice(job.index, deltas[job.index](text, reason), ids, reason, body, logprobs)
                last = reason is not None and len(jobs) == 1
                yield _sse({**base, "choices": [choice], "usage": None, **(_ext(jobs) if last else {})})
        if len(jobs) > 1:
            yield _sse({**base, "choices": [], "usage": None, **_ext(jobs)})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(jobs, body.n or 1)})
    except RequestError as e:
        yield _sse(api_error(e, answer.prompt_param).body())
    yield "data: [DONE]\n\n"


# ---- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------------------


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


def _tokenizer_of(router: Router) -> Any:
    if router.tokenizer is None:
        raise bad_request("this model has no tokenizer", None)
    return router.tokenizer


def tokenize(router: Router, body: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` if asked) for a prompt or a chat."""
    tokenizer = _tokenizer_of(router)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    else:
        text = body.prompt
    tokens = tokenizer.encode(text)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": router.limits.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return out


def detokenize(router: Router, body: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt": text}`` for token ids of the vocabulary."""
    tokenizer = _tokenizer_of(router)
    bad = [t for t in body.tokens if t >= router.limits.vocab_size]
    if bad:
        raise bad_request(f"tokens: ids must be in [0, {router.limits.vocab_size}), got {bad[:5]}", "tokens")
    return {"prompt": tokenizer.decode(list(body.tokens))}


__all__ = [
    "CHAT",
    "COMPLETION",
    "MAX_CHOICES",
    "MAX_STOP_STRINGS",
    "Answer",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "Job",
    "StopMatcher",
    "TokenizeRequest",
    "api_error",
    "bad_request",
    "detokenize",
    "http_error",
    "render_chat",
    "reply",
    "start_jobs",
    "stream_reply",
    "tokenize",
]
