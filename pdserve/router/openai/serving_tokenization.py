"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (as its ``serving_tokenization.py``): the served model's
tokenizer, with the ids the engine uses."""

from __future__ import annotations

from typing import Any

from pdserve.router.openai.protocol import DetokenizeRequest, TokenizeRequest, bad_request
from pdserve.router.openai.serving import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def _tokenizer(self) -> Any:
        if self.router.tokenizer is None:
            raise bad_request("this model has no tokenizer", None)
        return self.router.tokenizer

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` if asked) for a prompt or a chat."""
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        else:
            text = body.prompt
        tokens = tokenizer.encode(text)
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.router.limits.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.decode([t]) for t in tokens]
        return out

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """``{"prompt": text}`` for token ids of the vocabulary."""
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self._tokenizer()
        vocab = self.router.limits.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise bad_request(f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(list(body.tokens))}
