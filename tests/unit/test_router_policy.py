"""Routing decisions without a cluster: modes, auto thresholds, least outstanding tokens, prefix affinity."""

from __future__ import annotations

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.policy import RoutingPolicy


def policy(prefill=("p0",), decode=("d0", "d1"), **cfg) -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(**{"auto_min_remote_tokens": 100, **cfg}), list(decode), list(prefill))


def test_auto_sends_long_uncached_prompts_remote_and_short_ones_local():
    p = policy(default_mode="auto")
    assert p.route(list(range(50)), 8, None).mode == "colocated"
    route = p.route(list(range(300)), 8, None)
    assert route.mode == "disaggregated" and route.prefill_worker == "p0"


def test_auto_counts_only_uncached_tokens():
    p = policy(default_mode="auto", decode=("d0",))
    prompt = [7] * 16 * 20 + [1, 2, 3]  # 323 tokens
    first = p.route(prompt, 8, None)
    assert first.mode == "disaggregated"
    p.start(first, prompt, 8)
    p.finish(first, prompt, 8)
    p.prefill_done(first, prompt)
    again = p.route(prompt, 8, None)  # 320 tokens now likely cached on d0: only 3 uncached
    assert again.mode == "colocated" and again.expected_cached_tokens == 320


def test_auto_stays_local_when_the_prefill_pool_is_busy():
    p = policy(default_mode="auto", auto_max_prefill_queue_tokens=500)
    busy = p.route(list(range(400)), 8, "disaggregated")
    p.start(busy, list(range(400)), 8)
    assert p.route([5] * 300, 8, None).mode == "disaggregated"  # 400 queued < 500
    busy2 = p.route(list(range(100, 400)), 8, "disaggregated")
    p.start(busy2, list(range(100, 400)), 8)
    assert p.route([6] * 300, 8, None).mode == "colocated"  # 700 queued >= 500


def test_least_outstanding_tokens_and_prefix_affinity():
    p = policy(prefill=())
    a = p.route(list(range(200)), 10, None)
    p.start(a, list(range(200)), 10)
    b = p.route(list(range(500, 700)), 10, None)
    assert b.decode_worker != a.decode_worker  # the other one is idle
    p.start(b, list(range(500, 700)), 10)
    p.finish(a, list(range(200)), 10)
    p.finish(b, list(range(500, 700)), 10)
    # both idle again: the worker that saw this prefix is preferred
    again = p.route(list(range(200)) + [9, 9], 10, None)
    assert again.decode_worker == a.decode_worker and again.expected_cached_tokens == 192


def test_explicit_modes_and_errors():
    p = policy()
    assert p.route([1, 2, 3], 4, "disaggregated").mode == "disaggregated"
    assert p.route(list(range(999)), 4, "colocated").prefill_worker is None
    with pytest.raises(ValueError, match="mode must be one of"):
        p.route([1], 1, "sideways")
    with pytest.raises(ValueError, match="needs a prefill worker"):
        policy(prefill=()).route([1, 2], 1, "auto")
    with pytest.raises(ValueError, match="needs at least one prefill worker"):
        policy(prefill=(), default_mode="disaggregated")
    with pytest.raises(ValueError, match="default_mode"):
        RouterConfig(default_mode="fast")


def test_router_sheds_load_beyond_its_queue_at_once():
    import asyncio

    from pdserve.engine import SamplingParams
    from pdserve.router.router import GenerateInput, ModelLimits, RequestError, Router, WorkerHandle

    config = RouterConfig(max_queued_requests=2, max_queued_prompt_tokens=100)
    router = Router(config, [WorkerHandle("d0", "decode", None)], [], ModelLimits(260, 1024), None)

    def validate(n_tokens):
        return asyncio.run(router._validate(GenerateInput(None, [1] * n_tokens, SamplingParams(), None)))

    validate(100)  # fits exactly
    router.num_queued, router.queued_prompt_tokens = 1, 60
    with pytest.raises(RequestError) as err:
        validate(41)
    assert err.value.code == "RESOURCE_EXHAUSTED" and "queue is full" in str(err.value)
    validate(40)
    router.num_queued = 2
    with pytest.raises(RequestError) as err:
        validate(1)
    assert err.value.code == "RESOURCE_EXHAUSTED"


def test_router_validation_limits_and_seeds():
    """The router's own checks (no worker is called: validation comes first)."""
    import asyncio

    from pdserve.engine import SamplingParams
    from pdserve.engine.tokenizer import ByteTokenizer
    from pdserve.router.router import GenerateInput, ModelLimits, RequestError, Router, WorkerHandle

    router = Router(
        RouterConfig(max_active_requests=1),
        [WorkerHandle("d0", "decode", None)],
        [],
        ModelLimits(vocab_size=260, max_model_len=64),
        ByteTokenizer(),
    )

    def validate(prompt, request_id=None, params=None):
        return asyncio.run(router._validate(GenerateInput(request_id, prompt, params or SamplingParams(), None)))

    rid, prompt, params = validate("héllo")
    assert prompt == list("héllo".encode()) and params.seed is not None and rid
    for bad, code, text in [
        ([], "INVALID_ARGUMENT", "must not be empty"),
        ("", "INVALID_ARGUMENT", "must not be empty"),
        ([1, 300], "INVALID_ARGUMENT", "[0, 260)"),
        ([1] * 64, "INVALID_ARGUMENT", "max_model_len=64"),
        ("x" * 64 * 64 + "x", "INVALID_ARGUMENT", "characters cannot fit"),
    ]:
        with pytest.raises(RequestError) as err:
            validate(bad)
        assert err.value.code == code and text in str(err.value)
    with pytest.raises(RequestError) as err:
        validate([1, 2], params=SamplingParams(max_tokens=65))
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value).startswith("max_tokens:")

    class Busy:
        done = asyncio.Event()

    router.active["busy"] = Busy()
    with pytest.raises(RequestError) as err:
        validate([1, 2], request_id="busy")
    assert err.value.code == "ALREADY_EXISTS"
    with pytest.raises(RequestError) as err:
        validate([1, 2])
    assert err.value.code == "RESOURCE_EXHAUSTED"

    async def colocated_only():
        async for _ in router.generate(GenerateInput(None, [1, 2], SamplingParams(), "disaggregated")):
            pass

    router.active.clear()
    with pytest.raises(RequestError) as err:
        asyncio.run(colocated_only())
    assert err.value.code == "INVALID_ARGUMENT" and "needs a prefill worker" in str(err.value)


def test_without_prefix_caching_the_view_expects_no_cached_tokens():
    policy = RoutingPolicy(RouterConfig(block_size=4, prefix_caching=False, default_mode="auto"), ["d0"], ["p0"])
    prompt = list(range(40))
    first = policy.route(prompt, 4, "auto")
    policy.start(first, prompt, 4)
    policy.finish(first, prompt, 4)
    assert policy.route(prompt, 4, "auto").expected_cached_tokens == 0


def test_the_decode_silence_timeout_must_outlast_several_heartbeats():
    with pytest.raises(ValueError, match="decode_silence_timeout_s must be >= 1"):
        RouterConfig(decode_silence_timeout_s=0.5)
    assert RouterConfig(decode_silence_timeout_s=1.0).decode_silence_timeout_s == 1.0
