"""Tokenizers (text in, text out) and incremental detokenization that never splits a character."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.engine.chat_template import ChatTemplate


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # generation stops on any of them
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the BOS (or EOS) the model's tokenizer adds to every text."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template, or the plain fallback (``.is_plain``) when it ships none."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, by ``chat_template``. Raises ValueError on bad messages."""
        ...


class IncrementalDetokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str:
        """Text completed by these new tokens; bytes of an unfinished character are held back."""
        ...

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (U+FFFD for bytes that never completed)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then BOS and EOS. Used by the presets."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 260  # 258 and 259 are reserved and decode to nothing

    vocab_size = VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = (EOS,)
    bos_token_id: int | None = BOS  # never added: prompts are their bytes

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        return _ByteDetokenizer()

    @property
    def chat_template(self) -> ChatTemplate:
        from pdserve.engine.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplate

        return ChatTemplate(PLAIN_CHAT_TEMPLATE)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if t < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HFTokenizer:
    """A checkpoint directory's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

    ``tokenizer_config.json`` says which special tokens are which, whether every text starts with BOS
    (``add_bos_token``; without the flag, whatever the ``tokenizer.json`` post-processor adds) and
    holds the chat template (or ``chat_template.jinja`` does). Stop tokens: ``eos_token_ids`` when
    given, else ``generation_config.json``'s, else the EOS token's.
    """

    def __init__(self, model_dir: str, eos_token_ids: int | Sequence[int] | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size()
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self.bos_token_id = self._id_of(special.get("bos_token"))
        if self.bos_token_id is None:  # older checkpoints name it only in config.json
            bos = _read_json(os.path.join(model_dir, "config.json")).get("bos_token_id")
            self.bos_token_id = bos if isinstance(bos, int) else None
        eos_id = self._id_of(special.get("eos_token"))
        if eos_token_ids is None:
            eos_token_ids = _read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id")
        if eos_token_ids is None:
            eos_token_ids = eos_id
        if isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids or ())
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        self.add_bos_token = bool(add_bos) if add_bos is not None else self._post_processor_adds(self.bos_token_id, 0)
        self.add_eos_token = bool(add_eos) if add_eos is not None else self._post_processor_adds(eos_id, -1)
        if self.add_bos_token and self.bos_token_id is None:
            raise ValueError(f"tokenizer: {model_dir!r} adds a BOS token but names none (bos_token)")
        self._eos_id = eos_id
        self._chat_template = _chat_template(model_dir, config, special)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template, or the plain fallback (``.is_plain``) when it ships none."""
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id if self.add_bos_token else None
        if bos is not None and (not ids or ids[0] != bos):  # a chat template may write it itself
            ids.insert(0, bos)
        if self.add_eos_token and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def detokenizer(self) -> IncrementalDetokenizer:
        return _WindowDetokenizer(self)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._chat_template.render(messages, add_generation_prompt)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _post_processor_adds(self, token_id: int | None, position: int) -> bool:
        """Whether ``tokenizer.json``'s post-processor puts ``token_id`` at ``position`` (0 or -1) of every text."""
        if token_id is None:
            return False
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        return len(full) > len(plain) and full[position] == token_id


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: str, config: dict[str, Any], special: dict[str, str]) -> ChatTemplate:
    from pdserve.engine.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplate

    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if not source and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            source = f.read()
    return ChatTemplate(source or PLAIN_CHAT_TEMPLATE, special)


class _WindowDetokenizer:
    """Decode a short window of recent tokens and emit what the newest ones added.

    Subword tokenizers merge spaces and bytes across token boundaries, so the text of a token is
    only known in context; a trailing U+FFFD means a character is still incomplete and is held back.
    """

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


def load_tokenizer(model: str, eos_token_ids: int | Sequence[int] | None = None) -> Tokenizer | None:
    """The byte tokenizer for random presets; a checkpoint's (or GGUF file's) own; None when it has none."""
    from pdserve.engine.config import PRESETS, resolve_checkpoint

    if model in PRESETS:
        return ByteTokenizer()
    directory = resolve_checkpoint(model)
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory, eos_token_ids)
    return None
