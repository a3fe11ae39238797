"""What every prompt must be, wherever it enters: the engine (``LLMEngine.add_request``) and the router (before it
routes anything) check it with these functions, so both refuse the same prompts with the same words.

Each raises ``ValueError`` whose message starts with the field at fault (``prompt: ...``).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters into one token


def check_prompt_text(text: str, max_model_len: int, has_tokenizer: bool) -> None:
    """A text prompt, before it is tokenized: not empty, a tokenizer to read it, and not so long that it could
    not fit ``max_model_len`` tokens (checked cheaply on its characters, so a huge text is never tokenized)."""
    if not text:
        raise ValueError("prompt: must not be empty")
    if not has_tokenizer:
        raise ValueError("prompt: this model has no tokenizer; send token ids")
    if len(text) > max_model_len * MAX_CHARS_PER_TOKEN:
        raise ValueError(f"prompt: {len(text)} characters cannot fit max_model_len={max_model_len}")


def check_prompt_tokens(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt's token ids as a list: not empty, leaving room for at least one token within
    ``max_model_len``, and every id an integer of the vocabulary ``[0, vocab_size)``."""
    if not token_ids:
        raise ValueError("prompt: must not be empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(token_ids)} tokens leaves no room to generate within max_model_len={max_model_len}"
        )
    tokens = list(token_ids)
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size}), got {bad[:5]!r}")
    return tokens
