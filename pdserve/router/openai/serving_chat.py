"""``POST /v1/chat/completions`` (as vLLM's ``serving_chat.py``): a conversation rendered with the model's chat
template, ``n`` choices, the chat shape of log-probabilities, and vLLM's ``prompt_logprobs`` (on the answer).

A request without ``max_tokens`` / ``max_completion_tokens`` gets at most ``RouterConfig.default_chat_max_tokens``,
and no more than the room its prompt leaves in the context; an explicit one that does not fit is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from pdserve.messages import Logprob, PromptLogprob
from pdserve.router.choices import Choices
from pdserve.router.openai.protocol import ChatCompletionRequest, bad_request
from pdserve.router.openai.serving import OpenAIServing, choice_fields, metrics_field, sse_frame, usage
from pdserve.router.openai.serving_completion import vllm_prompt_logprobs


def render_chat(tokenizer: Any, messages: Iterable[dict[str, str]]) -> str:
    """A chat as one prompt string, ending where the assistant's reply starts: the model's chat template
    (from its GGUF file or ``tokenizer_config.json``), or for models without one the tokenizer's plain
    template, one ``"<role>: <content>"`` line per message then ``"assistant: "``."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)


class OpenAIServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    prompt_param = "messages"

    async def start(self, body: ChatCompletionRequest, request_id: str) -> Choices:
        self.check_model(body.model)
        body.check()
        tokenizer = self.router.tokenizer
        if tokenizer is None:
            raise bad_request("messages: this model has no tokenizer, so it cannot chat", "messages")
        prompt = render_chat(tokenizer, body.chat())
        max_tokens = body.max_completion_tokens or body.max_tokens
        default = min(self.router.config.default_chat_max_tokens, self.router.limits.max_model_len)
        fit = max_tokens is None  # the default shrinks to the room the prompt leaves; an explicit value must fit
        return await self.start_choices(body, request_id, [prompt], max_tokens or default, fit)

    async def whole(self, choices: Choices, body: ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        answers = await choices.collect()
        out = []
        for choice, answer in zip(choices.choices, answers, strict=True):
            content: dict[str, Any] = {"message": {"role": "assistant", "content": answer.text}}
            if answer.logprobs is not None:
                content["logprobs"] = self._logprobs(answer.token_ids, answer.logprobs)
            out.append(choice_fields(choice, content, answer.token_ids, answer.finish_reason, body))
        extra: dict[str, Any] = {}
        if body.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self._prompt_logprobs(body, answers[0].prompt_logprobs)
        frame = self.frame(request_id, stream=False)
        return {**frame, "choices": out, **extra, "usage": usage(choices), **metrics_field(choices)}

    def stream(self, choices: Choices, body: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        frame = self.frame(request_id, stream=True)
        return sse_frame(self._chunks(choices, body), choices, frame, include_usage, self.prompt_param)

    async def _chunks(self, choices: Choices, body: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        """The first chunk of a choice carries the assistant's role; its last one only its finish reason
        (unless it has text)."""
        started: set[int] = set()
        async for choice, event in choices.events():
            text, reason = event.text, event.finish_reason
            first = choice.index not in started
            if not first and not text and reason is None and not event.logprobs:
                if not (body.return_token_ids and event.token_ids):
                    continue
            started.add(choice.index)
            delta = (
                {"role": "assistant", "content": text} if first else {"content": text} if text or reason is None else {}
            )
            content: dict[str, Any] = {"delta": delta}
            if event.logprobs is not None:
                content["logprobs"] = self._logprobs(event.token_ids, event.logprobs)
            chunk: dict[str, Any] = {"choices": [choice_fields(choice, content, event.token_ids, reason, body)]}
            if first and body.prompt_logprobs is not None and choice.index == 0:
                chunk["prompt_logprobs"] = self._prompt_logprobs(body, event.prompt_logprobs)
            yield chunk

    def _prompt_logprobs(
        self, body: ChatCompletionRequest, logprobs: list[PromptLogprob] | None
    ) -> list[dict[str, Any] | None] | None:
        if logprobs is None:
            return None
        tokenizer = self.tokenizer("messages")
        return vllm_prompt_logprobs(self, tokenizer.encode(render_chat(tokenizer, body.chat())), logprobs)

    def _logprobs(self, token_ids: list[int], logprobs: list[Logprob]) -> dict[str, Any]:
        """The chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**entry(t, lp), "top_logprobs": [entry(alt, v) for alt, v in top]}
            for t, (lp, top) in zip(token_ids, logprobs, strict=False)
        ]
        return {"content": content}
