"""Tokenizers: a real tokenizer.json through the `tokenizers` library, and the byte tokenizer; BOS, stop
tokens and chat templates as the model's files say."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from pdserve.engine.chat_template import ChatTemplate
from pdserve.engine.request import FinishReason
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = ["naïve café — 東京 and Zürich, déjà vu", "chunked prefill splits prompts", "€ 5 über alles"] * 20
SPECIAL_TOKENS = ["<eos>", "<s>", "<|eot|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json next to a small Llama config (random weights, via safetensors)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("hf-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXT,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (64, 64),
                p + "self_attn.k_proj.weight": (32, 64),
                p + "self_attn.v_proj.weight": (32, 64),
                p + "self_attn.o_proj.weight": (64, 64),
                p + "mlp.gate_proj.weight": (128, 64),
                p + "mlp.up_proj.weight": (128, 64),
                p + "mlp.down_proj.weight": (64, 128),
                p + "input_layernorm.weight": (64,),
                p + "post_attention_layernorm.weight": (64,),
            }
        )
    save_file({k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}, str(path / "model.safetensors"))
    return path


def test_hf_tokenizer_round_trip_and_incremental_decoding(model_dir):
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, HFTokenizer)
    text = "naïve café — 東京, déjà vu"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no half characters, ever


def test_byte_tokenizer_holds_back_partial_characters():
    detok = ByteTokenizer().detokenizer()
    euro = "€".encode()  # three bytes
    assert detok.push([euro[0]]) == "" and detok.push([euro[1]]) == ""
    assert detok.push([euro[2], 257]) == "€"  # EOS decodes to nothing


def test_engine_streams_text_with_a_checkpoint_tokenizer(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
    assert engine.eos_token_ids == (0,)
    [completion] = engine.generate(["café au lait"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert completion.prompt_token_ids == engine.tokenizer.encode("café au lait")
    assert completion.text == engine.tokenizer.decode(completion.token_ids)


def _variant(model_dir, tmp_path, files: dict[str, dict]) -> str:
    """A copy of the checkpoint with some JSON files written over."""
    path = tmp_path / "variant"
    shutil.copytree(model_dir, path)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return str(path)


def test_no_bos_unless_the_tokenizer_says_so(model_dir):
    tok = load_tokenizer(str(model_dir))
    assert not tok.add_bos_token
    assert tok.encode("café") == tok._tok.encode("café", add_special_tokens=False).ids


def test_bos_is_added_when_tokenizer_config_says_so(model_dir, tmp_path):
    config = {"add_bos_token": True, "bos_token": {"content": "<s>", "special": True}, "eos_token": "<eos>"}
    path = _variant(model_dir, tmp_path, {"tokenizer_config.json": config})
    tok = load_tokenizer(path)
    plain = tok._tok.encode("café au lait", add_special_tokens=False).ids
    assert tok.bos_token_id == 1 and tok.encode("café au lait") == [1, *plain]
    assert tok.encode("<s>café au lait") == [1, *plain]  # a prompt (or chat template) that writes BOS keeps one
    engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=64))
    [completion] = engine.generate(["café au lait"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert completion.prompt_token_ids == [1, *plain]


def test_bos_is_added_by_the_post_processor_when_there_is_no_flag(model_dir, tmp_path):
    path = _variant(model_dir, tmp_path, {"tokenizer_config.json": {"bos_token": "<s>"}})
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(f"{path}/tokenizer.json")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", bos_token="<s>")
    ours = load_tokenizer(path)
    assert ours.add_bos_token
    for text in ("café au lait", "€ 5"):
        assert ours.encode(text) == reference.encode(text)
        assert ours.encode(text)[0] == 1


def _greedy(path: str, prompt: str, ignore_eos: bool):
    engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=64))
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore_eos))
    return completion


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_generation_stops_on_any_of_several_eos_ids(model_dir, tmp_path, where):
    free_run = _greedy(str(model_dir), "café au lait", ignore_eos=True).token_ids
    stop = free_run[4]
    stops = {0, stop}
    expected = free_run[: next(i for i, t in enumerate(free_run) if t in stops) + 1]
    config = json.loads((model_dir / "config.json").read_text())
    files = (
        {"config.json": {**config, "eos_token_id": [0, stop]}}
        if where == "config"
        else {"generation_config.json": {"eos_token_id": [stop]}}  # config.json keeps its single id, 0
    )
    path = _variant(model_dir, tmp_path, files)
    assert set(ModelConfig.load(path).eos_token_ids) == stops
    completion = _greedy(path, "café au lait", ignore_eos=False)
    assert completion.token_ids == expected and completion.finish_reason == FinishReason.STOP


def test_model_config_keeps_every_eos_id():
    raw = dict(
        vocab_size=128256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        eos_token_id=[128001, 128008, 128009],
    )
    assert ModelConfig.from_hf_config(raw).eos_token_ids == (128001, 128008, 128009)
    assert ModelConfig.from_hf_config(raw).eos_token_id == 128001
    merged = ModelConfig.from_hf_config({**raw, "eos_token_id": 128009}, {"eos_token_id": [128001, 128009]})
    assert merged.eos_token_ids == (128009, 128001)
    with pytest.raises(ValueError, match="eos_token_ids must be token ids"):
        ModelConfig.from_hf_config({**raw, "eos_token_id": [128256]})


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_LIKE = """{{ bos_token }}{% for message in messages %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
AS_JSON = "{% for message in messages %}{{ message | tojson }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
CONVERSATIONS = [
    [{"role": "user", "content": "  Bonjour, ça va ?  "}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語?"},
    ],
]


@pytest.mark.parametrize("source", [CHATML, LLAMA3_LIKE, ALTERNATING, AS_JSON], ids=["chatml", "llama3", "alt", "json"])
def test_chat_templates_render_like_transformers(model_dir, source):
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<eos>"
    )
    reference.chat_template = source
    ours = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "<eos>"})
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.render(messages, add_generation_prompt) == expected


def test_a_checkpoint_chat_template_comes_from_its_files(model_dir, tmp_path):
    config = {
        "bos_token": "<s>",
        "eos_token": "<eos>",
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": ALTERNATING}],
    }
    tok = load_tokenizer(_variant(model_dir, tmp_path, {"tokenizer_config.json": config}))
    assert (
        tok.apply_chat_template(CONVERSATIONS[1])
        == "<s>[INST] Name a colour. [/INST]Blue.<eos>[INST] Another, in 日本語? [/INST]"
    )
    (tmp_path / "variant" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "variant" / "chat_template.jinja").write_text(CHATML)
    assert load_tokenizer(str(tmp_path / "variant")).chat_template.source == CHATML
    assert load_tokenizer(str(model_dir)).chat_template.is_plain  # none shipped: the plain fallback


def test_the_plain_template_serves_models_without_one():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ByteTokenizer().apply_chat_template(messages) == "system: Be brief.\nuser: hi\nassistant: "
    assert ByteTokenizer().apply_chat_template(messages, add_generation_prompt=False) == "system: Be brief.\nuser: hi\n"


@pytest.mark.parametrize(
    "source, messages, match",
    [
        (ALTERNATING, [{"role": "assistant", "content": "hi"}], "roles must alternate"),
        (CHATML, [{"content": "no role"}], "must be a dict with a string 'role'"),
        (CHATML, [], "non-empty list"),
        (CHATML, "hello", "non-empty list"),
        ("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], "unsafe|access"),
    ],
    ids=["template-refuses", "no-role", "empty", "a-string", "sandbox"],
)
def test_bad_conversations_get_a_clear_error(source, messages, match):
    with pytest.raises(ValueError, match=match):
        ChatTemplate(source).render(messages)


def test_a_broken_template_is_refused_when_loaded():
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        ChatTemplate("{% for message in messages %}{{ message }")
