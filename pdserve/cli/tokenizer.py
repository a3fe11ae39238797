"""``pdserve tokenizer export DIR --model M``: the model's tokenizer as a Hugging Face tokenizer folder.

Tools that count tokens themselves (aiperf, guidellm, …) load a tokenizer with
``transformers.AutoTokenizer.from_pretrained(DIR)``; the folder written here gives them the ids pdserve
uses, offline, without the model's weights: ``tokenizer.json`` and ``tokenizer_config.json`` (special
tokens, whether BOS is added, the chat template, the context length when the model says it).

- a GGUF file or a checkpoint preset (``smollm2``): built from the file's tokenizer metadata, as serving
  does, without converting the weights;
- a Hugging Face checkpoint directory: its tokenizer files, copied;
- a random-weight preset (``tiny``, ``bench``): the byte tokenizer (token = UTF-8 byte, then BOS, EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def export_tokenizer(model: str, directory: str) -> list[str]:
    """Write ``model``'s tokenizer into ``directory`` (created if needed); returns the files written.

    Raises ValueError naming what is wrong with ``model``.
    """
    from pdserve.engine.config import CHECKPOINT_PRESETS, PRESETS, checkpoint_preset_file

    os.makedirs(directory, exist_ok=True)
    if model in PRESETS:
        return _write_byte_tokenizer(directory)
    path = checkpoint_preset_file(model) if model in CHECKPOINT_PRESETS else model
    if os.path.isfile(path):
        return _write_gguf_tokenizer(path, directory)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"model: directory {model!r} has no tokenizer.json")
        written = []
        for name in _HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(path, name)):
                shutil.copyfile(os.path.join(path, name), os.path.join(directory, name))
                written.append(name)
        return written
    raise ValueError(f"model: {model!r} is neither a preset, a GGUF file, nor a checkpoint directory")


def _write(directory: str, tokenizer: Any, config: dict[str, Any]) -> list[str]:
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **config}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=1)
    return ["tokenizer.json", "tokenizer_config.json"]


def _write_gguf_tokenizer(path: str, directory: str) -> list[str]:
    from gguf import GGUFReader

    from pdserve.engine.gguf import tokenizer_from_gguf

    try:
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except Exception as e:
        raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from e
    tokenizer, config = tokenizer_from_gguf(path, metadata)
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    return _write(directory, tokenizer, {**config, "model_max_length": context})


def _write_byte_tokenizer(directory: str) -> list[str]:
    """The presets' ``ByteTokenizer`` as byte-level BPE without merges: byte b is token b."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from pdserve.engine.chat_template import PLAIN_CHAT_TEMPLATE
    from pdserve.engine.gguf import _bytes_to_unicode
    from pdserve.engine.tokenizer import ByteTokenizer

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<bos>", "<eos>", *(f"<reserved_{i}>" for i in range(ByteTokenizer.EOS + 1, ByteTokenizer.VOCAB_SIZE))]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": PLAIN_CHAT_TEMPLATE}
    return _write(directory, tokenizer, {**config, "add_bos_token": False, "add_eos_token": False})


def build_parser() -> argparse.ArgumentParser:
    from pdserve.options import plain_text

    parser = argparse.ArgumentParser(prog="pdserve tokenizer", description=plain_text(__doc__.split("\n\n")[0]))
    sub = parser.add_subparsers(dest="action", required=True)
    export = sub.add_parser(
        "export",
        help="write the model's tokenizer as a folder transformers.AutoTokenizer.from_pretrained loads",
    )
    export.add_argument("directory", help="the folder to write (created if needed)")
    export.add_argument(
        "--model", default="tiny", help="a preset (tiny, bench, smollm2), a GGUF file or a checkpoint directory"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = export_tokenizer(args.model, args.directory)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}: wrote {', '.join(written)} to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
