"""The OpenAI-compatible HTTP API on a real local deployment, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from support.checks import assert_no_leaks

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.router.client import Client
from pdserve.router.config import RouterConfig
from pdserve.router.openai.serving_chat import render_chat
from pdserve.router.router import StopMatcher

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=400, max_num_batched_tokens=48, torch_threads=1, max_model_len=1024
)
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MAX_QUEUED_PROMPT_TOKENS = 600  # a longer prompt is shed at once: RESOURCE_EXHAUSTED, HTTP 429


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = DeploymentConfig(
        engine=ENGINE,
        mode="colocated",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,
        num_routers=2,  # both serve HTTP on one port, as they do gRPC
        http_port=0,
        metrics_port=0,
        router=RouterConfig(max_queued_prompt_tokens=MAX_QUEUED_PROMPT_TOKENS),
    )
    with Deployment(config) as d:
        yield d


@pytest.fixture
def oai(deployment) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{deployment.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()
    assert_no_leaks(deployment)


def grpc_text(deployment: Deployment, prompt: str, max_tokens: int, mode: str | None = None) -> tuple[str, list[int]]:
    """What the gRPC API streams for a greedy request: the reference the HTTP API must match."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Client(deployment.address) as c:
        chunks = list(c.generate(prompt, params, mode=mode))
    return "".join(ch.text for ch in chunks), [t for ch in chunks for t in ch.token_ids]


def http(deployment: Deployment, method: str, path: str, body: Any = None, raw: bytes | None = None):
    """A plain HTTP call: (status, parsed JSON body)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        deployment.http_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- completions -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_completion_gives_the_grpc_apis_text_and_tokens(deployment, oai, mode):
    text, token_ids = grpc_text(deployment, PROMPT, 12, mode)
    r = oai.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "pdserve_mode": mode},
    )
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert choice.text == text and choice.model_extra["token_ids"] == token_ids
    assert choice.finish_reason == "length" and choice.index == 0
    n_prompt = len(PROMPT.encode())
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    metrics = r.model_extra["pdserve_metrics"]
    assert metrics["request_id"] == r.id and metrics["mode"] == mode and metrics["router"] in ("router-0", "router-1")
    assert metrics["prefill_worker"] == ("prefill-0" if mode == "disaggregated" else "")
    assert metrics["num_output_tokens"] == 12 and metrics["ttft_s"] > 0


def test_streamed_completion_has_the_same_text_then_usage(deployment, oai):
    text, token_ids = grpc_text(deployment, PROMPT, 16)
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == text
    assert [t for c in token_chunks for t in c.choices[0].model_extra["token_ids"]] == token_ids
    assert all(c.usage is None and c.choices[0].finish_reason is None for c in token_chunks[:-1])
    last = token_chunks[-1]
    assert last.choices[0].finish_reason == "length" and last.model_extra["pdserve_metrics"]["num_output_tokens"] == 16
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == len(PROMPT.encode())
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompts_and_seeded_sampling(deployment, oai):
    ids = list(PROMPT.encode())
    by_text = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, **GREEDY).choices[0].text
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=10, **GREEDY).choices[0].text
    assert by_ids == by_text

    def sampled(seed: int) -> str:
        r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95, seed=seed)
        return r.choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in (1, 2, 3)}) > 1


# ---- stop strings ------------------------------------------------------------------------------------------


def _a_stop_string(text: str) -> tuple[str, int]:
    """A two-character substring first found at some index >= 3 (so some text precedes it)."""
    for k in range(3, len(text) - 2):
        stop = text[k : k + 2]
        if text.find(stop) == k:
            return stop, k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_and_end_the_request(deployment, oai, stream):
    full, _ = grpc_text(deployment, PROMPT, 48)
    stop, at = _a_stop_string(full)
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "stop": ["never-there", stop], **GREEDY}
    if stream:
        chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        r = oai.completions.create(**kwargs)
        text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert r.model_extra["pdserve_metrics"]["num_output_tokens"] == usage.completion_tokens
    assert text == full[:at] and reason == "stop"
    assert 0 < usage.completion_tokens < 48  # the request ended at the stop string, not at max_tokens
    assert usage.prompt_tokens == len(PROMPT.encode())
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    unstopped = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=48, stop="never-there", **GREEDY)
    assert unstopped.choices[0].text == full and unstopped.choices[0].finish_reason == "length"


def test_stop_matcher_holds_back_a_possible_stop_across_chunks():
    m = StopMatcher(["END", "xyz"])
    assert m.push("abcE") == ("abc", False)  # "E" may start "END"
    assert m.push("N") == ("", False)
    assert m.push("Dmore") == ("", True)  # matched across three chunks; what follows it is dropped
    m = StopMatcher(["END"])
    assert m.push("aE") == ("a", False)
    assert m.push("x") == ("Ex", False)  # it was not a stop after all
    assert m.push("tail E") == ("tail ", False) and m.flush() == "E"


# ---- chat ----------------------------------------------------------------------------------------------


def test_chat_completion_streams_and_not_on_the_rendered_prompt(deployment, oai):
    prompt = render_chat(ByteTokenizer(), MESSAGES)
    assert prompt == "system: Be brief.\nuser: Hello there\nassistant: "  # the plain template
    text, _ = grpc_text(deployment, prompt, 10)
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == 10

    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(prompt.encode())


def test_chat_without_max_tokens_runs_to_the_length_limit_with_content_parts(deployment, oai):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    r = oai.chat.completions.create(model="tiny", messages=parts, **GREEDY)
    prompt = render_chat(ByteTokenizer(), [{"role": "user", "content": "Hello"}])
    assert r.usage.prompt_tokens == len(prompt.encode())
    assert r.usage.completion_tokens == ENGINE.max_model_len - len(prompt.encode())
    assert r.choices[0].finish_reason == "length"


# ---- the rest of the surface ----------------------------------------------------------------------------


def test_models_health_and_request_ids(deployment, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert oai.models.retrieve("tiny").owned_by == "pdserve"
    assert http(deployment, "GET", "/health") == (200, {"ok": True, "status": "serving"})
    status, body = http(deployment, "GET", "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    r = oai.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "client-req-42"}
    )
    assert r.headers["x-request-id"] == "client-req-42"
    completion = r.parse()
    assert (
        completion.id == "client-req-42" and completion.model_extra["pdserve_metrics"]["request_id"] == "client-req-42"
    )


def test_every_router_serves_http_on_the_shared_port(deployment):
    routers = set()
    for _ in range(40):  # each urllib call is a new connection; the kernel picks a router for it
        status, body = http(deployment, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 200
        routers.add(body["pdserve_metrics"]["router"])
        if len(routers) == 2:
            break
    assert routers == {"router-0", "router-1"}
    assert len(deployment.metrics_ports) == 2


def test_a_client_that_goes_away_mid_stream_frees_its_request(deployment, oai):
    def counts() -> tuple[float, float]:  # summed over the routers' registries
        aborted = tokens = 0.0
        for port in deployment.metrics_ports:
            samples = scrape(f"http://127.0.0.1:{port}/metrics")
            aborted += samples.get(("pdserve_requests_total", (("mode", "colocated"), ("outcome", "aborted"))), 0.0)
            tokens += samples.get(("pdserve_output_tokens_total", (("mode", "colocated"),)), 0.0)
        return aborted, tokens

    aborted_before, tokens_before = counts()
    stream = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=900, stream=True, **GREEDY)
    chunks = iter(stream)
    received = [next(chunks) for _ in range(3)]
    assert all(c.choices for c in received)
    stream.close()
    assert_no_leaks(deployment)
    deadline = time.monotonic() + 15
    while counts()[0] == aborted_before:
        assert time.monotonic() < deadline, "the router never counted the request as aborted"
        time.sleep(0.05)
    aborted, tokens = counts()
    assert aborted == aborted_before + 1
    assert 3 <= tokens - tokens_before < 900  # the router aborted it on the workers before max_tokens
    assert oai.completions.create(model="tiny", prompt="ok", max_tokens=3, **GREEDY).usage.completion_tokens == 3


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus endpoint's samples by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


BAD_COMPLETIONS = [
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"n": 0}, 400, "n", "invalid_argument"),
    ({"best_of": 2}, 400, "best_of", "invalid_argument"),
    ({"temperature": -1}, 400, "temperature", "invalid_argument"),
    ({"top_p": 0}, 400, "top_p", "invalid_argument"),
    ({"max_tokens": 0}, 400, "max_tokens", "invalid_argument"),
    ({"max_tokens": 5000}, 400, "max_tokens", "invalid_argument"),  # over max_model_len: the router says so
    ({"prompt": ""}, 400, "prompt", "invalid_argument"),
    ({"prompt": ["a", ""]}, 400, "prompt", "invalid_argument"),
    ({"prompt": [1, 2, 999]}, 400, "prompt", "invalid_argument"),  # outside the vocabulary
    ({"prompt": [1] * 1024}, 400, "prompt", "invalid_argument"),  # no room to generate
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_argument"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_argument"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "invalid_argument"),
    ({"logprobs": 21}, 400, "logprobs", "invalid_argument"),
    ({"prompt": [1] * 500, "max_tokens": 600}, 400, "max_tokens", "invalid_argument"),  # over the context
    ({"extra_body": {"pdserve_mode": "sideways"}}, 400, "pdserve_mode", "invalid_argument"),
    ({"prompt": "x" * (MAX_QUEUED_PROMPT_TOKENS + 100)}, 429, None, "resource_exhausted"),  # load shed
]


@pytest.mark.parametrize(
    ("change", "status", "param", "code"), BAD_COMPLETIONS, ids=[str(c[0])[:40] for c in BAD_COMPLETIONS]
)
def test_bad_completion_requests_get_openai_errors(deployment, oai, change, status, param, code):
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as err:
        oai.completions.create(**kwargs)
    assert err.value.status_code == status
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["param"], body["code"]) == (param, code) and body["message"]
    assert body["type"] == {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}[status]


def test_bad_bodies_and_chat_requests_get_400(deployment):
    status, body = http(deployment, "POST", "/v1/completions", raw=b'{"model": "tiny", "prompt": ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    cases = [
        ({"prompt": "hi"}, "model"),  # no model
        ({"model": "tiny", "prompt": {"text": "hi"}}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ]
    for body_in, param in cases:
        status, body = http(deployment, "POST", "/v1/completions", body_in)
        assert status == 400 and body["error"]["param"] == param, body
    chat_cases = [
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 5000}, "max_tokens"),
    ]
    for body_in, param in chat_cases:
        status, body = http(deployment, "POST", "/v1/chat/completions", body_in)
        assert status == 400 and body["error"]["param"] == param, body


# ---- the benchmark, pointed at the HTTP API ----------------------------------------------------------------


def test_pdserve_bench_measures_an_openai_compatible_target(deployment, tmp_path):
    from pdserve.bench.runner import main

    out = tmp_path / "http"
    args = ["--target", deployment.http_url, "--architectures", "colocated,disaggregated", "--num-requests", "4"]
    args += ["--rate", "20", "--prompt-len-mean", "60", "--prompt-len-max", "120", "--output-len-mean", "6"]
    args += ["--output-len-max", "10", "--warmup", "1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"colocated", "disaggregated"}
    for name, run in runs.items():
        assert len(run["requests"]) == 4 and run["metrics"]["completed"] == 4
        for req in run["requests"]:
            assert req["ok"], req["error"]
            assert len(req["token_times"]) == req["num_output_tokens"] >= 1  # a timestamp for every token
            assert req["meta"]["mode"] == name and req["meta"]["num_output_tokens"] == req["num_output_tokens"]
    assert runs["disaggregated"]["kv_bytes_moved"] > 0 and runs["colocated"]["kv_bytes_moved"] == 0
    assert (out / "report.md").stat().st_size > 0
