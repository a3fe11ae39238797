"""The cost models' formulas, pinned: each kernel group priced on its own, the blended roofline of a matrix product,
the weights a step streams, the per-sequence overhead, the per-request quadratic term, the KV capacity."""

from __future__ import annotations

import math

import pytest

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import RooflineCostModel, StepShape, blend
from pdserve.sim.cost_profile import PolynomialCostModel, parse_cost_profile
from pdserve.sim.profiles import ModelProfile, get_hardware, get_model
from pdserve.sim.simulator import simulate
from pdserve.workload.generator import WorkloadRequest

A100, LLAMA = get_hardware("A100"), get_model("Llama-3-8B")
A100_8B = RooflineCostModel(A100, LLAMA)
FLOPS, BW = A100.peak_flops * A100.mfu, A100.mem_bw * A100.bw_efficiency


def test_a_mixed_step_adds_its_decodes_kv_reads_to_its_matrix_products():
    chunk, decodes = [(0, 480, True)], [(999, 1, True)] * 32  # Sarathi's 512-token step near saturation
    mixed = A100_8B.breakdown(StepShape.from_chunks(chunk + decodes))
    kv_read = 32 * 1000 * LLAMA.kv_bytes_per_token
    decode_attention = blend(LLAMA.attn_flops_per_context_token * 32 * 1000 / FLOPS, kv_read / BW)
    assert mixed.decode_attention == pytest.approx(decode_attention)
    assert mixed.decode_attention > 0.05 * mixed.total  # 2.7 ms of a 39 ms step: not hidden under the GEMMs
    gemm = blend((2 * LLAMA.matmul_params * 512 + 2 * LLAMA.lm_head_params * 33) / FLOPS, LLAMA.step_weight_bytes / BW)
    assert mixed.gemm == pytest.approx(gemm)
    assert mixed.total == pytest.approx(
        mixed.overhead + mixed.gemm + mixed.prefill_attention + mixed.decode_attention + mixed.elementwise
    )
    # the same step without the decodes' KV reads (a fresh context) is cheaper by about that read
    fresh = A100_8B.breakdown(StepShape.from_chunks(chunk + [(0, 1, True)] * 32))
    assert mixed.total - fresh.total == pytest.approx(mixed.decode_attention - fresh.decode_attention)


# Vidur's published A100 profile of Llama-3-8B (microsoft/vidur, data/profiling/compute/a100/meta-llama/
# Meta-Llama-3-8B/mlp.csv, TP 1, medians): one layer's four matrix products (attn_pre_proj + attn_post_proj +
# mlp_up_proj + mlp_down_proj), ms, by rows
VIDUR_LAYER_GEMM_MS = {1: 0.276, 64: 0.324, 120: 0.3745, 384: 0.797, 512: 0.994, 32768: 61.9}


def test_a_matrix_product_blends_compute_and_memory_so_the_fraction_of_peak_grows_with_the_rows():
    layer_params = LLAMA.matmul_params // LLAMA.num_layers
    assert blend(3.0, 4.0) == 5.0 and blend(3.0, 4.0, "max") == 4.0 and blend(3.0, 4.0, "sum") == 7.0
    reached = {}
    for rows, measured_ms in VIDUR_LAYER_GEMM_MS.items():
        compute, memory = 2 * layer_params * rows / FLOPS, layer_params * LLAMA.dtype_bytes / BW
        priced = math.hypot(compute, memory)
        assert priced == pytest.approx(measured_ms / 1000, rel=0.08), rows  # within 8 % of the published profile
        reached[rows] = 2 * layer_params * rows / priced / A100.peak_flops
    assert reached[1] < 0.01 < reached[64] < reached[512] < reached[32768] <= A100.mfu  # not a constant 55 %
    assert reached[32768] > 0.99 * A100.mfu


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_streams_the_layers_and_the_lm_head_not_the_embedding_table(tied):
    model = ModelProfile("m", 4, 1024, 8, 8, 128, 4096, 50000, tie_word_embeddings=tied)
    cost = RooflineCostModel(A100, model)
    step = cost.breakdown(StepShape.from_chunks([(10, 1, True)]))
    streamed = (model.matmul_params + model.vocab_size * model.hidden_size) * model.dtype_bytes
    assert model.step_weight_bytes == streamed
    assert step.gemm == pytest.approx(blend(2 * streamed / model.dtype_bytes / FLOPS, streamed / BW))
    if not tied:
        embedding_and_final_norm = (model.vocab_size + 1) * model.hidden_size * model.dtype_bytes
        assert model.weight_bytes - model.step_weight_bytes == embedding_and_final_norm


def test_the_per_step_overhead_grows_with_the_sequences_in_the_step():
    for batch in (1, 16, 128):
        step = A100_8B.breakdown(StepShape.from_chunks([(500, 1, True)] * batch))
        assert step.overhead == pytest.approx(A100.step_overhead_s + A100.seq_overhead_s * batch)
    assert A100.seq_overhead_s > 0


PROFILE = {
    "name": "poly",
    "prefill_ms": {"const": 10.0, "tokens": 0.1, "tokens_sq": 1e-4},
    "decode_ms": {"const": 8.0, "context_tokens": 0.001, "batch_size": 0.5},
    "kv_bytes_per_token": 1000,
    "kv_link_gb_per_s": 10.0,
}


def test_the_quadratic_prefill_term_is_per_request_not_of_the_steps_total():
    cost = PolynomialCostModel(parse_cost_profile(PROFILE))
    two = StepShape.from_chunks([(0, 100, False), (0, 100, True)])
    one = StepShape.from_chunks([(0, 200, True)])
    assert cost.step_time(two) == pytest.approx((10 + 0.1 * 200 + 1e-4 * (100**2 + 100**2)) / 1000)
    assert cost.step_time(one) == pytest.approx((10 + 0.1 * 200 + 1e-4 * 200**2) / 1000)
    later = StepShape.from_chunks([(300, 100, True)])  # a chunk after 300 cached tokens: n * (s + n)
    assert later.prefill_square_tokens == 100 * 400
    assert cost.step_time(later) == pytest.approx((10 + 0.1 * 100 + 1e-4 * 100 * 400) / 1000)


def test_fits_per_tp_and_role_and_a_large_batch_decode_fit():
    doc = {
        **PROFILE,
        "decode_ms_large_batch": {"from_batch_size": 4, "const": 2.0, "context_tokens": 0.002, "batch_size": 1.0},
        "fits": [
            {"tp": 2, "prefill_ms": {"const": 5, "tokens": 0.05, "tokens_sq": 0}, "decode_ms": PROFILE["decode_ms"]},
            {
                "tp": 2,
                "role": "prefill",
                "prefill_ms": {"const": 4, "tokens": 0.04, "tokens_sq": 0},
                "decode_ms": PROFILE["decode_ms"],
            },
        ],
    }
    profile = parse_cost_profile(doc)
    assert profile.tp_degrees == (1, 2)
    prompt = StepShape.from_chunks([(0, 100, True)])
    assert PolynomialCostModel(profile, tp=2).step_time(prompt, "colocated") == pytest.approx(0.010)
    assert PolynomialCostModel(profile, tp=2).step_time(prompt, "prefill") == pytest.approx(0.008)
    small = StepShape.from_chunks([(99, 1, True)] * 3)
    large = StepShape.from_chunks([(99, 1, True)] * 4)
    tp1 = PolynomialCostModel(profile)
    assert tp1.step_time(small) == pytest.approx((8 + 0.001 * 300 + 0.5 * 3) / 1000)
    assert tp1.step_time(large) == pytest.approx((2 + 0.002 * 400 + 1.0 * 4) / 1000)
    with pytest.raises(ValueError, match="no fit for tp=4"):
        PolynomialCostModel(profile, tp=4)
    with pytest.raises(ValueError, match=r"fits\[1\]: a second fit for tp=2, role prefill"):
        parse_cost_profile({**doc, "fits": [doc["fits"][1], doc["fits"][1]]})


def test_kv_capacity_follows_the_gpu_memory_the_weights_and_the_utilisation():
    m = LLAMA
    expected = int((A100.mem_bytes * 0.9 - m.weight_bytes) // m.kv_bytes_per_token)
    assert A100.gpu_memory_utilization == 0.9 and A100_8B.kv_capacity_tokens() == expected
    assert RooflineCostModel(A100, m, tp=2).kv_capacity_tokens() == int(
        (2 * A100.mem_bytes * 0.9 - m.weight_bytes) // m.kv_bytes_per_token
    )
    opt = {**PROFILE, "kv_bytes_per_token": 819200, "gpu_memory_gib": 80, "weight_gb": 25.7}
    profile = parse_cost_profile(opt)
    assert profile.kv_capacity_given
    assert profile.kv_capacity(1) == int((80 * 2**30 * 0.9 - 25.7e9) // 819200)  # ~63k tokens, not a million
    assert parse_cost_profile({**opt, "gpu_memory_utilization": 0.5}).kv_capacity(2) == int(
        (2 * 80 * 2**30 * 0.5 - 25.7e9) // 819200
    )
    assert parse_cost_profile({**opt, "kv_capacity_tokens": 5000}).kv_capacity(1) == 5000  # overridden
    assert not parse_cost_profile(PROFILE).kv_capacity_given
    with pytest.raises(ValueError, match="do not fit"):
        parse_cost_profile({**opt, "weight_gb": 200}).kv_capacity(1)
    # the simulator sizes each instance's pool from its own model, unless told the blocks
    reqs = [WorkloadRequest("a", list(range(100)), 2, 0.0)]
    cost = PolynomialCostModel(profile)
    assert simulate(reqs, cost, SimConfig()).config["num_kv_blocks"] == profile.kv_capacity(1) // 16
    assert simulate(reqs, cost, SimConfig(num_kv_blocks=77)).config["num_kv_blocks"] == 77
