"""``POST /v1/completions`` (as vLLM's ``serving_completion.py``): prompts as text, token ids or lists of
either, ``n`` choices each, ``echo``, and log-probabilities in the legacy shape.

``echo`` puts each prompt before its completion; with ``logprobs`` the prompt's tokens come first in the
choice's ``logprobs`` too (the first with a null log-probability: nothing precedes it), which is how
evaluation harnesses score a continuation (lm-evaluation-harness sends ``echo: true, logprobs: 1,
max_tokens: 1``; others ``max_tokens: 0``, which answers the prompt alone). vLLM's ``prompt_logprobs``
gives each choice the prompt's log-probabilities in vLLM's shape as well.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from pdserve.messages import Logprob, PromptLogprob
from pdserve.router.choices import Choice, Choices
from pdserve.router.openai.protocol import CompletionRequest
from pdserve.router.openai.serving import OpenAIServing, choice_fields, metrics_field, sse_frame, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's


class _Entry(NamedTuple):
    """One token of a choice's ``logprobs``: its text, log-probability (None for a prompt's first token), and
    the most likely tokens there (the token itself first, as vLLM answers)."""

    text: str
    logprob: float | None
    top: dict[str, float] | None


class _Prompt(NamedTuple):
    text: str
    token_ids: list[int] | None  # known when the answer lists the prompt's tokens


class OpenAIServingCompletion(OpenAIServing):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    prompt_param = "prompt"

    async def start(self, body: CompletionRequest, request_id: str) -> Choices:
        """Check ``body`` and route its choices (one generated token for an answer that echoes the prompt
        alone: the model must still run over the prompt, and that token is dropped)."""
        self.check_model(body.model)
        body.check()
        prompts = body.prompts()
        max_tokens = 1 if body.echo_only else body.max_tokens or DEFAULT_MAX_TOKENS
        return await self.start_choices(body, request_id, prompts, max_tokens)

    def _prompts(self, body: CompletionRequest) -> list[_Prompt]:
        """Each prompt as echoed: its text, and its tokens when the log-probabilities list them."""
        out = []
        listed = body.echo and body.logprobs is not None
        for prompt in body.prompts():
            if isinstance(prompt, str):
                ids = self.tokenizer("echo").encode(prompt) if listed else None
                out.append(_Prompt(prompt, ids))
            else:
                out.append(_Prompt(self.tokenizer("echo").decode(list(prompt)), list(prompt)))
        return out

    async def whole(self, choices: Choices, body: CompletionRequest, request_id: str) -> dict[str, Any]:
        """The whole answer, once every choice has ended."""
        prompts = self._prompts(body) if body.echo else []
        answers = await choices.collect()
        out = []
        for choice, answer in zip(choices.choices, answers, strict=True):
            text, ids, lps, reason = answer.text, answer.token_ids, answer.logprobs, answer.finish_reason
            if body.echo_only:
                text, ids, lps, reason = "", [], None, "length"
            content: dict[str, Any] = {"text": text}
            entries: list[_Entry] = []
            if body.echo:
                prompt = prompts[choice.prompt_index]
                content["text"] = prompt.text + text
                if body.logprobs is not None:
                    entries = self._prompt_entries(prompt, answer.prompt_logprobs)
            if body.logprobs is not None:
                content["logprobs"] = _legacy(entries + self._entries(ids, lps))
            if body.prompt_logprobs is not None:
                content["prompt_logprobs"] = self._vllm_prompt_logprobs(choice, answer.prompt_logprobs, body)
            out.append(choice_fields(choice, content, ids, reason, body))
        frame = self.frame(request_id, stream=False)
        return {**frame, "choices": out, "usage": usage(choices, not body.echo_only), **metrics_field(choices)}

    def stream(self, choices: Choices, body: CompletionRequest, request_id: str) -> AsyncIterator[str]:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        frame = self.frame(request_id, stream=True)
        return sse_frame(
            self._chunks(choices, body), choices, frame, include_usage, self.prompt_param, not body.echo_only
        )

    async def _chunks(self, choices: Choices, body: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        prompts = self._prompts(body) if body.echo else []
        offsets = {c.index: 0 for c in choices.choices}  # characters sent per choice (the logprobs' text_offset)
        started: set[int] = set()
        async for choice, event in choices.events():
            text, ids, lps, reason = event.text, event.token_ids, event.logprobs, event.finish_reason
            if body.echo_only:
                text, ids, lps, reason = "", [], None, "length" if event.finished else None
            first = choice.index not in started
            started.add(choice.index)
            content: dict[str, Any] = {"text": text}
            entries: list[_Entry] = []
            if first and body.echo:
                prompt = prompts[choice.prompt_index]
                content["text"] = prompt.text + text
                if body.logprobs is not None:
                    entries = self._prompt_entries(prompt, event.prompt_logprobs)
            if body.logprobs is not None and (entries or ids):
                content["logprobs"] = _legacy(entries + self._entries(ids, lps), offsets[choice.index])
            if first and body.prompt_logprobs is not None:
                content["prompt_logprobs"] = self._vllm_prompt_logprobs(choice, event.prompt_logprobs, body)
            offsets[choice.index] += len(content["text"])
            if (
                not content["text"]
                and reason is None
                and "logprobs" not in content
                and not (body.return_token_ids and ids)
            ):
                continue
            yield {"choices": [choice_fields(choice, content, ids, reason, body)]}

    def _entries(self, token_ids: list[int], logprobs: list[Logprob] | None) -> list[_Entry]:
        out = []
        for token, lp in zip(token_ids, logprobs or [], strict=False):
            value, top = lp
            text = self.token_text(token)
            out.append(_Entry(text, value, {text: value, **{self.token_text(t): v for t, v in top}}))
        return out

    def _prompt_entries(self, prompt: _Prompt, logprobs: list[PromptLogprob] | None) -> list[_Entry]:
        """The prompt's tokens: the first without a log-probability, each other with its own."""
        ids = prompt.token_ids or []
        out = [_Entry(self.token_text(ids[0]), None, None)] if ids else []
        for token, lp in zip(ids[1:], logprobs or [], strict=False):
            text = self.token_text(token)
            out.append(_Entry(text, lp.logprob, {text: lp.logprob, **{self.token_text(t): v for t, v in lp.top}}))
        return out

    def _vllm_prompt_logprobs(
        self, choice: Choice, logprobs: list[PromptLogprob] | None, body: CompletionRequest
    ) -> list[dict[str, Any] | None] | None:
        if logprobs is None:
            return None
        prompt = body.prompts()[choice.prompt_index]
        ids = self.tokenizer("prompt_logprobs").encode(prompt) if isinstance(prompt, str) else list(prompt)
        return vllm_prompt_logprobs(self, ids, logprobs)


def vllm_prompt_logprobs(
    serving: OpenAIServing, prompt_ids: list[int], logprobs: list[PromptLogprob]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the token itself and the most likely ones (their rank their place)."""
    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs, strict=False):
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": serving.token_text(token)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": serving.token_text(t)})
        out.append(entry)
    return out


def _legacy(entries: list[_Entry], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token text: logprob}, and each
    token's character offset in the choice's text (from ``offset``)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries],
        "text_offset": offsets,
    }
