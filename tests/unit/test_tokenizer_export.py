"""``pdserve tokenizer export``: a folder ``transformers.AutoTokenizer`` loads, with pdserve's own ids."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from pdserve.cli.main import main
from pdserve.engine.tokenizer import load_tokenizer

TEXTS = [
    "Hello world!",
    "héllo  wörld 12345\n\n\ttabs   and spaces ",
    "<|im_start|>user\nhi<|im_end|>",
    "日本語のテキスト 😀 emoji",
    "def f(x):\n    return x ** 2  # code",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
@pytest.mark.slow
def test_the_exported_folder_gives_the_same_ids_and_chat_prompt(tmp_path, capsys, model):
    out = tmp_path / "tok"
    assert main(["tokenizer", "export", str(out), "--model", model]) == 0
    assert "wrote tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]  # no weights
    assert sum(f.stat().st_size for f in out.iterdir()) < 10 << 20
    hf = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(model)
    assert ours is not None
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(MESSAGES)


def test_a_model_that_is_not_one_is_a_clear_error(tmp_path, capsys):
    assert main(["tokenizer", "export", str(tmp_path / "t"), "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    (tmp_path / "ckpt").mkdir()
    assert main(["tokenizer", "export", str(tmp_path / "t"), "--model", str(tmp_path / "ckpt")]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
