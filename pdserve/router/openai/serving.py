"""What the generation endpoints share (as vLLM's ``serving_engine.py``): the served model's name, routing a
request's choices (``Choices``) with refusals turned into OpenAI errors, and the frame of an answer.

An endpoint (``OpenAIServingCompletion``, ``OpenAIServingChat``) starts a request with ``start`` (which returns
once every choice has its first event, so a refusal still gets its HTTP status), then answers with ``whole``
(a JSON body, once every choice has ended) or ``stream`` (server-sent events: a chunk per router event with
news, then the usage if asked, then ``[DONE]``; a failure mid-stream is a last ``data: {"error": ...}`` event
before ``[DONE]``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdserve.router.choices import Choice, Choices
from pdserve.router.openai.protocol import ApiError, SamplingRequest, api_error, bad_request
from pdserve.router.router import RequestError, Router


class OpenAIServing:
    """One endpoint family serving ``router``'s model under ``model_name``. Subclasses name their objects."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    prompt_param = "prompt"  # the field a refused prompt is blamed on

    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    async def start_choices(
        self,
        body: SamplingRequest,
        request_id: str,
        prompts: Sequence[str | list[int]],
        max_tokens: int,
        fit_max_tokens: bool = False,
    ) -> Choices:
        """Route ``n`` choices of every prompt (``Choices.start``); a refusal is raised as an ``ApiError``."""
        params = body.sampling_params(max_tokens)
        try:
            return await Choices.start(
                self.router,
                request_id,
                prompts,
                params,
                body.n or 1,
                body.pdserve_mode,
                body.stop_strings(),
                body.stream_interval or 0,
                fit_max_tokens,
            )
        except RequestError as e:
            raise api_error(e, self.prompt_param) from None

    def frame(self, request_id: str, stream: bool) -> dict[str, Any]:
        """The fields every answer (or chunk) starts with."""
        return {
            "id": request_id,
            "object": self.chunk_object_name if stream else self.object_name,
            "created": int(time.time()),
            "model": self.model_name,
        }

    def tokenizer(self, param: str) -> Any:
        if self.router.tokenizer is None:
            raise bad_request(f"{param}: this model has no tokenizer to turn token ids into text", param)
        return self.router.tokenizer

    def token_text(self, token: int) -> str:
        tokenizer = self.router.tokenizer
        return tokenizer.decode([token]) if tokenizer is not None else ""


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's reasons: stop, length; anything else (an abort) as "abort"."""
    return reason if reason in (None, "stop", "length") else "abort"


def choice_fields(
    choice: Choice, content: dict[str, Any], token_ids: list[int], reason: str | None, body: SamplingRequest
) -> dict[str, Any]:
    """A choice of an answer (or chunk): its index, content, ``finish_reason`` and (if asked) ``token_ids``;
    ``logprobs`` is null unless ``content`` sets it."""
    fields = {"index": choice.index, "logprobs": None, **content, "finish_reason": finish_reason(reason)}
    if body.return_token_ids:
        fields["token_ids"] = token_ids
    return fields


def usage(choices: Choices, completion_tokens: bool = True) -> dict[str, int]:
    """Prompt tokens count once per prompt (not per choice), completion tokens once per choice (none with
    ``completion_tokens`` False: an answer that returns the prompt only)."""
    prompt = sum(c.metrics.num_prompt_tokens for c in choices.choices[:: choices.n] if c.metrics is not None)
    output = 0
    if completion_tokens:
        output = sum(c.metrics.num_output_tokens if c.metrics is not None else c.num_tokens for c in choices.choices)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def metrics_field(choices: Choices) -> dict[str, Any]:
    """``pdserve_metrics``: the request's metrics, or with several choices a list of them by choice index."""
    if len(choices.choices) == 1:
        metrics = choices.choices[0].metrics
        return {"pdserve_metrics": metrics._asdict()} if metrics is not None else {}
    return {"pdserve_metrics": [c.metrics._asdict() if c.metrics is not None else None for c in choices.choices]}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_frame(
    events: AsyncIterator[dict[str, Any]],
    choices: Choices,
    frame: dict[str, Any],
    include_usage: bool,
    prompt_param: str,
    completion_tokens: bool = True,
) -> AsyncIterator[str]:
    """``events`` (chunks without their frame) as server-sent events, then ``pdserve_metrics`` (on the last chunk
    of one choice, on a chunk of its own with several), the usage if asked, and ``[DONE]``. A RequestError
    mid-stream becomes a last error event."""
    try:
        async for chunk in events:
            last = len(choices.choices) == 1 and any(c["finish_reason"] is not None for c in chunk["choices"])
            yield sse({**frame, **chunk, "usage": None, **(metrics_field(choices) if last else {})})
        if len(choices.choices) > 1:
            yield sse({**frame, "choices": [], "usage": None, **metrics_field(choices)})
        if include_usage:
            yield sse({**frame, "choices": [], "usage": usage(choices, completion_tokens)})
    except RequestError as e:
        yield sse(api_error(e, prompt_param).body())
    yield "data: [DONE]\n\n"
