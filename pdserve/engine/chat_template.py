"""Chat templates: a model's Jinja template, rendered in a sandbox the way transformers renders it.

A template comes from ``tokenizer_config.json`` (or ``chat_template.jinja``) of a checkpoint, or from
the ``tokenizer.chat_template`` metadata of a GGUF file; a model without one gets ``PLAIN_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the special tokens it may refer to (``bos_token``, ``eos_token``, ...).

    Construction compiles the source and raises ValueError when it is not a valid template.
    """

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("chat template: the source must be a non-empty string")
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))
        for name, value in self.special_tokens.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise ValueError(f"chat template: special token {name!r} must map a name to a string, got {value!r}")
        _compile(self.source)

    @property
    def is_plain(self) -> bool:
        """True for the fallback template of models that ship none."""
        return self.source == PLAIN_CHAT_TEMPLATE

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for ``messages`` (dicts with a string ``role`` and a ``content``).

        ``add_generation_prompt`` appends the opening of the assistant's turn. Further keyword
        arguments become template variables. Raises ValueError on malformed messages, and when the
        template itself rejects the conversation (its ``raise_exception``).
        """
        checked = _check_messages(messages)
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **variables}
        try:
            template = _compile(self.source)
            return template.render(messages=checked, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("chat template: messages must be a non-empty list of dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"chat template: message {i} must be a dict with a string 'role' and a 'content'")
        checked.append(dict(message))
    return checked


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    """Jinja's ``tojson`` escapes HTML characters; chat templates want the JSON itself."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: not a valid Jinja template: {e}") from e
