"""The engine end to end on the tiny preset: batching, preemption, prefix cache, sampling, bad input."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tiny(**overrides) -> LLMEngine:
    config = dict(model="tiny", device="cpu", num_kv_blocks=512, max_model_len=1024)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny()


def _random_prompts(n: int, seed: int, lo: int = 3, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    [completion] = engine.generate([prompt], params)
    return completion.token_ids


def test_continuous_batching_matches_each_request_alone(engine):
    prompts = _random_prompts(64, seed=1)
    rng = random.Random(2)
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    expected = [_alone(engine, p, sp) for p, sp in zip(prompts, params, strict=True)]

    batched = tiny(max_num_batched_tokens=96, max_num_seqs=24)
    got: dict[str, list[int]] = {}
    pending = list(zip(prompts, params, strict=True))
    ids: list[str] = []
    while pending or batched.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):  # requests arrive while others run
            if pending:
                ids.append(batched.add_request(*pending.pop(0)))
        for out in batched.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[i] for i in ids] == expected
    assert max(s.num_seqs for s in batched.step_history) > 8  # they really ran together
    batched.block_manager.check_integrity()
    assert batched.block_manager.usage().used == 0


def test_prefill_first_scheduling_runs_prompts_in_steps_of_their_own_with_the_same_tokens():
    prompts = _random_prompts(12, seed=5, lo=20, hi=90)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, kinds = {}, {}
    for policy in ("mixed", "prefill-first"):
        engine = tiny(max_num_batched_tokens=256, max_num_seqs=16, scheduling=policy)
        got: dict[str, list[int]] = {}
        ids = []
        for i, prompt in enumerate(prompts):
            ids.append(engine.add_request(prompt, params))
            if i % 3 == 2:  # a few steps between arrivals: the earlier requests are decoding
                for _ in range(2):
                    for out in engine.step():
                        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        tokens[policy] = [got[i] for i in ids]
        kinds[policy] = [(s.num_prefill_tokens > 0, s.num_decode_tokens > 0) for s in engine.step_history]
        assert engine.block_manager.usage().used == 0
    assert tokens["prefill-first"] == tokens["mixed"]
    assert (True, True) in kinds["mixed"]  # mixed: new prompts joined the running decodes' steps
    assert (True, True) not in kinds["prefill-first"]  # prefill-first: never a prompt and a decode in one step
    assert (True, False) in kinds["prefill-first"] and (False, True) in kinds["prefill-first"]


def test_the_engine_traces_when_it_took_each_request_in_between_its_steps():
    from pdserve.bench.runner import admission_steps
    from pdserve.messages import WorkerStats, worker_key

    a, b, r = (worker_key(rid, "router-0", n) for n, rid in enumerate(["a", "b@client", "r"]))  # as routed

    engine = tiny(max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request([5] * 100, params, request_id=a)
    engine.step()  # a's first chunk
    engine.step()
    engine.add_request([6] * 20, params, request_id=b)  # before step 2
    reservation = engine.reserve_remote([7] * 40, params, r)
    assert reservation is not None
    while engine.has_work():
        engine.step()
    engine.admit_remote(r, 9)
    while engine.has_unfinished_requests():
        engine.step()
    trace = list(engine.admission_trace)
    assert [(e.request_id, e.event) for e in trace] == [
        (a, "queued"),
        (b, "queued"),
        (r, "reserved"),
        (r, "queued"),
    ]
    steps = list(engine.step_history)
    stats = WorkerStats("w", "decode", 0, 0, 0, 0, 0, 0, 0, 0, len(steps), 0, tuple(steps), admissions=tuple(trace))
    counts = admission_steps([stats])  # by the clients' request ids
    assert counts["a"] == {"decode_queued_step": 0} and counts["b@client"] == {"decode_queued_step": 2}
    assert 2 <= counts["r"]["decode_reserved_step"] < counts["r"]["decode_queued_step"] < len(steps)
    # the step of that count is the first that could take the request, and on this engine it did
    assert steps[2].num_seqs == 2 and steps[counts["r"]["decode_queued_step"]].num_decode_tokens >= 1


def test_preemption_and_resume_give_the_same_tokens(engine):
    prompts = _random_prompts(6, seed=3, lo=40, hi=60)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    small = tiny(num_kv_blocks=14)  # 6 requests of up to 100 tokens cannot all stay resident
    got = [c.token_ids for c in small.generate(prompts, params)]
    assert sum(s.num_preempted for s in small.step_history) > 0
    assert got == expected
    small.block_manager.check_integrity()
    assert small.block_manager.usage().used == 0


def test_prefix_cache_hit_gives_the_same_tokens(engine):
    system = _random_prompts(1, seed=4, lo=70, hi=70)[0]
    prompts = [system + [1, 2, 3], system + [4, 5]]
    uncached = tiny(enable_prefix_caching=False)
    expected = [_alone(uncached, p, GREEDY) for p in prompts]
    cached = tiny()
    first = cached.generate([prompts[0]], GREEDY)[0]
    second = cached.generate([prompts[1]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert [first.token_ids, second.token_ids] == expected


def test_seeded_sampling_is_reproducible_across_engines_and_batches():
    params = SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=1234)
    prompt = [10, 20, 30, 40]
    a = tiny().generate([prompt], params)[0].token_ids
    others = _random_prompts(5, seed=5)
    b = (
        tiny(max_num_seqs=3)
        .generate(
            others[:2] + [prompt] + others[2:],
            [SamplingParams(temperature=1.0)] * 2 + [params] + [SamplingParams(temperature=1.0)] * 3,
        )[2]
        .token_ids
    )
    assert a == b
    c = (
        tiny()
        .generate([prompt], SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=4321))[0]
        .token_ids
    )
    assert c != a


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    prompt = [5, 6, 7, 8, 9]
    greedy = _alone(engine, prompt, GREEDY)
    assert _alone(engine, prompt, SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True)) == greedy
    assert _alone(engine, prompt, SamplingParams(max_tokens=10, temperature=2.0, top_p=1e-6, ignore_eos=True)) == greedy


def test_stop_tokens_max_tokens_and_eos(engine):
    prompt = [11, 12, 13]
    greedy = _alone(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stop_at = greedy[3]
    c = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert c.token_ids == greedy[: greedy.index(stop_at) + 1] and c.finish_reason == FinishReason.STOP
    c = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == FinishReason.LENGTH
    # EOS ends a request unless ignore_eos: find a sampled EOS with a seed search bounded by 200 tries
    for seed in range(200):
        c = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=3.0, seed=seed))[0]
        if c.finish_reason == FinishReason.STOP:
            assert c.token_ids[-1] == ByteTokenizer.EOS and ByteTokenizer.EOS not in c.token_ids[:-1]
            break
    else:
        pytest.fail("no sampled EOS in 200 seeds")


def test_max_model_len_caps_generation():
    e = tiny(max_model_len=40)
    c = e.generate([list(range(35))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(c.token_ids) == 5 and c.finish_reason == FinishReason.LENGTH


def test_text_prompts_stream_whole_characters(engine):
    text = "héllo wörld €"
    token_ids = ByteTokenizer().encode(text)
    assert len(token_ids) > len(text)  # multi-byte characters
    detok = ByteTokenizer().detokenizer()
    pieces = [detok.push([t]) for t in token_ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    c = engine.generate([text], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert c.prompt_token_ids == token_ids
    assert c.text == ByteTokenizer().decode(c.token_ids)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], None, "prompt: must not be empty"),
        ([1, 2, 999], None, r"prompt: token ids must be integers in \[0, 260\)"),
        ([1, -1], None, "token ids"),
        (list(range(200)) * 6, None, "max_model_len=1024"),
        ([1, 2], "not params", "params must be SamplingParams"),
    ],
)
def test_bad_requests_are_rejected_and_change_nothing(engine, prompt, params, match):
    before = (engine.block_manager.usage(), len(engine.scheduler.requests), len(engine.scheduler.waiting))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert (engine.block_manager.usage(), len(engine.scheduler.requests), len(engine.scheduler.waiting)) == before


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=(-3,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(block_size=0), "block_size"),
        (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200), "max_num_batched_tokens"),
        (dict(model="no-such-model"), "model"),
        (dict(max_model_len=10**6), "max_model_len"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(EngineConfig(**kwargs))


def test_abort_frees_blocks_and_duplicate_ids_are_rejected(engine):
    rid = engine.add_request(list(range(100)), GREEDY, request_id="dup")
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], GREEDY, request_id="dup")
    assert engine.abort(rid) and not engine.abort(rid)
    engine.block_manager.check_integrity()
    assert engine.block_manager.usage().used == 0


def test_remote_kv_reservation_and_admission_match_a_local_run(engine):
    """The disaggregation contract in one process: KV computed elsewhere, copied into reserved blocks."""
    prompt = _random_prompts(1, seed=8, lo=90, hi=90)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _alone(tiny(enable_prefix_caching=False), prompt, params)

    prefill = tiny(max_num_batched_tokens=32)
    rid = prefill.add_request(
        prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id="r", hold_blocks=True
    )
    first = []
    while prefill.has_unfinished_requests():
        first += [t for o in prefill.step() for t in o.new_token_ids]
    source = prefill.held[rid].block_ids

    decode = tiny()
    reservation = decode.reserve_remote(prompt, params, "r")
    assert reservation is not None and reservation.num_cached_tokens == 0
    assert len(reservation.block_ids) == len(source) == -(-90 // 16)
    assert not decode.has_work()  # waiting for KV: nothing to compute
    decode.kv_cache[torch.tensor(reservation.block_ids)] = prefill.kv_cache[torch.tensor(source)]
    prefill.release(rid)
    assert decode.admit_remote("r", first[0]) is None
    tokens = list(first)
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == expected
    for e in (prefill, decode):
        e.block_manager.check_integrity()
        assert e.block_manager.usage().used == 0
    # a second reservation of the same prompt finds its full blocks in the prefix cache: no transfer
    again = decode.reserve_remote(prompt, params, "r2")
    assert again is not None and again.num_cached_tokens == 80
    assert decode.abort("r2")
    assert decode.block_manager.usage().used == 0


def test_every_step_records_its_device_time_within_its_duration(engine):
    engine.step_history.clear()
    engine.generate([list(range(1, 40)), list(range(3, 9))], SamplingParams(max_tokens=6, temperature=0.0))
    steps = list(engine.step_history)
    assert steps and all(0.0 < s.device_s <= s.duration_s for s in steps)
    # the scheduler's share is host time outside the model: the device time leaves it out
    assert all(s.device_s <= s.duration_s - s.schedule_s + 1e-6 for s in steps)


def test_small_cpu_steps_run_on_one_thread_and_restore_the_count():
    from pdserve.engine.model import FEW_ROWS
    from pdserve.engine.model_runner import step_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu = torch.device("cpu")
        with step_threads(FEW_ROWS, cpu):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with step_threads(FEW_ROWS + 1, cpu):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), step_threads(1, cpu):
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == 2
        with step_threads(1, cpu, threads_spin=True):  # threads that spin between kernels: all of them
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("environ", "spin"),
    [
        ({}, True),  # OpenMP's default policy spins a few milliseconds
        ({"OMP_WAIT_POLICY": "passive"}, False),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10k"}, True),
        ({"GOMP_SPINCOUNT": "0"}, False),
        ({"GOMP_SPINCOUNT": "infinite"}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "lots"}, False),  # libgomp ignores it: the policy
        ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
    ],
)
def test_whether_openmp_threads_spin_follows_libgomps_settings(environ, spin):
    from pdserve.engine.model_runner import openmp_threads_spin

    assert openmp_threads_spin(environ) is spin


def test_every_step_records_its_threads_cpu_time_not_the_time_it_was_off_the_core(monkeypatch):
    threads = torch.get_num_threads()
    try:
        engine = tiny(torch_threads=1)  # every step's compute runs on the stepping thread
        engine.generate([list(range(1, 60)), list(range(3, 9))], SamplingParams(max_tokens=6, temperature=0.0))
        steps = list(engine.step_history)
        assert steps and all(0.0 < s.cpu_s <= s.duration_s + 1e-3 for s in steps)
        # a step whose thread is off the core for 50 ms (as when other processes hold it): its wall time
        # grows by that, its CPU time does not
        run = engine.runner.run

        def run_then_wait(*args, **kwargs):
            out = run(*args, **kwargs)
            time.sleep(0.05)
            return out

        monkeypatch.setattr(engine.runner, "run", run_then_wait)
        engine.step_history.clear()
        engine.generate([list(range(5, 40))], SamplingParams(max_tokens=3, temperature=0.0))
        waited = list(engine.step_history)
        assert waited and all(s.duration_s >= 0.05 and 0.0 < s.cpu_s < s.duration_s - 0.04 for s in waited)
    finally:
        torch.set_num_threads(threads)


def test_decode_logits_do_not_depend_on_the_requests_order_in_the_step():
    """Bitwise: a request's decode logits are the same whatever the order of the step's requests (SDPA's CPU
    kernel sums in another order over a strided view of the queries than over a copy); alone, the same to float32
    rounding (this float32 model's GEMMs give a row other bits in a batch of fewer than four rows on some CPUs,
    AMD EPYC's MKL among them; the reduced paths' bitwise batch invariance is tested in test_quantization)."""
    from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput

    engine = tiny(num_kv_blocks=64, enable_prefix_caching=False)
    runner = engine.runner
    bs = engine.config.block_size
    short, long = _random_prompts(1, seed=3, lo=21, hi=21)[0], _random_prompts(1, seed=4, lo=45, hi=45)[0]
    prompts = {"short": short, "long": long}
    blocks = {"short": [1, 2], "long": [3, 4, 5, 6]}
    for rid, prompt in prompts.items():
        runner.prompt_logits(SchedulerOutput([ScheduledChunk(rid, prompt, 0, blocks[rid], True)], []))

    def decode(order: list[str]) -> dict[str, torch.Tensor]:
        chunks = [ScheduledChunk(rid, [7], len(prompts[rid]), blocks[rid], True) for rid in order]
        logits = runner.prompt_logits(SchedulerOutput(chunks, []))
        return dict(zip(order, logits, strict=True))

    assert len(prompts["long"]) > 2 * bs  # the two contexts differ in length: sorted, "short" comes first
    run = decode(["short", "long"])  # sorted by context length, the group is the step's rows in order
    shuffled = decode(["long", "short"])  # and here [1, 0]
    for rid in prompts:
        assert torch.equal(run[rid], shuffled[rid]), rid
        torch.testing.assert_close(run[rid], decode([rid])[rid], rtol=1e-5, atol=1e-5)
