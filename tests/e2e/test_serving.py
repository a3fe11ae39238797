"""Distributed serving on a local Ray cluster: every mode and transport gives the engine's tokens."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
import ray
import torch
from support.checks import assert_no_leaks

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.model_runner import gather_kv
from pdserve.faults import NO_FAULTS, FaultPlan
from pdserve.messages import Mode
from pdserve.router.client import AsyncClient, Client
from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=400, max_num_batched_tokens=48, torch_threads=1, max_model_len=1024
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Longer than the chunk budget (48), not multiples of the block size; two pairs share a prefix."""
    rng = random.Random(11)
    shared_a = [rng.randrange(256) for _ in range(70)]
    shared_b = [rng.randrange(256) for _ in range(37)]
    prompts = [shared_a + [rng.randrange(256) for _ in range(n)] for n in (5, 41)]
    prompts += [shared_b + [rng.randrange(256) for _ in range(n)] for n in (90, 13)]
    prompts += [[rng.randrange(256) for _ in range(n)] for n in (9, 130, 61, 203)]
    return prompts


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    engine = LLMEngine(ENGINE)
    return [c.token_ids for c in engine.generate(_prompts(), GREEDY)]


def _deployment(transport: str) -> Deployment:
    return Deployment(
        DeploymentConfig(
            engine=ENGINE,
            mode="auto",
            num_prefill_workers=1,
            num_decode_workers=1,
            transport=transport,
            verify_kv=True,  # every pushed block is checked on arrival
            kv_host="127.0.0.1",  # tests stay on loopback
            port=0,
            router=RouterConfig(auto_min_remote_tokens=64),
        )
    ).start()


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def deployment(request, ray_cluster):
    d = _deployment(request.param)
    yield d
    d.stop()


@pytest.fixture
def client(deployment):
    with Client(deployment.address) as c:
        yield c
    assert_no_leaks(deployment)


def _run_concurrently(address: str, prompts: list[list[int]], mode: str | None, params=GREEDY):
    async def one(client: AsyncClient, prompt: list[int]):
        tokens, meta = [], None
        async for chunk in client.generate(prompt, params, mode=mode):
            tokens += chunk.token_ids
            meta = chunk.metadata or meta
        return tokens, meta

    async def main():
        async with AsyncClient(address) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    return asyncio.run(main())


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_gives_the_engines_greedy_tokens(deployment, client, expected, mode):
    results = _run_concurrently(deployment.address, _prompts(), mode)
    assert [tokens for tokens, _ in results] == expected
    for (_, meta), prompt in zip(results, _prompts(), strict=True):
        assert meta.num_prompt_tokens == len(prompt) and meta.num_output_tokens == 12
        assert meta.decode_worker == "decode-0"
        if mode == "auto":  # long uncached prompts went remote, short ones stayed local
            remote = len(prompt) - meta.num_cached_tokens > 64
            assert meta.mode == ("disaggregated" if remote else "colocated"), (len(prompt), meta)
        else:
            assert meta.mode == mode
        assert meta.prefill_worker == ("prefill-0" if meta.mode == "disaggregated" else "")


def test_decode_worker_receives_exactly_the_locally_computed_kv(deployment, client):
    prompt = [random.Random(5).randrange(256) for _ in range(157)]  # fresh: nothing cached anywhere
    [chunks] = [list(client.generate(prompt, GREEDY, mode="disaggregated"))]
    meta = chunks[-1].metadata
    assert meta.mode == "disaggregated" and meta.num_cached_tokens == 0
    assert meta.kv_transfer_bytes > 0
    decode = deployment.decode_workers[0].actor
    received = ray.get(decode.cached_prompt_kv.remote(prompt))  # the 9 full prompt blocks (144 tokens)
    local = LLMEngine(ENGINE)
    rid = local.add_request(prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    while local.has_unfinished_requests():
        local.step()
    reference = gather_kv(local.kv_cache, local.held[rid].block_ids, 144)
    assert received is not None and received.shape == reference.shape
    torch.testing.assert_close(received, reference, rtol=1e-4, atol=1e-5)


def test_first_token_reaches_the_client_before_the_second_is_decoded(deployment, client):
    prompt = [random.Random(6).randrange(256) for _ in range(180)]
    arrivals = []
    for chunk in client.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), mode="disaggregated"
    ):
        arrivals.append((time.time(), chunk))
    first_time, first = arrivals[0]
    assert len(first.token_ids) == 1  # the prefill worker's token, streamed on its own
    meta = arrivals[-1][1].metadata
    assert meta.mode == "disaggregated" and meta.prefill_worker == "prefill-0"
    assert meta.second_token_time > 0 and first_time < meta.second_token_time
    assert meta.ttft_s > 0 and meta.prefill_s > 0 and meta.kv_transfer_s >= 0


def test_the_decode_worker_says_when_each_call_reached_it(deployment, client):
    prompt = [random.Random(7).randrange(256) for _ in range(140)]
    for mode in ("colocated", "disaggregated"):
        sent = time.time()
        chunks = list(client.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), mode=mode))
        meta = chunks[-1].metadata
        assert meta.mode == mode
        # colocated: the generate call (before its prefill); disaggregated: the decode call after the first token
        assert sent < meta.decode_call_time < meta.second_token_time, (mode, sent, meta)


def test_each_worker_traces_when_it_took_the_request_in(deployment, client):
    # the replay reads these step counts: the step of that index is the first one the request could join,
    # and on an otherwise idle worker it is the one that starts computing it
    from pdserve.bench.runner import admission_steps

    prompt = [random.Random(8).randrange(256) for _ in range(140)]
    for mode in ("colocated", "disaggregated"):
        since = time.time()
        chunks = list(client.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), mode=mode))
        meta = chunks[-1].metadata
        stats = client.stats(steps_since=since)
        counts = admission_steps(stats)[meta.request_id]
        steps = {w.worker_id: sorted(w.steps, key=lambda s: s.started) for w in stats}
        decode_steps = steps[meta.decode_worker]
        assert 0 <= counts["decode_queued_step"] < len(decode_steps), (mode, counts, len(decode_steps))
        joined = decode_steps[counts["decode_queued_step"]]
        if mode == "colocated":
            assert set(counts) == {"decode_queued_step"}
            assert joined.num_prefill_tokens == ENGINE.max_num_batched_tokens  # the prompt's first chunk
        else:
            assert 0 <= counts["decode_reserved_step"] <= counts["decode_queued_step"]
            assert joined.num_decode_tokens == 1 and joined.num_prefill_tokens == 0  # the KV came whole
            first_chunk = steps[meta.prefill_worker][counts["prefill_queued_step"]]
            assert first_chunk.num_prefill_tokens == ENGINE.max_num_batched_tokens
        assert counts["decode_queued_step"] == 0  # the worker's first step since: nothing else ran


def test_seeded_sampling_is_the_same_in_every_mode(deployment, client):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=77)
    prompt = _prompts()[5]
    runs = {
        mode: [t for c in client.generate(prompt, params, mode=mode) for t in c.token_ids]
        for mode in ("colocated", "disaggregated")
    }
    reference = LLMEngine(ENGINE).generate([prompt], params)[0].token_ids
    assert runs["colocated"] == runs["disaggregated"] == reference


def test_prompts_that_arrive_together_are_prefilled_together(deployment, client):
    """The prefill worker admits every queued prompt that fits one step's budget (48 tokens) while a
    step runs, so short prompts sent at once share the next step instead of taking one step each."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(10)] for _ in range(4)]
    prefill = deployment.prefill_workers[0].actor
    since = time.time()
    # 200 ms a step: the others queue during the first
    ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
    try:
        results = _run_concurrently(deployment.address, prompts, "disaggregated")
    finally:
        ray.get(prefill.set_fault_plan.remote(NO_FAULTS))
    assert all(meta.prefill_worker == "prefill-0" for _, meta in results)
    (stats,) = [w for w in deployment.stats(steps_since=since) if w.role == "prefill"]
    steps = [s.num_prefill_tokens for s in stats.steps if s.num_prefill_tokens]
    assert sum(steps) == 40 and len(steps) <= 2, steps  # four prompts, at most two steps


@pytest.mark.parametrize(
    ("kwargs", "code", "match"),
    [
        (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
        (dict(prompt=[1, 2, 5000]), grpc.StatusCode.INVALID_ARGUMENT, "token ids must be in"),
        (dict(prompt=list(range(250)) * 5), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        (dict(prompt="", mode="colocated"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ],
)
def test_bad_input_gets_invalid_argument(deployment, client, kwargs, code, match):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(kwargs["prompt"], GREEDY, mode=kwargs.get("mode")))
    assert err.value.code() == code and match in err.value.details()


def test_bad_sampling_parameters_get_invalid_argument(deployment, client):
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(deployment.address) as channel:
        stub = pb_grpc.PDServeStub(channel)
        bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(top_p=1.5))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
        no_prompt = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=3))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(no_prompt, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_and_client_cancel_free_every_block(deployment, client):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    # abort by id, from a second connection of the same client, while the stream runs
    stream = client.generate(_prompts()[3], long, mode="disaggregated", request_id="to-abort")
    first = next(stream)
    assert first.token_ids

    def abort_from_elsewhere():
        with Client(deployment.address) as stranger:  # another client cannot stop it
            assert not stranger.abort("to-abort")
        with Client(deployment.address, client_id=client.client_id) as other:
            assert other.abort("to-abort")

    threading.Timer(0.05, abort_from_elsewhere).start()
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in [first, *rest]) < 400
    # duplicate id while it runs
    stream = client.generate(_prompts()[4], long, mode="colocated", request_id="dup")
    next(stream)
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate([1, 2, 3], GREEDY, request_id="dup"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.close()  # cancels the call: the server stops the request

    # the client walks away mid-stream: the server must stop the request on every worker
    async def walk_away():
        async with AsyncClient(deployment.address) as c:
            async for chunk in c.generate(_prompts()[7], long, mode="disaggregated"):
                if chunk.token_ids:
                    break

    asyncio.run(walk_away())
    assert_no_leaks(deployment)
    assert client.abort("no-such-request") is False


def test_health_and_stats(deployment, client):
    health = client.health()
    assert health.ok and health.num_prefill_workers == 1 and health.num_decode_workers == 1
    since = time.time()
    list(client.generate(_prompts()[1], GREEDY, mode="colocated"))
    stats = {w.worker_id: w for w in client.stats(steps_since=since)}
    assert set(stats) == {"decode-0", "prefill-0"}
    assert stats["decode-0"].role == "decode" and stats["prefill-0"].role == "prefill"
    steps = stats["decode-0"].steps
    assert steps and all(s.started >= since for s in steps)
    assert sum(s.num_prefill_tokens for s in steps) > 0 and sum(s.num_decode_tokens for s in steps) > 0


def test_two_routers_share_one_port_and_serve_the_same_tokens(ray_cluster, expected):
    """Two router processes on one port (SO_REUSEPORT) in front of the same workers, tokens as with one."""
    config = DeploymentConfig(
        engine=ENGINE,
        mode="auto",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,
        kv_host="127.0.0.1",
        num_routers=2,
        router=RouterConfig(auto_min_remote_tokens=64),
    )
    with Deployment(config) as d:
        assert len(d.routers) == 2
        routers_seen: dict[str, list[list[int]]] = {}
        for _ in range(32):  # each channel is a new connection; the kernel picks a router for it
            with Client(d.address) as c:
                chunks = list(c.generate(_prompts()[0], GREEDY, mode="colocated"))
                routers_seen.setdefault(chunks[-1].metadata.router, []).append(
                    [t for ch in chunks for t in ch.token_ids]
                )
            if len(routers_seen) == 2:
                break
        assert set(routers_seen) == {"router-0", "router-1"}
        assert all(tokens == expected[0] for runs in routers_seen.values() for tokens in runs)
        for mode in Mode:
            results = _run_concurrently(d.address, _prompts(), mode)
            assert [tokens for tokens, _ in results] == expected
        assert_no_leaks(d)


def _raw_generate(address: str, body: bytes) -> grpc.RpcError:
    """Send an arbitrary request body to Generate; returns the error it must end with."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_stream("/pdserve.PDServe/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(call(body, timeout=30))
        return err.value


def test_every_bad_input_gets_a_clear_status_and_changes_nothing(deployment, client):
    from pdserve.proto import pdserve_pb2 as pb

    ids = pb.TokenIds
    before = {w.worker_id: (w.num_steps, w.blocks_free, w.blocks_cached) for w in client.stats()}
    ok_sampling = pb.SamplingParams(max_tokens=4)
    cases = [
        ("empty prompt", pb.GenerateRequest(token_ids=ids(ids=[]), sampling=ok_sampling), "prompt:"),
        ("no prompt", pb.GenerateRequest(sampling=ok_sampling), "prompt:"),
        ("prompt over max_model_len", pb.GenerateRequest(token_ids=ids(ids=[1] * 1024)), "max_model_len"),
        ("token id outside the vocabulary", pb.GenerateRequest(token_ids=ids(ids=[1, 99999])), "prompt: token ids"),
        (
            "huge max_tokens",
            pb.GenerateRequest(token_ids=ids(ids=[1]), sampling=pb.SamplingParams(max_tokens=2**32 - 1)),
            "max_tokens:",
        ),
        (
            "negative temperature",
            pb.GenerateRequest(token_ids=ids(ids=[1]), sampling=pb.SamplingParams(temperature=-1)),
            "temperature",
        ),
        (
            "infinite temperature",
            pb.GenerateRequest(token_ids=ids(ids=[1]), sampling=pb.SamplingParams(temperature=float("inf"))),
            "temperature",
        ),
        ("top_p above 1", pb.GenerateRequest(token_ids=ids(ids=[1]), sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
        ("top_p negative", pb.GenerateRequest(token_ids=ids(ids=[1]), sampling=pb.SamplingParams(top_p=-0.5)), "top_p"),
        ("unknown mode", pb.GenerateRequest(token_ids=ids(ids=[1]), mode=7), "mode:"),
    ]
    for name, request, field in cases:
        error = _raw_generate(deployment.address, request.SerializeToString())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.details())
        assert field in error.details(), (name, error.details())
    invalid_utf8 = b"\x12\x03\xff\xfeA"  # field 2 (text), three bytes that are not UTF-8
    error = _raw_generate(deployment.address, invalid_utf8)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == "text: not valid UTF-8"
    oversized = pb.GenerateRequest(text="x" * (9 << 20)).SerializeToString()  # over the 8 MiB request limit
    started = time.monotonic()
    error = _raw_generate(deployment.address, oversized)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in error.details()
    assert time.monotonic() - started < 5
    assert client.health().ok
    after = {w.worker_id: (w.num_steps, w.blocks_free, w.blocks_cached) for w in client.stats()}
    assert after == before


def test_a_request_id_is_free_again_as_soon_as_its_stream_is_cancelled(deployment, client):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        stream = client.generate(_prompts()[4], long, mode="colocated", request_id="reused")
        next(stream)
        stream.close()
    tokens = [t for c in client.generate(_prompts()[0], GREEDY, request_id="reused") for t in c.token_ids]
    assert len(tokens) == 12
