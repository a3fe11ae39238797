"""Goodput as DistServe and Sarathi-Serve define it: per-request SLO attainment, the rate search, per GPU; the CLI."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from pdserve.cli.sim import main
from pdserve.sim.cost_profile import PolynomialCostModel, parse_cost_profile
from pdserve.sim.experiments import Architecture, rank_rows, search_goodput
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.workload.generator import WorkloadSpec, build_workload

MODEL = PolynomialCostModel(
    parse_cost_profile(
        {
            "name": "goodput-test",
            "prefill_ms": {"const": 4.0, "tokens": 0.05, "tokens_sq": 0.0},
            "decode_ms": {"const": 6.0, "context_tokens": 0.0001, "batch_size": 0.2},
            "kv_bytes_per_token": 1024,
            "kv_link_gb_per_s": 10.0,
        }
    )
)
SPEC = WorkloadSpec(num_requests=40, rate=4.0, prompt_len_mean=400, output_len_mean=20, seed=3)
SLO = {"ttft": 60.0, "tpot": 12.0}
CONFIG = SimConfig(chunk_size=256, **MODEL.profile.sim_settings())


def _attainment(arch: Architecture, rate: float, min_duration_s: float) -> float:
    num = max(SPEC.num_requests, math.ceil(rate * min_duration_s))
    reqs = build_workload(replace(SPEC, rate=rate, num_requests=num)).requests
    res = simulate(
        reqs, MODEL, CONFIG, mode=arch.mode, num_instances=arch.num_instances, num_prefill=1, num_decode=1, tp=2
    )
    return res.metrics(SLO).slo_attainment


def test_goodput_is_the_highest_rate_at_which_90_percent_attain():
    arch = Architecture("colocated x2", "colocated", 0, 0, 2, True)
    row = search_goodput(arch, SPEC, MODEL, SLO, CONFIG, tp=2, iterations=7, min_duration_s=5.0)
    assert row.goodput is not None and row.goodput > SPEC.rate
    assert row.num_gpus == 4 and row.goodput_per_gpu == pytest.approx(row.goodput / 4)  # 2 instances x tp 2
    assert _attainment(arch, row.goodput, 5.0) >= 0.9
    assert _attainment(arch, row.goodput * 1.1, 5.0) < 0.9  # above the search's resolution, attainment drops
    # at the workload's own rate: the attainments of the run there, each SLO alone and both together
    m = simulate(build_workload(SPEC).requests, MODEL, CONFIG, num_instances=2, tp=2).metrics(SLO)
    assert (row.slo_attainment, row.ttft_attainment, row.tpot_attainment) == (
        m.slo_attainment,
        m.ttft_attainment,
        m.tpot_attainment,
    )
    assert row.slo_attainment <= min(row.ttft_attainment, row.tpot_attainment)
    with pytest.raises(ValueError, match="give SLOs"):
        search_goodput(arch, SPEC, MODEL, {}, CONFIG)
    with pytest.raises(ValueError, match="attainment target"):
        search_goodput(arch, SPEC, MODEL, SLO, CONFIG, attainment=1.5)


def test_without_the_rate_search_the_rank_falls_back_to_the_workloads_rate():
    archs = [
        Architecture("colocated x2", "colocated", 0, 0, 2, True),
        Architecture("disaggregated 1P:1D", "disaggregated", 1, 1, 2, True),
    ]
    rows = [search_goodput(a, SPEC, MODEL, SLO, CONFIG, search_rate=False) for a in archs]
    assert all(r.goodput is None and r.goodput_per_gpu is None for r in rows)
    ranked = rank_rows(rows)
    assert ranked[0].request_goodput_per_gpu >= ranked[1].request_goodput_per_gpu


def _json_out(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_cli_goodput_and_pd_search_as_json(tmp_path, capsys):
    common = ["--num-requests", "16", "--rate", "6", "--prompt-len-mean", "800", "--output-len-mean", "20"]
    common += ["--seed", "1", "--slo", "ttft=400,tpot=40", "--max-chunk-tokens", "512", "--pd-min-duration", "1"]
    doc = _json_out(capsys, ["--goodput", "--json", "--out", str(tmp_path / "g"), *common])
    archs = doc["architectures"]
    assert sorted(a["name"] for a in archs) == ["colocated x2", "disaggregated 1P:1D"]
    for a in archs:
        assert a["goodput_per_gpu"] > 0 and a["goodput_per_gpu"] == pytest.approx(a["goodput"] / a["num_gpus"])
        assert 0 <= a["ttft_attainment"] <= 1 and 0 <= a["tpot_attainment"] <= 1
    assert archs[0]["goodput_per_gpu"] >= archs[1]["goodput_per_gpu"]  # best first
    search = ["--pd-search", "2", "--pd-tp", "1", "--pd-chunks", "512", "--pd-seeds", "2", "--jobs", "1"]
    doc = _json_out(capsys, [*search, "--json", "--out", str(tmp_path / "pd"), *common])
    names = [a["name"] for a in doc["architectures"]]
    assert "1P(tp1):1D(tp1) whole prompts" in names and "colocated tp1 chunk 512" in names
    assert "colocated tp1 prefill-first" in names or "colocated tp1 chunk 512" in names
    assert all(
        a["num_seeds"] == 2 and a["goodput_min"] <= a["goodput"] <= a["goodput_max"] for a in doc["architectures"]
    )
    per_gpu = [a["goodput_per_gpu"] for a in doc["architectures"]]
    assert per_gpu == sorted(per_gpu, reverse=True)
    # a plain run as JSON: its metrics carry the attainments
    doc = _json_out(capsys, ["--json", "--out", str(tmp_path / "r"), *common])
    assert {r["name"] for r in doc["runs"]} == {"colocated x2", "disaggregated 1P:1D"}
    assert all(0 <= r["ttft_attainment"] <= 1 for r in doc["runs"])
    assert main(["--goodput", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "--goodput: give SLOs" in capsys.readouterr().err


def test_published_setups_use_the_papers_models_and_length_distributions():
    from pdserve.sim.profiles import get_model
    from pdserve.sim.published import lognormal_from_median_p90

    assert get_model("OPT-13B").num_params == pytest.approx(12.85e9, rel=0.01)  # OPT-13B's 12.85B parameters
    assert get_model("OPT-13B").kv_bytes_per_token == 2 * 40 * 5120 * 2  # multi-head attention, fp16
    assert get_model("Mistral-7B").num_params == pytest.approx(7.24e9, rel=0.01)
    mean, sigma = lognormal_from_median_p90(1730, 5696)
    assert math.exp(math.log(mean) - sigma**2 / 2) == pytest.approx(1730)  # the median back
    assert math.exp(math.log(1730) + 1.2815515655446004 * sigma) == pytest.approx(5696)  # and the P90


def test_distserves_measured_runs_ship_whole_and_the_published_fits_load():
    from pdserve.sim.cost_profile import PUBLISHED_PROFILES, load_cost_profile
    from pdserve.sim.published import DISTSERVE_REFERENCE, load_distserve_reference

    with open(DISTSERVE_REFERENCE, encoding="utf-8") as f:
        doc = json.load(f)
    assert "Apache-2.0" in doc["licence"] and "LLMServe/DistServe" in doc["source"]
    runs = load_distserve_reference()
    assert [r.name for r in runs] == list(doc["runs"])
    for run in runs:  # the rounded rows give back the averages the measured file printed
        summary = doc["runs"][run.name]["summary"]
        assert len(run.requests) == int(run.name.split("-")[-2])
        assert statistics.mean(r[3] for r in run.requests) == pytest.approx(summary["avg_ttft_ms"], abs=0.05)
        assert statistics.mean(r[4] for r in run.requests) == pytest.approx(summary["avg_tpot_ms"], abs=0.05)
        assert [r[2] for r in run.requests] == sorted(r[2] for r in run.requests) and run.requests[0][2] == 0.0
    for name in PUBLISHED_PROFILES:
        profile = load_cost_profile(name)
        assert profile.tp_degrees == (1, 2, 4) and "Apache-2.0" in profile.licence and profile.kv_capacity_given
        assert 55_000 < profile.kv_capacity(1) < 70_000  # one A100 holds ~63k tokens of OPT-13B's KV


def test_distserve_reproduction_runs_vllm_prefill_first_and_distserve_on_its_placement():
    from pdserve.sim.published import load_distserve_reference, simulate_system, trace_requests

    run = load_distserve_reference()[0]
    requests = trace_requests(run)[:40]
    vllm = simulate_system("vllm", requests)
    assert vllm.num_gpus == 1 and vllm.config["sim"]["scheduling"] == "prefill-first"
    assert not any(s.num_prefill_tokens and s.num_decode_tokens for s in vllm.steps)  # decodes wait
    assert all(r.ok for r in vllm.records)
    distserve = simulate_system("distserve", requests)
    assert distserve.num_gpus == 3 and distserve.config["prefill_gpus"] == 2  # prefill TP 2, decode TP 1
    assert distserve.config["prefill_cost_model"].endswith("tp2") and distserve.kv_bytes_moved > 0
    # DistServe's own engine prefills faster than vLLM's (its fit): the same prompts reach their first token sooner
    assert statistics.median(r.ttft for r in distserve.records) < statistics.median(r.ttft for r in vllm.records)
