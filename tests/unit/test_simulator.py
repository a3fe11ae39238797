"""pdserve.sim: the simulator drives the real scheduler, protocol and routing policy; cost model, demo, CLI."""

from __future__ import annotations

import json
import os

import pytest

import pdserve.engine.scheduler as engine_scheduler
from pdserve.cli.sim import main
from pdserve.sim.cost_model import RooflineCostModel, StepShape, chunk_context_tokens
from pdserve.sim.demo import compare_chunking, run_chunked_prefill_demo
from pdserve.sim.experiments import chunk_sweep, find_knee, max_rate_meeting_slo, pd_search
from pdserve.sim.profiles import (
    MODELS,
    get_hardware,
    get_model,
)
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.workload.generator import (
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
    interference_workload,
    random_workload,
    shared_prefix_workload,
)
from pdserve.workload.metrics import compute_metrics

H100_8B = RooflineCostModel(get_hardware("H100"), get_model("Llama-3-8B"))


def _steps(result):
    return [
        (s.worker, s.started, s.duration_s, s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs) for s in result.steps
    ]


def _worst_stream_itl(result) -> float:
    return max(g for r in result.records if r.label == "stream" for g in r.itls)


# ---- the scheduler is the engine's ------------------------------------------------------------------------


def test_chunk_equal_to_prompt_reproduces_unchunked_timeline():
    reqs = interference_workload(
        num_streams=4,
        stream_prompt_len=64,
        stream_output_len=40,
        num_long=2,
        long_prompt_len=3000,
        long_output_len=3,
        long_period_s=0.2,
        long_start_s=0.1,
    )
    budget = 4096  # the whole prompt plus every stream fits one step either way
    chunked = simulate(reqs, H100_8B, SimConfig(chunk_size=3000, max_num_batched_tokens=budget))
    unchunked = simulate(reqs, H100_8B, SimConfig(enable_chunked_prefill=False, max_num_batched_tokens=budget))
    assert _steps(chunked) == _steps(unchunked)
    assert [r.token_times for r in chunked.records] == [r.token_times for r in unchunked.records]
    assert max(s.num_prefill_tokens for s in chunked.steps) >= 3000  # the long prompt went through in one step
    smaller = simulate(reqs, H100_8B, SimConfig(chunk_size=1000, max_num_batched_tokens=budget))
    assert _steps(smaller) != _steps(unchunked)  # ...while a real chunk changes the timeline


def test_chunking_lowers_worst_itl_under_interference():
    reqs = interference_workload(
        num_streams=8,
        stream_prompt_len=128,
        stream_output_len=150,
        num_long=2,
        long_prompt_len=8192,
        long_output_len=2,
        long_period_s=0.4,
        long_start_s=0.2,
    )
    off = simulate(reqs, H100_8B, SimConfig(enable_chunked_prefill=False))
    on = simulate(reqs, H100_8B, SimConfig(chunk_size=512))
    assert _worst_stream_itl(on) * 4 < _worst_stream_itl(off)
    assert _worst_stream_itl(off) > 0.2  # an 8k prefill in one step stalls every stream ~0.25 s on H100/8B
    long_ttft = {
        name: compute_metrics([r for r in res.records if r.label == "long"]).ttft.mean_ms
        for name, res in (("off", off), ("on", on))
    }
    assert long_ttft["on"] > long_ttft["off"]  # the price: a slightly later first token for the long prompt


def test_max_num_seqs_changes_the_schedule(monkeypatch):
    calls = []
    real = engine_scheduler.Scheduler.schedule

    def spy(self):
        out = real(self)
        calls.append(len(out.chunks))
        return out

    monkeypatch.setattr(engine_scheduler.Scheduler, "schedule", spy)
    reqs = [WorkloadRequest(f"r{i}", [i % 256] * 100, 20, 0.0) for i in range(8)]
    # step by step (no coalesced decode runs): every step is one call of the engine's schedule()
    two = simulate(reqs, H100_8B, SimConfig(max_num_seqs=2, coalesce_decode_steps=False))
    eight = simulate(reqs, H100_8B, SimConfig(max_num_seqs=8, coalesce_decode_steps=False))
    assert max(s.num_seqs for s in two.steps) == 2
    assert max(s.num_seqs for s in eight.steps) == 8
    assert len(two.steps) > len(eight.steps)
    assert sum(1 for c in calls if c) == len(two.steps) + len(eight.steps)  # every step came from schedule()
    for res in (two, eight):
        assert all(r.ok and len(r.token_times) == 20 for r in res.records)


def test_preemption_when_blocks_run_out():
    reqs = [WorkloadRequest(f"r{i}", [(7 * i) % 256] * 64, 200, 0.0) for i in range(8)]
    tight = simulate(reqs, H100_8B, SimConfig(num_kv_blocks=40, block_size=16))
    roomy = simulate(reqs, H100_8B, SimConfig(num_kv_blocks=4000, block_size=16))
    assert sum(s.num_preempted for s in tight.steps) > 0
    assert sum(s.num_preempted for s in roomy.steps) == 0
    assert all(r.ok and len(r.token_times) == 200 for r in tight.records)
    too_long = simulate([WorkloadRequest("big", [1] * 1000, 2, 0.0)], H100_8B, SimConfig(num_kv_blocks=10))
    assert not too_long.records[0].ok and "KV blocks" in too_long.records[0].error


def test_concurrency_cap_and_stop_time():
    reqs = [WorkloadRequest(f"r{i}", [i] * 32, 10, 0.0) for i in range(6)]
    res = simulate(reqs, H100_8B, SimConfig(), max_concurrency=2)
    spans = [(r.send_time, r.token_times[-1]) for r in res.records]
    for t, _ in spans:
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert sorted(s for s, _ in spans)[2] > 0  # the third request waited for a slot
    stopped = simulate(reqs, H100_8B, SimConfig(stop_time_s=0.03))
    assert all(not r.ok and r.error == "unfinished at stop time" for r in stopped.records)
    assert all(s.started <= 0.03 for s in stopped.steps)


# ---- disaggregation ---------------------------------------------------------------------------------------


def test_disaggregated_kv_stream_overlaps_next_chunk():
    req = [WorkloadRequest("r", list(range(256)) * 16, 5, 0.0)]  # 4096 tokens = 4 chunks of 1024
    kvb = H100_8B.kv_bytes_per_token
    cfg = SimConfig(chunk_size=1024, enable_prefix_caching=False, kv_link_bw=50e9, kv_link_latency_s=1e-4)
    res = simulate(req, H100_8B, cfg, mode="disaggregated")
    rec = res.records[0]
    prefill = res.steps_of("prefill-0")
    assert [s.num_prefill_tokens for s in prefill] == [1024] * 4
    assert res.kv_bytes_moved == 4096 * kvb == rec.meta["kv_bytes"]
    assert rec.token_times[0] == pytest.approx(prefill[-1].ended)  # TTFT = the last chunk's step end
    # a chunk's transfer (2.7 ms) is shorter than a chunk's compute, so only the last one is exposed
    assert rec.meta["kv_done"] == pytest.approx(prefill[-1].ended + 1024 * kvb / 50e9 + 1e-4)
    assert rec.token_times[1] > rec.meta["kv_done"] and len(rec.token_times) == 5
    decode = res.steps_of("decode-0")
    assert all(s.num_prefill_tokens == 0 for s in decode) and decode[0].started == pytest.approx(rec.meta["kv_done"])
    # a slow link (1 GB/s: 134 ms per chunk) is busy back to back from the first chunk's end
    slow = simulate(req, H100_8B, SimConfig(**{**cfg.to_dict(), "kv_link_bw": 1e9}), mode="disaggregated")
    first_end = slow.steps_of("prefill-0")[0].ended
    assert slow.records[0].meta["kv_done"] == pytest.approx(first_end + 4 * 1024 * kvb / 1e9 + 1e-4)


def test_colocated_vs_disaggregated_same_work_and_prefix_hits_skip_transfer():
    reqs = random_workload(40, prompt_len_mean=600, output_len_mean=30, rate=20.0, seed=3)
    colo = simulate(reqs, H100_8B, SimConfig(chunk_size=512), num_instances=2)
    dis = simulate(reqs, H100_8B, SimConfig(chunk_size=512), mode="disaggregated")
    for res in (colo, dis):
        assert all(r.ok for r in res.records)
        assert [len(r.token_times) for r in res.records] == [r.max_tokens for r in reqs]
    assert colo.kv_bytes_moved == 0 and colo.num_gpus == dis.num_gpus == 2
    sp = shared_prefix_workload(30, num_prefixes=2, prefix_len=512, suffix_len=16, output_len=4, rate=50.0, seed=1)
    full = sum(r.num_prompt_tokens for r in sp) * H100_8B.kv_bytes_per_token
    cached = simulate(sp, H100_8B, SimConfig(), mode="disaggregated")
    uncached = simulate(sp, H100_8B, SimConfig(enable_prefix_caching=False), mode="disaggregated")
    assert uncached.kv_bytes_moved == full
    assert cached.kv_bytes_moved < full / 2  # the decode side already holds the shared system prompts


def test_disaggregated_waits_for_decode_blocks():
    reqs = [WorkloadRequest(f"r{i}", [(3 * i) % 256] * 200, 50, 0.0) for i in range(6)]
    res = simulate(reqs, H100_8B, SimConfig(num_kv_blocks=40, block_size=16), mode="disaggregated", num_decode=1)
    assert all(r.ok and len(r.token_times) == 50 for r in res.records)
    ttfts = sorted(r.ttft for r in res.records)
    assert ttfts[-1] > 3 * ttfts[0]  # later requests could only start once blocks were free


# ---- the router's policy and the protocol are the real ones ---------------------------------------------


def test_requests_are_routed_by_the_routers_policy(monkeypatch):
    from pdserve.router import policy as policy_mod

    reqs = random_workload(12, prompt_len_mean=300, output_len_mean=10, rate=50.0, seed=4)
    spread = simulate(reqs, H100_8B, SimConfig(), num_instances=2)
    assert {r.meta["decode_worker"] for r in spread.records} == {"decode-0", "decode-1"}
    real_route = policy_mod.RoutingPolicy.route
    calls = []

    def always_decode_1(self, prompt, max_tokens, mode, block_hashes=None):
        calls.append(mode)
        return real_route(self, prompt, max_tokens, mode, block_hashes)._replace(decode_worker="decode-1")

    monkeypatch.setattr(policy_mod.RoutingPolicy, "route", always_decode_1)
    pinned = simulate(reqs, H100_8B, SimConfig(), num_instances=2)
    assert len(calls) == len(reqs)  # one routing decision per request, by the policy
    assert {r.meta["decode_worker"] for r in pinned.records} == {"decode-1"}
    assert not pinned.steps_of("decode-0") and all(r.ok for r in pinned.records)


def test_auto_follows_the_routers_threshold():
    reqs = [WorkloadRequest(f"short-{i}", [i] * 100, 8, 0.01 * i) for i in range(4)]
    reqs += [WorkloadRequest(f"long-{i}", [50 + i] * 2000, 8, 0.005 + 0.01 * i) for i in range(3)]
    res = simulate(reqs, H100_8B, SimConfig(auto_min_remote_tokens=512), mode="auto")
    modes = {r.request_id: r.meta["mode"] for r in res.records}
    assert all(modes[f"short-{i}"] == "colocated" for i in range(4))
    assert all(modes[f"long-{i}"] == "disaggregated" for i in range(3))
    assert sum(s.num_prefill_tokens for s in res.steps_of("prefill-0")) == 3 * 2000  # only the long prompts
    assert res.kv_bytes_moved == 3 * 2000 * H100_8B.kv_bytes_per_token
    everything_local = simulate(reqs, H100_8B, SimConfig(auto_min_remote_tokens=5000), mode="auto")
    assert {r.meta["mode"] for r in everything_local.records} == {"colocated"}
    assert not everything_local.steps_of("prefill-0")


def test_prefill_instance_reserves_when_a_prefill_is_about_to_start():
    # six 1000-token prompts at once; budget 512: the prefill instance admits (and reserves) one at a time
    reqs = [WorkloadRequest(f"r{i}", [i] * 1000, 4, 0.0) for i in range(6)]
    res = simulate(reqs, H100_8B, SimConfig(max_num_batched_tokens=512), mode="disaggregated")
    records = sorted(res.records, key=lambda r: r.request_id)
    reserved = [r.meta["reserved_at"] for r in records]
    starts = [s.started for s in res.steps_of("prefill-0")]
    assert reserved[0] == 0.0
    for k in range(1, 6):
        # r{k} waits in the FIFO until r{k-1} has left the engine's waiting queue (its first step
        # started), and is reserved before r{k-1}'s prefill is done
        began = min(t for t in starts if t >= reserved[k - 1])
        assert began <= reserved[k] < records[k - 1].token_times[0]
    assert all(r.ok and len(r.token_times) == 4 for r in res.records)


def test_deployment_latencies_shift_tokens_and_delay_the_handoff():
    req = [WorkloadRequest("r", [1] * 600, 4, 0.0)]
    base = SimConfig(chunk_size=512, enable_prefix_caching=False)
    plain = simulate(req, H100_8B, base, mode="disaggregated").records[0]
    late = SimConfig(**{**base.to_dict(), "token_latency_s": 0.003, "control_latency_s": 0.010})
    res = simulate(req, H100_8B, late, mode="disaggregated")
    rec = res.records[0]
    # one call to the prefill worker, the reservation's round trip, then the same prefill
    assert rec.ttft == pytest.approx(plain.ttft + 3 * 0.010 + 0.003)
    # the decode call leaves the router once the first token is there: its step starts after that
    first_decode = res.steps_of("decode-0")[0]
    assert first_decode.started == pytest.approx(rec.token_times[0] + 0.010)
    assert rec.token_times[1] == pytest.approx(first_decode.ended + 0.003)


def test_the_paths_between_the_workers_take_their_own_latencies():
    req = [WorkloadRequest("r", [1] * 600, 4, 0.0)]
    base = SimConfig(chunk_size=512, enable_prefix_caching=False)
    plain = simulate(req, H100_8B, base, mode="disaggregated").records[0]
    between = {
        "token_latency_s": 0.003,
        "control_latency_s": 0.010,
        "reserve_latency_s": 0.004,
        "handoff_latency_s": 0.006,
    }
    res = simulate(req, H100_8B, SimConfig(**{**base.to_dict(), **between}), mode="disaggregated")
    rec = res.records[0]
    # the client's call to the prefill worker, then the reservation's round trip between the workers (not two
    # more client calls), then the same prefill
    assert rec.ttft == pytest.approx(plain.ttft + 0.010 + 0.004 + 0.003)
    # the decode worker takes the request in the handoff's latency after the prefill worker sampled its first token
    prefill_end = res.steps_of("prefill-0")[-1].ended
    assert res.steps_of("decode-0")[0].started == pytest.approx(prefill_end + 0.006)
    with pytest.raises(ValueError, match="reserve_latency_s"):
        SimConfig(reserve_latency_s=-0.001)


# ---- cost model and profiles ------------------------------------------------------------------------------


def test_roofline_cost_model():
    m, hw = get_model("Llama-3-8B"), get_hardware("H100")
    assert abs(m.num_params / 8.03e9 - 1) < 0.01 and m.kv_bytes_per_token == 131072
    decode = H100_8B.breakdown(StepShape.from_chunks([(100, 1, True)]))
    assert decode.gemm > 0.9 * m.step_weight_bytes / (hw.mem_bw * hw.bw_efficiency)  # decode streams the weights
    prefill = StepShape.from_chunks([(0, 4096, True)])
    pc = H100_8B.breakdown(prefill)
    assert pc.gemm > 0.9 * 2 * m.matmul_params * 4096 / (hw.peak_flops * hw.mfu)  # prefill computes
    tp2 = RooflineCostModel(hw, m, tp=2)
    t2 = tp2.breakdown(prefill)
    assert t2.all_reduce > 0 and pc.total / 2 < t2.total < pc.total
    # piggybacking: 24 decodes added to a 1024-token chunk cost far less than a decode-only step
    mixed = H100_8B.step_time(StepShape.from_chunks([(0, 1024, False)] + [(500, 1, True)] * 24))
    alone = H100_8B.step_time(StepShape.from_chunks([(0, 1024, False)]))
    assert mixed - alone < 0.5 * H100_8B.step_time(StepShape.from_chunks([(500, 1, True)] * 24))
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCostModel(hw, get_model("Llama-3-70B")).kv_capacity_tokens()
    assert RooflineCostModel(hw, get_model("Llama-3-70B"), tp=4).kv_capacity_tokens() > 100_000
    assert chunk_context_tokens(10, 3) == 11 + 12 + 13


def test_a_step_splits_into_its_prefill_and_its_decodes():
    chunks = [(64, 256, False), (0, 100, True), (300, 1, True), (40, 1, True)]
    prefill, decode = StepShape.from_chunks(chunks).split()
    assert prefill == StepShape.from_chunks(chunks[:2])
    assert decode == StepShape.from_chunks(chunks[2:])


def test_presets_match_engine_configs():
    from pdserve.engine.config import ModelConfig

    for name in ("tiny", "bench"):
        c, p = ModelConfig.preset(name), MODELS[name]
        assert (
            p.hidden_size,
            p.num_layers,
            p.num_heads,
            p.num_kv_heads,
            p.head_dim,
            p.intermediate_size,
            p.vocab_size,
            p.tie_word_embeddings,
            p.max_context,
        ) == (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            c.tie_word_embeddings,
            c.max_position_embeddings,
        )


# ---- demo, experiments, CLI -------------------------------------------------------------------------------


def test_demo_scenario():
    on = run_chunked_prefill_demo(H100_8B)  # 8k prompt, chunk 1024, 24 decodes, 50 ms target
    assert on.steps_in_window == 8 and on.steps_over_target == 0
    assert all(s.num_prefill_tokens == 1024 and s.num_decode_tokens == 24 for s in on.window_steps)
    assert on.worst_decode_stall_ms < 50 < on.long_prompt_ttft_ms
    assert on.long_prompt_ttft_ms == pytest.approx(sum(s.duration_s for s in on.window_steps) * 1000)
    assert on.decode_throughput_tok_s == pytest.approx(24 * 8 / (on.long_prompt_ttft_ms / 1000))
    cmp = compare_chunking(H100_8B, prompt_len=32768)
    assert cmp.off.steps_in_window == 1 and cmp.on.steps_in_window == 32
    assert cmp.worst_itl_ratio > 10


def test_chunk_sweep_knee_and_rate_search():
    reqs = interference_workload(
        num_streams=8,
        stream_prompt_len=64,
        stream_output_len=200,
        num_long=3,
        long_prompt_len=8192,
        long_output_len=2,
        long_period_s=0.5,
        long_start_s=0.2,
    )
    pts = chunk_sweep(reqs, H100_8B, [256, 1024, 8192])
    assert pts[0].p99_itl_ms < pts[1].p99_itl_ms < pts[2].p99_itl_ms
    assert pts[0].prefill_throughput_tok_s < pts[1].prefill_throughput_tok_s < pts[2].prefill_throughput_tok_s
    assert find_knee(pts, 50.0).chunk_size == 1024
    # the search finds the threshold of a monotone attainment curve
    assert max_rate_meeting_slo(lambda r: 1.0 if r <= 37.0 else 0.0, 0.9, 4.0, iterations=12) == pytest.approx(
        37.0, rel=0.01
    )


@pytest.mark.slow
def test_pd_search_over_shapes_parallelism_gpu_counts_and_seeds():
    from pdserve.sim.experiments import SearchSpace, shape_goodputs

    spec = WorkloadSpec(num_requests=24, rate=8.0, prompt_len_mean=1200, output_len_mean=30, seed=2)
    slo = {"ttft": 300, "tpot": 25}

    def costs(tp: int, pp: int) -> RooflineCostModel:
        return RooflineCostModel(get_hardware("H100"), get_model("Llama-3-8B"), tp, "smooth", pp)

    space = SearchSpace(tps=(1, 2), prefill_pps=(1, 2), budgets=(512,), seeds=(0, 1, 2), verify_disaggregated=2)
    config = SimConfig(max_num_batched_tokens=512)
    shapes = shape_goodputs(spec, costs, 3, slo, config, space, 0.9, 3, 0.0)
    kinds = {(s.role, s.tp, s.pp, s.label) for s in shapes}
    assert ("prefill", 1, 1, "whole prompts") in kinds and ("prefill", 1, 2, "chunk 512") in kinds
    assert ("decode", 1, 1, "") in kinds and ("colocated", 1, 1, "prefill-first") in kinds
    assert all(s.num_gpus <= 2 for s in shapes if s.role != "colocated")  # one GPU is left for the other role
    assert all(s.goodput > 0 for s in shapes)
    rows = pd_search(spec, costs, 3, slo, config, iterations=3, space=space)
    assert len(rows) == 2 + 2 + 1  # two placements, two colocated shapes, the best placement under auto
    assert all(r.num_seeds == 3 and r.goodput_min <= r.goodput <= r.goodput_max for r in rows)
    assert all(r.goodput_per_gpu == pytest.approx(r.goodput / r.num_gpus) and r.num_gpus <= 3 for r in rows)
    assert [r.goodput_per_gpu for r in rows] == sorted((r.goodput_per_gpu for r in rows), reverse=True)
    disaggregated = [r for r in rows if r.mode == "disaggregated"]
    assert all(r.predicted_goodput and r.kv_bytes_moved > 0 for r in disaggregated)
    assert any(r.mode == "auto" for r in rows) and any(r.mode == "colocated" for r in rows)
    with pytest.raises(ValueError, match="give SLOs"):
        pd_search(spec, costs, 3, {})


def test_placements_cover_every_gpu_count_up_to_n_and_predict_the_slower_side():
    from pdserve.sim.experiments import Architecture, ShapeGoodput, placements

    arch = Architecture("x", "disaggregated", 1, 1, 2, True)
    prefill = ShapeGoodput("prefill", 2, 1, "whole prompts", 10.0, arch)  # 2 GPUs, 10 req/s
    decode = ShapeGoodput("decode", 1, 1, "", 6.0, arch)  # 1 GPU, 6 req/s
    found = placements([prefill, decode], 5)
    counts = {(p.num_prefill, p.num_decode) for p in found}
    assert counts == {(1, 1), (1, 2), (1, 3), (2, 1)}  # every fit of at most 5 GPUs, 3-GPU 1P:1D included
    by = {(p.num_prefill, p.num_decode): p for p in found}
    assert by[(1, 1)].predicted == 6.0 and by[(1, 2)].predicted == 10.0 and by[(2, 1)].predicted == 6.0
    assert by[(1, 2)].num_gpus == 4 and found[0] is by[(1, 2)]  # 2.5 req/s per GPU: the best
    assert [p.predicted / p.num_gpus for p in found] == sorted((p.predicted / p.num_gpus for p in found), reverse=True)


def test_later_seeds_refine_near_the_first_answer():
    from pdserve.sim.experiments import refine_rate

    calls: list[float] = []

    def attain(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= 11.0 else 0.5

    assert refine_rate(attain, 0.9, 10.0, 5) == pytest.approx(11.0, rel=0.03)
    assert len(calls) == 7 and min(calls) >= 8.0 and max(calls) <= 12.5  # inside [0.8, 1.25] x the guess
    calls.clear()
    assert refine_rate(attain, 0.9, 30.0, 4) <= 11.0  # a guess far off: searched from the bracket's end


def test_cli_run_writes_every_file(tmp_path):
    out = str(tmp_path / "ab")
    rc = main(
        [
            "--out",
            out,
            "--num-requests",
            "20",
            "--rate",
            "40",
            "--slo",
            "ttft=300,tpot=50",
            "--max-chunk-tokens",
            "512",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--quiet",
        ]
    )
    assert rc == 0
    names = set(os.listdir(out))
    assert {"results.json", "report.md", "itl_cdf.png", "ttft_cdf.png", "throughput_latency.png"} <= names
    assert {
        "timeline_colocated-x2-decode-0.png",
        "timeline_disaggregated-1P-1D-prefill-0.png",
        "timeline_disaggregated-1P-1D-decode-0.png",
    } <= names
    doc = json.load(open(os.path.join(out, "results.json")))
    assert [r["name"] for r in doc["runs"]] == ["colocated x2", "disaggregated 1P:1D"]
    assert all(len(r["requests"]) == 20 and r["requests"][0]["token_times"] for r in doc["runs"])
    assert doc["runs"][1]["kv_bytes_moved"] > 0
    md = open(os.path.join(out, "report.md")).read()
    assert "| colocated x2 |" in md and "| disaggregated 1P:1D |" in md


def test_cli_demo_sweep_and_errors(tmp_path, capsys):
    out = str(tmp_path / "demo")
    assert main(["--demo", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "worst decode stall" in text and "better with chunking" in text
    doc = json.load(open(os.path.join(out, "results.json")))
    assert doc["extra"]["demo"]["main"]["steps_over_target"] == 0
    assert {"timeline_demo_on.png", "timeline_demo_long_off.png"} <= set(os.listdir(out))
    sweep_out = str(tmp_path / "sweep")
    assert (
        main(
            [
                "--sweep",
                "chunk=256,1024",
                "--num-requests",
                "2",
                "--num-streams",
                "4",
                "--stream-output-len",
                "100",
                "--out",
                sweep_out,
                "--quiet",
            ]
        )
        == 0
    )
    assert "chunk_sweep.png" in os.listdir(sweep_out)
    assert main(["--hardware", "TPU", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert main(["--slo", "ttft=oops", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert main(["--sweep", "chunks=1", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert (
        main(
            [
                "--hardware",
                "cpu-measured",
                "--calibration",
                str(tmp_path / "missing.json"),
                "--quiet",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )


def test_library_api_settings_to_results():
    from pdserve.sim import SimSettings, Simulation

    requests = build_workload(WorkloadSpec(kind="random", num_requests=12, rate=20.0, seed=3)).requests
    sim = Simulation(SimSettings(mode="all", prefill_workers=1, decode_workers=3, slo="ttft=300,tpot=50"))
    runs = sim.architectures(requests)
    assert [r.name for r in runs] == ["colocated x4", "disaggregated 1P:3D", "auto 1P:3D"]
    assert all(len(r.result.records) == len(requests) for r in runs) and sim.slo_ms == {"ttft": 300.0, "tpot": 50.0}
    alone = Simulation(SimSettings(mode="colocated", decode_workers=2)).architectures(requests)
    assert [r.name for r in alone] == ["colocated x2"]  # alone, colocated has the decode workers (as in serve)
    demo = Simulation(SimSettings(mode="disaggregated", decode_workers=2)).demo(4096, 512, 8)
    assert demo.architecture == "disaggregated 1P:2D" and demo.chunk_size == 512
    with pytest.raises(ValueError, match="unknown"):
        Simulation(SimSettings(hardware="abacus"))
    with pytest.raises(ValueError, match="decode_workers"):
        SimSettings(decode_workers=0)
