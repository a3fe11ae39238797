"""pdserve.sim.cost_profile: step costs from a file of per-phase polynomials, validated; the CLI's --cost-profile."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.sim import main
from pdserve.sim.cost_model import StepShape
from pdserve.sim.cost_profile import PolynomialCostModel, load_cost_profile, parse_cost_profile
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.workload.generator import WorkloadRequest

PROFILE = {
    "name": "test-poly",
    "prefill_ms": {"const": 5.0, "tokens": 0.1, "tokens_sq": 1e-5},
    "decode_ms": {"const": 8.0, "context_tokens": 0.001, "batch_size": 0.5},
    "kv_bytes_per_token": 1000,
    "kv_link_gb_per_s": 2.0,
}


def _write(tmp_path, doc, name="profile.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_step_times_follow_the_files_polynomials(tmp_path):
    model = PolynomialCostModel(load_cost_profile(_write(tmp_path, PROFILE)))
    # a 1000-token prefill alone: 5 + 0.1*1000 + 1e-5*1000^2 = 115 ms
    prefill = StepShape.from_chunks([(0, 1000, True)])
    assert model.step_time(prefill) == pytest.approx(0.115)
    # 4 decodes at contexts 100, 200, 300, 400 (a token at position 99 attends 100 keys): 8 + 0.001*1000 + 0.5*4
    decodes = StepShape.from_chunks([(99, 1, True), (199, 1, True), (299, 1, True), (399, 1, True)])
    assert decodes.decode_context_tokens == 1000
    assert model.step_time(decodes) == pytest.approx((8 + 1.0 + 2) / 1000)
    # both in one step: the sum minus one fixed cost (the smaller, 5 ms: the step pays 8)
    mixed = StepShape.from_chunks([(0, 1000, True), (99, 1, True), (199, 1, True), (299, 1, True), (399, 1, True)])
    assert model.step_time(mixed) == pytest.approx((115 + 11.0 - 5) / 1000)
    assert model.kv_bytes_per_token == 1000 and model.model.kv_bytes_per_token == 1000
    assert model.kv_capacity_tokens() == 1 << 20


def test_the_model_size_and_the_link_come_from_the_file(tmp_path):
    profile = load_cost_profile(_write(tmp_path, {**PROFILE, "kv_capacity_tokens": 4096}))
    model = PolynomialCostModel(profile)
    reqs = [WorkloadRequest(f"r{i}", list(range(300)), 4, 0.01 * i) for i in range(3)]
    config = SimConfig(chunk_size=256, **profile.sim_settings())
    res = simulate(reqs, model, config, mode="disaggregated")
    assert res.kv_bytes_moved == 3 * 300 * 1000  # every prompt token's KV at the file's bytes per token
    assert res.config["num_kv_blocks"] == 4096 // config.block_size
    assert all(r.ok and r.output_tokens == 4 for r in res.records)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "must hold a JSON object"),
        ({k: v for k, v in PROFILE.items() if k != "decode_ms"}, "missing key(s) decode_ms"),
        ({**PROFILE, "prefil_ms": {}}, "unknown key(s) prefil_ms"),
        ({**PROFILE, "name": ""}, "name must be a non-empty string"),
        ({**PROFILE, "prefill_ms": {"const": 1, "tokens": 1}}, "prefill_ms: missing tokens_sq"),
        ({**PROFILE, "decode_ms": {**PROFILE["decode_ms"], "ctx": 1}}, "decode_ms: unknown ctx"),
        ({**PROFILE, "prefill_ms": {"const": -1, "tokens": 1, "tokens_sq": 0}}, "prefill_ms.const must be a finite"),
        ({**PROFILE, "decode_ms": {"const": "8", "context_tokens": 0, "batch_size": 0}}, "must be a number"),
        ({**PROFILE, "decode_ms": {"const": 0, "context_tokens": 0, "batch_size": 0}}, "every coefficient is 0"),
        ({**PROFILE, "kv_bytes_per_token": 1.5}, "kv_bytes_per_token must be a positive integer"),
        ({**PROFILE, "kv_bytes_per_token": True}, "kv_bytes_per_token must be a positive integer"),
        ({**PROFILE, "kv_link_gb_per_s": 0}, "kv_link_gb_per_s must be a finite number > 0"),
        ({**PROFILE, "kv_capacity_tokens": 0}, "kv_capacity_tokens must be a positive integer"),
    ],
)
def test_a_malformed_profile_is_refused_with_the_key_named(doc, message):
    with pytest.raises(ValueError) as err:
        parse_cost_profile(doc)
    assert message in str(err.value)


def test_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no file at"):
        load_cost_profile(str(tmp_path / "missing.json"))
    path = _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match=f"{path} is not JSON"):
        load_cost_profile(path)


def test_cli_runs_on_a_cost_profile_and_rejects_a_bad_one(tmp_path, capsys):
    path = _write(tmp_path, PROFILE)
    argv = ["--cost-profile", path, "--num-requests", "12", "--rate", "20", "--prompt-len-mean", "200"]
    argv += ["--output-len-mean", "8", "--out", str(tmp_path / "out"), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost_model"] == "test-poly" and doc["model"] == "test-poly"
    assert [r["name"] for r in doc["runs"]] == ["colocated x2", "disaggregated 1P:1D"]
    assert all(r["completed"] == 12 for r in doc["runs"])
    bad = _write(tmp_path, {**PROFILE, "decode_ms": {"const": 1}}, "bad.json")
    assert main(["--cost-profile", bad, "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "decode_ms: missing context_tokens, batch_size" in capsys.readouterr().err
    assert main(["--cost-profile", path, "--model-profile", "tiny", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert "drop --model-profile" in capsys.readouterr().err
