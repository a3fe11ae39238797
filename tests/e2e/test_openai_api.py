"""The OpenAI API's choices, prompt lists, echo, context limit and /tokenize on a real local deployment,
through the official ``openai`` client, checked against what the gRPC API streams for the same requests."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from support.checks import assert_no_leaks

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.router.client import Client
from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.cluster

MAX_MODEL_LEN = 512
ENGINE = EngineConfig(
    model="tiny",
    device="cpu",
    num_kv_blocks=400,
    max_num_batched_tokens=64,
    torch_threads=1,
    max_model_len=MAX_MODEL_LEN,
)
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = DeploymentConfig(engine=ENGINE, num_decode_workers=1, transport="grpc", http_port=0)
    with Deployment(config) as d:
        yield d


@pytest.fixture
def oai(deployment):
    client = openai.OpenAI(base_url=f"{deployment.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()
    assert_no_leaks(deployment)


def grpc_text(deployment: Deployment, prompt: str | list[int], params: SamplingParams) -> str:
    with Client(deployment.address) as c:
        return "".join(ch.text for ch in c.generate(prompt, params))


def test_n_seeded_choices_are_the_grpc_requests_with_seed_plus_index(deployment, oai):
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=11, extra_body={"ignore_eos": True}
    )
    texts = [c.text for c in out.choices]
    for i, text in enumerate(texts):
        assert text == grpc_text(deployment, PROMPT, SamplingParams(max_tokens=6, seed=11 + i, ignore_eos=True))
    assert len(set(texts)) > 1  # different draws
    assert out.usage.prompt_tokens == len(PROMPT.encode()) and out.usage.completion_tokens == 18
    stream = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=11, stream=True, extra_body={"ignore_eos": True}
    )
    streamed: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice


def test_a_prompt_list_answers_each_prompt_as_alone(deployment, oai):
    prompts = ["Hello", "A longer second prompt"]
    out = oai.completions.create(
        model="tiny", prompt=prompts, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert [c.text for c in out.choices] == [grpc_text(deployment, p, greedy) for p in prompts]
    assert out.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)


def test_echo_returns_prompt_then_completion(deployment, oai):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == PROMPT + grpc_text(deployment, PROMPT, greedy)


def test_a_prompt_plus_max_tokens_over_the_context_is_refused_with_the_numbers(deployment, oai):
    prompt = [65] * (MAX_MODEL_LEN - 50)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny", prompt=prompt, max_tokens=100)
    message = err.value.body["message"]
    assert err.value.body["param"] == "max_tokens"
    for number in (str(MAX_MODEL_LEN), str(MAX_MODEL_LEN - 50), "100", str(MAX_MODEL_LEN + 50), "50"):
        assert number in message, message
    fits = oai.completions.create(model="tiny", prompt=prompt, max_tokens=50, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 50 and fits.choices[0].finish_reason == "length"
    # a chat without max_tokens gets the room its prompt leaves, as in vLLM
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x" * 400}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_tokenize_matches_the_served_prompt_tokens(deployment, oai):
    req = urllib.request.Request(
        deployment.http_url + "/tokenize",
        data=json.dumps({"model": "tiny", "prompt": PROMPT}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    out = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert body["count"] == out.usage.prompt_tokens and body["max_model_len"] == MAX_MODEL_LEN
    back = oai.post("/detokenize", body={"tokens": body["tokens"]}, cast_to=object)
    assert back == {"prompt": PROMPT}


@pytest.mark.parametrize("interval", [2, 4])
def test_a_stream_interval_sends_the_first_token_at_once_then_one_message_per_interval(deployment, oai, interval):
    greedy = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    with Client(deployment.address) as c:
        every = list(c.generate(PROMPT, greedy))
        grouped = list(c.generate(PROMPT, greedy, stream_interval=interval))
    sizes = [len(ch.token_ids) for ch in grouped]
    assert [t for ch in grouped for t in ch.token_ids] == [t for ch in every for t in ch.token_ids]
    assert "".join(ch.text for ch in grouped) == "".join(ch.text for ch in every)
    assert sizes[0] == 1 and all(n >= interval for n in sizes[1:-1]) and sum(sizes) == 17
    assert len(grouped) <= 1 + -(-16 // interval) < len(every)
    assert grouped[-1].finished and grouped[-1].metadata.num_output_tokens == 17
    stream = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=17, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "stream_interval": interval, "return_token_ids": True},
    )  # fmt: skip
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.text for ch in chunks) == "".join(ch.text for ch in every)
    http_sizes = [len(ch.model_extra["token_ids"]) for ch in chunks]
    assert http_sizes[0] == 1 and sum(http_sizes) == 17 and len(http_sizes) <= 1 + -(-16 // interval)


def test_a_bad_stream_interval_is_refused(deployment, oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"stream_interval": 0})
    assert err.value.body["param"] == "stream_interval"
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig(stream_interval=0)


def test_logprobs_of_greedy_tokens_are_the_most_likely(deployment, oai):
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and value <= 0.0  # byte tokens' texts may coincide (U+FFFD): a dict keeps one
        assert all(v <= value + 1e-6 for v in top.values())  # greedy: the sampled token is the most likely
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, logprobs=1, extra_body={"pdserve_mode": "disaggregated"}
        )
    assert err.value.body["param"] == "logprobs" and "colocated" in err.value.body["message"]
