"""The OpenAI HTTP API's protocol through the official ``openai`` client (and raw HTTP where the client hides
what is on the wire), on a stand-in router: choices, prompt lists, echo, errors, auth, /tokenize.

The stand-in answers each prompt with a deterministic text (the alphabet from a seed-chosen letter) so that
the fan-out of ``n`` and prompt lists, their indices, usage and streaming are checked exactly without Ray;
``test_openai_api`` runs the same features on a real deployment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import openai
import pytest

from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.messages import PromptLogprob, RequestMetrics
from pdserve.net import HttpServer
from pdserve.router.config import RouterConfig
from pdserve.router.http_api import build_app
from pdserve.router.router import GenerateInput, ModelLimits, RequestError, RouterEvent

TOKEN = "tok-123"
LETTERS = string.ascii_lowercase


def expected(seed: int | None, max_tokens: int) -> str:
    start = (seed or 0) % 26
    return "".join(LETTERS[(start + i) % 26] for i in range(max_tokens))


class AlphabetRouter:
    """Stands in for ``Router``: each request streams ``expected(seed, max_tokens)``, a token per event."""

    router_id = "router-test"

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.limits = ModelLimits(ByteTokenizer.VOCAB_SIZE, 128)
        self.config = RouterConfig()
        self.requests: list[GenerateInput] = []
        self.groups: dict[str, list[str]] = {}

    async def health(self) -> tuple[bool, str]:
        return True, "serving"

    async def generate(self, req: GenerateInput) -> AsyncGenerator[RouterEvent, None]:
        self.requests.append(req)
        prompt = self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if 999 in prompt or "refuse" in str(req.prompt):
            raise RequestError("INVALID_ARGUMENT", "prompt: refused by the stand-in")
        text = expected(req.params.seed, req.params.max_tokens)
        k = req.params.logprobs
        for i, char in enumerate(text):
            await asyncio.sleep(0)
            lps = None if k is None else [(-0.5, [(ord(char), -0.5), (ord("Z"), -2.0)][:k])]
            plps = prompt_logprobs(prompt, req.params.prompt_logprobs) if i == 0 else None
            if i < len(text) - 1:
                yield RouterEvent([ord(char)], char, logprobs=lps, prompt_logprobs=plps)
            else:
                metrics = RequestMetrics(
                    req.request_id or "", "colocated", "decode-0", num_prompt_tokens=len(prompt),
                    num_output_tokens=len(text),
                )  # fmt: skip
                yield RouterEvent([ord(char)], char, "length", metrics, lps, plps)


def prompt_logprobs(prompt: list[int], k: int | None) -> list[PromptLogprob] | None:
    """The stand-in's: prompt token i (after the first) has log-probability -i, rank i, and "Z" first of the k."""
    if k is None:
        return None
    return [PromptLogprob(-float(i), i, [(ord("Z"), -0.1)][:k]) for i in range(1, len(prompt))]


class AppThread:
    def __init__(self, auth_token: str | None) -> None:
        self.router = AlphabetRouter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = build_app(self.router, "stand-in", auth_token)  # type: ignore[arg-type]
        self.server = HttpServer(app, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def app() -> Iterator[AppThread]:
    a = AppThread(TOKEN)
    yield a
    a.stop()


@pytest.fixture
def oai(app) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    yield client
    client.close()


def http(app: AppThread, method: str, path: str, body: Any = None, raw: bytes | None = None, auth: str | None = None):
    """(status, headers, parsed JSON or text) of a plain HTTP call."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", "Authorization": auth if auth is not None else f"Bearer {TOKEN}"}
    req = urllib.request.Request(app.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
            status, hdrs = resp.status, resp.headers
    except urllib.error.HTTPError as e:
        text, status, hdrs = e.read().decode(), e.code, e.headers
    try:
        return status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return status, hdrs, text


def sse_events(text: str) -> list[Any]:
    lines = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- choices and prompts ----------------------------------------------------------------------------------


def test_n_choices_draw_from_seed_plus_index_and_usage_counts_the_prompt_once(oai):
    out = oai.completions.create(model="stand-in", prompt="hello", max_tokens=5, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [expected(7 + i, 5) for i in range(3)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 15, 20)
    chat = oai.chat.completions.create(
        model="stand-in", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, seed=1
    )
    assert [c.message.content for c in chat.choices] == [expected(1, 3), expected(2, 3)]
    assert chat.usage.completion_tokens == 6


def test_a_prompt_list_gives_prompt_major_choices(oai, app):
    out = oai.completions.create(model="stand-in", prompt=["ab", "cde"], max_tokens=2, n=2, seed=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected(0, 2), expected(1, 2)] * 2
    assert out.usage.prompt_tokens == 2 + 3 and out.usage.completion_tokens == 8
    ids = oai.completions.create(model="stand-in", prompt=[[104, 105], [106]], max_tokens=1)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3
    assert [r.request_id for r in app.router.requests[-2:]] == [f"{ids.id}-0", f"{ids.id}-1"]


def test_streamed_choices_carry_their_index_and_usage_null_until_the_usage_chunk(oai, app):
    stream = oai.completions.create(
        model="stand-in",
        prompt=["x", "y"],
        max_tokens=4,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: expected(3, 4), 1: expected(4, 4), 2: expected(3, 4), 3: expected(4, 4)}
    assert finish == dict.fromkeys(range(4), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # on the wire every chunk of a completions stream says "usage": null, as chat's do
    status, _, text = http(app, "POST", "/v1/completions", {"model": "stand-in", "prompt": "q", "max_tokens": 3,
                                                          "stream": True})  # fmt: skip
    events = sse_events(text)
    assert status == 200 and events and all("usage" in e and e["usage"] is None for e in events)


def test_echo_puts_the_prompt_before_the_completion(oai):
    out = oai.completions.create(model="stand-in", prompt="Say: ", max_tokens=3, echo=True)
    assert out.choices[0].text == "Say: " + expected(None, 3)
    from_ids = oai.completions.create(model="stand-in", prompt=[72, 105], max_tokens=2, echo=True)
    assert from_ids.choices[0].text == "Hi" + expected(None, 2)
    stream = oai.completions.create(model="stand-in", prompt="Go ", max_tokens=3, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Go " + expected(None, 3)


def test_one_refused_choice_refuses_the_request(oai, app):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="stand-in", prompt=["fine", "refuse"], max_tokens=2)
    assert err.value.body["param"] == "prompt" and "refused" in err.value.body["message"]


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"best_of": 2}, "best_of", "use n"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 65}, "n", "less than or equal to 64"),
        ({"prompt": ["a", ""]}, "prompt", "prompt[1]: must not be empty"),
        ({"prompt": ["a"] * 40, "n": 2}, "prompt", "over the limit of 64 choices"),
    ],
)
def test_refused_choice_requests_say_why(oai, change, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(**{"model": "stand-in", "prompt": "p", "max_tokens": 2, **change})
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


# ---- log-probabilities ------------------------------------------------------------------------------------


def test_completion_logprobs_have_the_legacy_shape_streamed_and_not(oai):
    out = oai.completions.create(model="stand-in", prompt="p", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["a", "b", "c"] and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{"a": -0.5, "Z": -2.0}, {"b": -0.5, "Z": -2.0}, {"c": -0.5, "Z": -2.0}]
    assert lp.text_offset == [0, 1, 2]
    stream = oai.completions.create(model="stand-in", prompt="p", max_tokens=3, logprobs=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert [t for c in chunks for t in c.logprobs.tokens] == ["a", "b", "c"]
    assert [o for c in chunks for o in c.logprobs.text_offset] == [0, 1, 2]
    assert [top for c in chunks for top in c.logprobs.top_logprobs] == [{"a": -0.5}, {"b": -0.5}, {"c": -0.5}]
    plain = oai.completions.create(model="stand-in", prompt="p", max_tokens=2)
    assert plain.choices[0].logprobs is None


def lm_eval_scores(answer: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``local-completions`` reading of a loglikelihood answer (``parse_logprobs``): the
    sum of the continuation's token log-probabilities, and whether each was the most likely token."""
    out = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=lambda c: c["index"]), ctxlens, strict=False):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))))
    return out


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(app):
    """lm-evaluation-harness's request (token-id prompts, echo, logprobs 1, max_tokens 1) and the max_tokens 0 one:
    the prompt's tokens first, the first with a null log-probability, each other with its own."""
    harness = {"model": "stand-in", "prompt": [[72, 105, 33], [72, 111]], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    status, _, body = http(app, "POST", "/v1/completions", harness)
    assert status == 200, body
    first, second = body["choices"]
    assert first["text"] == "Hi!" + expected(1234, 1)
    assert first["logprobs"]["tokens"] == ["H", "i", "!", expected(1234, 1)]
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert first["logprobs"]["top_logprobs"][:3] == [None, {"i": -1.0, "Z": -0.1}, {"!": -2.0, "Z": -0.1}]
    assert lm_eval_scores(body, [1, 1]) == [(-3.0, False), (-1.0, False)]
    assert second["logprobs"]["token_logprobs"][:2] == [None, -1.0]
    only = http(app, "POST", "/v1/completions", {**harness, "max_tokens": 0})[2]
    assert [c["text"] for c in only["choices"]] == ["Hi!", "Ho"]
    assert only["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert only["choices"][0]["finish_reason"] == "length" and only["usage"]["completion_tokens"] == 0
    vllm = http(app, "POST", "/v1/completions", {**harness, "prompt": "Hey", "prompt_logprobs": 1, "echo": False})[2]
    assert vllm["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "101": {"logprob": -1.0, "rank": 1, "decoded_token": "e"},
            "90": {"logprob": -0.1, "rank": 1, "decoded_token": "Z"},
        },
        {
            "121": {"logprob": -2.0, "rank": 2, "decoded_token": "y"},
            "90": {"logprob": -0.1, "rank": 1, "decoded_token": "Z"},
        },
    ]
    status, _, text = http(
        app, "POST", "/v1/completions", {**harness, "prompt": "Hey", "stream": True, "max_tokens": 0}
    )
    chunks = sse_events(text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hey"
    streamed = [
        v
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == [None, -1.0, -2.0]


def test_chat_logprobs_and_top_logprobs(oai):
    messages = [{"role": "user", "content": "hi"}]
    out = oai.chat.completions.create(model="stand-in", messages=messages, max_tokens=2, logprobs=True, top_logprobs=1)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["a", "b"] and [c.logprob for c in content] == [-0.5, -0.5]
    assert [c.bytes for c in content] == [[97], [98]]
    assert [[t.token for t in c.top_logprobs] for c in content] == [["a"], ["b"]]
    stream = oai.chat.completions.create(model="stand-in", messages=messages, max_tokens=2, logprobs=True, stream=True)
    streamed = [e.token for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == ["a", "b"]


@pytest.mark.parametrize(
    ("endpoint", "change", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_logprobs_requests_that_cannot_be_served_are_refused(oai, endpoint, change, param):
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "completions":
            oai.completions.create(**{"model": "stand-in", "prompt": "p", "max_tokens": 2, **change})
        else:
            oai.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": "x"}], **change)
    assert err.value.body["param"] == param


# ---- numbers that are not numbers -------------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_nan_and_infinite_sampling_parameters_are_named_as_such(app, field, literal):
    """Raw HTTP: the openai client refuses to encode NaN or infinity itself; curl and other clients send them."""
    raw = f'{{"model": "stand-in", "prompt": "p", "{field}": {literal}}}'.encode()
    status, _, body = http(app, "POST", "/v1/completions", raw=raw)
    assert status == 400 and body["error"]["param"] == field
    assert "finite number" in body["error"]["message"], body


# ---- errors, auth, docs -----------------------------------------------------------------------------------


def test_every_status_has_the_openai_error_shape(app):
    status, headers, body = http(app, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    assert body["error"]["code"] == "method_not_allowed" and "GET /v1/completions" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = http(app, "GET", "/v1/no-such-thing")
    assert status == 404 and body["error"]["type"] == "not_found_error" and body["error"]["code"] == "not_found"
    status, _, body = http(app, "POST", "/v1/completions", raw=b"{")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_docs_are_off_and_the_schema_is_served(app):
    status, _, body = http(app, "GET", "/docs")
    assert status == 404 and "error" in body
    status, _, schema = http(app, "GET", "/openapi.json")
    assert status == 200 and "/v1/completions" in schema["paths"] and "/tokenize" in schema["paths"]


def test_bearer_is_case_insensitive_and_401_carries_www_authenticate(app):
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, _, _ = http(app, "GET", "/v1/models", auth=f"{scheme} {TOKEN}")
        assert status == 200, scheme
    status, headers, body = http(app, "GET", "/v1/models", auth="Bearer wrong")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert body["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client.close()


# ---- /tokenize and /detokenize ----------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(app, oai):
    status, _, body = http(app, "POST", "/tokenize", {"model": "stand-in", "prompt": "héllo"})
    assert status == 200
    assert body == {"count": 6, "max_model_len": 128, "tokens": list("héllo".encode())}
    status, _, back = http(app, "POST", "/detokenize", {"model": "stand-in", "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    messages = [{"role": "user", "content": "hi"}]
    status, _, chat = http(app, "POST", "/v1/tokenize", {"messages": messages, "return_token_strs": True})
    rendered = ByteTokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == list(rendered.encode()) and "".join(chat["token_strs"]) == rendered
    # the openai client reaches them as custom routes
    posted = oai.post("/tokenize", body={"prompt": "ab"}, cast_to=object)
    assert posted["tokens"] == [97, 98]
    status, _, bad = http(app, "POST", "/detokenize", {"tokens": [300]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, _, bad = http(app, "POST", "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and bad["error"]["code"] == "model_not_found"
    status, _, bad = http(app, "POST", "/tokenize", {"prompt": "x", "messages": messages})
    assert status == 400


def test_a_json_body_without_its_content_type_is_read_as_json(app):
    """``curl -d '{...}'`` sends a form's content type (urllib sends the same): the body is JSON all the same."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    req = urllib.request.Request(app.url + "/tokenize", data=b'{"prompt": "ab"}', method="POST", headers=auth)
    assert req.get_header("Content-type") is None  # urllib adds the form's type as it sends
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["tokens"] == [97, 98]
    req = urllib.request.Request(app.url + "/tokenize", data=b"prompt=ab", method="POST", headers=auth)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(err.value.read())
    assert err.value.code == 400 and "Content-Type: application/json" in body["error"]["message"], body


def test_tokenizer_endpoints_need_the_token_and_do_not_stall_the_event_loop(app):
    for path, body in (
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [97]}),
        ("/v1/tokenize", {"prompt": "x"}),
    ):
        status, _, answer = http(app, "POST", path, body, auth="")
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", path

    class SlowTokenizer(ByteTokenizer):
        def encode(self, text: str) -> list[int]:  # a long prompt: seconds of tokenizing
            time.sleep(1.5)
            return super().encode(text)

    app.router.tokenizer = SlowTokenizer()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizing = pool.submit(http, app, "POST", "/tokenize", {"prompt": "a long prompt"})
            time.sleep(0.3)
            start = time.monotonic()
            status, _, _ = http(app, "GET", "/health")
            assert status == 200 and time.monotonic() - start < 0.5, "the event loop waited for the tokenizer"
            assert tokenizing.result(10)[0] == 200
    finally:
        app.router.tokenizer = ByteTokenizer()
