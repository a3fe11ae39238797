"""bench.workloads: reproducible from a seed, and distributed as documented."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.workload.generator import (
    WorkloadRequest,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    byte_tokenize,
    interference_workload,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
    uniform_workload,
)


def test_random_same_seed_identical_different_seed_differs():
    a = random_workload(50, rate=5.0, seed=7)
    b = random_workload(50, rate=5.0, seed=7)
    c = random_workload(50, rate=5.0, seed=8)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [r.arrival_offset_s for r in a] != [r.arrival_offset_s for r in c]


def test_random_lengths_bounds_tokens_and_mean():
    reqs = random_workload(
        4000,
        prompt_len_mean=300,
        prompt_len_sigma=0.6,
        prompt_len_min=1,
        prompt_len_max=100_000,
        output_len_mean=50,
        output_len_sigma=0.3,
        output_len_min=1,
        output_len_max=100_000,
        seed=1,
    )
    prompts = np.array([r.num_prompt_tokens for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    assert abs(prompts.mean() / 300 - 1) < 0.05  # the knob is the arithmetic mean of the lognormal
    assert abs(outputs.mean() / 50 - 1) < 0.05
    assert abs(np.std(np.log(prompts)) - 0.6) < 0.05  # sigma is the log-space std
    assert all(0 <= t < 256 for r in reqs[:200] for t in r.prompt_token_ids)  # valid for the byte presets
    clipped = random_workload(
        500, prompt_len_mean=300, prompt_len_sigma=1.0, prompt_len_min=100, prompt_len_max=400, seed=2
    )
    lens = [r.num_prompt_tokens for r in clipped]
    assert min(lens) == 100 and max(lens) == 400  # sigma 1 certainly hits both bounds in 500 draws
    const = random_workload(10, prompt_len_mean=64, prompt_len_sigma=0.0, output_len_mean=8, output_len_sigma=0.0)
    assert {r.num_prompt_tokens for r in const} == {64} and {r.max_tokens for r in const} == {8}


def test_poisson_and_gamma_arrivals():
    rate = 4.0
    gaps = np.diff([0.0, *arrival_offsets(20000, rate, 1.0, 0)])
    assert abs(gaps.mean() * rate - 1) < 0.03
    assert abs(np.var(gaps) / gaps.mean() ** 2 - 1.0) < 0.06  # exponential: CV^2 = 1
    bursty = np.diff([0.0, *arrival_offsets(20000, rate, 0.25, 0)])
    assert abs(bursty.mean() * rate - 1) < 0.05  # same mean rate
    assert abs(np.var(bursty) / bursty.mean() ** 2 - 4.0) < 0.4  # gamma shape k: CV^2 = 1/k
    regular = np.diff([0.0, *arrival_offsets(20000, rate, 4.0, 0)])
    assert abs(np.var(regular) / regular.mean() ** 2 - 0.25) < 0.03
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(3, 2.0, math.inf) == [0.5, 1.0, 1.5]
    assert all(np.diff(arrival_offsets(100, 3.0, 0.5, 1)) >= 0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)


def test_uniform_lengths_cover_the_inclusive_ranges_and_repeat_from_a_seed():
    reqs = uniform_workload(400, (3, 5), (1, 2), seed=4, prefix="u", label="warmup")
    assert {r.num_prompt_tokens for r in reqs} == {3, 4, 5} and {r.max_tokens for r in reqs} == {1, 2}
    assert all(r.arrival_offset_s == 0.0 and r.label == "warmup" for r in reqs)
    assert [r.request_id for r in reqs[:2]] == ["u-0", "u-1"]
    assert all(0 <= t < 256 for r in reqs for t in r.prompt_token_ids)
    assert reqs == uniform_workload(400, (3, 5), (1, 2), seed=4, prefix="u", label="warmup")
    assert reqs != uniform_workload(400, (3, 5), (1, 2), seed=5, prefix="u", label="warmup")
    with pytest.raises(ValueError, match="prompt_len"):
        uniform_workload(1, (5, 3), (1, 1))
    with pytest.raises(ValueError, match="output_len"):
        uniform_workload(1, (1, 1), (0, 1))


def test_interference_scenario():
    scenario = dict(
        num_streams=5,
        stream_prompt_len=32,
        stream_output_len=300,
        num_long=3,
        long_prompt_len=1000,
        long_output_len=4,
        long_period_s=2.0,
        long_start_s=1.0,
        seed=3,
    )
    reqs = interference_workload(**scenario)
    streams = [r for r in reqs if r.label == "stream"]
    longs = [r for r in reqs if r.label == "long"]
    assert len(streams) == 5 and all(r.arrival_offset_s == 0 and r.max_tokens == 300 for r in streams)
    assert [r.arrival_offset_s for r in longs] == [1.0, 3.0, 5.0]
    assert all(r.num_prompt_tokens == 1000 for r in longs)
    assert reqs == interference_workload(**scenario)


def test_shared_prefix():
    reqs = shared_prefix_workload(60, num_prefixes=3, prefix_len=100, suffix_len=10, output_len=5, rate=10.0, seed=4)
    by_label: dict[str, set[tuple[int, ...]]] = {}
    for r in reqs:
        assert r.num_prompt_tokens == 110 and r.max_tokens == 5
        by_label.setdefault(r.label, set()).add(tuple(r.prompt_token_ids[:100]))
    assert sorted(by_label) == ["prefix-0", "prefix-1", "prefix-2"]
    assert all(len(p) == 1 for p in by_label.values())  # one system prompt per label...
    assert len(set.union(*by_label.values())) == 3  # ...and three different ones
    assert len({tuple(r.prompt_token_ids[100:]) for r in reqs}) == 60  # unique suffixes
    assert reqs == shared_prefix_workload(
        60, num_prefixes=3, prefix_len=100, suffix_len=10, output_len=5, rate=10.0, seed=4
    )


def _sharegpt_file(tmp_path) -> str:
    data = [
        {
            "conversations": [
                {"from": "human", "value": "hello there, model"},
                {"from": "gpt", "value": "hi! " * 10},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "no human first"}]},  # no human->gpt pair: skipped
        {"conversations": [{"from": "human", "value": "x" * 5000}, {"from": "gpt", "value": "y" * 3000}]},
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "why is the sky blue"},
                {"from": "gpt", "value": "Rayleigh scattering."},
            ]
        },
        {"conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "sure, fine"}]},  # prompt < 4
        {"id": "broken"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt(tmp_path):
    path = _sharegpt_file(tmp_path)
    reqs = sharegpt_workload(path, byte_tokenize, 3, rate=2.0, seed=0, max_prompt_len=1024, max_output_len=512)
    by_prompt = {bytes(r.prompt_token_ids).decode(): r.max_tokens for r in reqs}
    assert by_prompt["hello there, model"] == 40  # len("hi! " * 10) bytes
    assert by_prompt["why is the sky blue"] == len("Rayleigh scattering.")
    assert by_prompt["x" * 1024] == 512  # prompt truncated, output capped
    assert reqs == sharegpt_workload(path, byte_tokenize, 3, rate=2.0, seed=0, max_prompt_len=1024, max_output_len=512)
    with pytest.raises(ValueError, match="only 3 usable"):
        sharegpt_workload(path, byte_tokenize, 4)


def test_build_workload_and_spec_validation(tmp_path):
    spec = WorkloadSpec(kind="random", num_requests=20, rate=3.0, seed=5)
    assert build_workload(spec).requests == build_workload(spec).requests
    assert build_workload(spec).requests != build_workload(WorkloadSpec(num_requests=20, rate=3.0, seed=6)).requests
    inter = build_workload(WorkloadSpec(kind="interference", num_requests=2, num_streams=3)).requests
    assert sum(r.label == "long" for r in inter) == 2 and sum(r.label == "stream" for r in inter) == 3
    sg = build_workload(WorkloadSpec(kind="sharegpt", num_requests=2, dataset_path=_sharegpt_file(tmp_path)))
    assert len(sg.requests) == 2
    assert json.dumps(spec.to_dict())  # JSON-serialisable (rate inf becomes "inf")
    for bad in (
        dict(kind="nope"),
        dict(num_requests=0),
        dict(rate=-1.0),
        dict(burstiness=0.0),
        dict(max_concurrency=0),
    ):
        with pytest.raises(ValueError):
            WorkloadSpec(**bad)
    with pytest.raises(ValueError):
        build_workload(WorkloadSpec(kind="sharegpt"))
    with pytest.raises(ValueError):
        WorkloadRequest("x", [], 1, 0.0)
