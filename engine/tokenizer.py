"""Tokenizers (text in, text out) and incremental detokenization that never splits a character."""

from __future__ import annotations

import codecs
import json
import os
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


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
    eos_token_id: int | None = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        return _ByteDetokenizer()


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if t < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class HFTokenizer:
    """A ``tokenizer.json`` loaded through the ``tokenizers`` library."""

    def __init__(self, model_dir: str, eos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_id = eos_token_id
        gen_config = os.path.join(model_dir, "generation_config.json")
        if self.eos_token_id is None and os.path.isfile(gen_config):
            with open(gen_config) as f:
                eos = json.load(f).get("eos_token_id")
            self.eos_token_id = eos[0] if isinstance(eos, list) else eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def detokenizer(self) -> IncrementalDetokenizer:
        return _WindowDetokenizer(self)


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


def load_tokenizer(model: str, eos_token_id: int | None) -> Tokenizer | None:
    """The byte tokenizer for presets, ``tokenizer.json`` for a directory, or None when it has none."""
    from pdserve.engine.config import PRESETS

    if model in PRESETS:
        return ByteTokenizer()
    if os.path.isfile(os.path.join(model, "tokenizer.json")):
        return HFTokenizer(model, eos_token_id)
    return None
