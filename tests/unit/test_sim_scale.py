"""The simulator at scale: coalesced decode runs change nothing but the speed; the speed is reported;
``pdserve sim --replay`` replays a recorded run from its results file."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import pdserve.engine.scheduler as engine_scheduler
from pdserve.cli.sim import main
from pdserve.sim.cost_model import LinearCostModel, RooflineCostModel
from pdserve.sim.cost_profile import CostProfile, PhaseFit, PolynomialCostModel
from pdserve.sim.profiles import LinearProfile, RoleFit, get_hardware, get_model
from pdserve.sim.simulator import SimConfig, Simulator, simulate
from pdserve.workload.generator import WorkloadRequest, interference_workload, random_workload, shared_prefix_workload

H100_8B = RooflineCostModel(get_hardware("H100"), get_model("Llama-3-8B"))
A100_70B_TP4 = RooflineCostModel(get_hardware("A100"), get_model("Llama-3-70B"), tp=4)


def _both_ways(monkeypatch, requests, cost_model, config, **kwargs):
    """The run step by step and coalesced, and how many times each called the engine's schedule()."""
    calls = {"n": 0}
    real = engine_scheduler.Scheduler.schedule

    def counting(self):
        calls["n"] += 1
        return real(self)

    monkeypatch.setattr(engine_scheduler.Scheduler, "schedule", counting)
    max_concurrency = kwargs.pop("max_concurrency", None)
    mode = kwargs.pop("mode", "colocated")
    results, schedules, block_states = [], [], []
    for coalesce in (False, True):
        calls["n"] = 0
        cfg = dataclasses.replace(config, coalesce_decode_steps=coalesce)
        if cfg.kv_link_bw is None:
            cfg = dataclasses.replace(cfg, kv_link_bw=25e9, kv_link_latency_s=20e-6)
        sim = Simulator(cost_model, cfg, mode, **kwargs)
        results.append(sim.run(requests, max_concurrency))
        schedules.append(calls["n"])
        block_states.append({name: _block_state(inst.scheduler.block_manager) for name, inst in sim.instances.items()})
    assert block_states[0] == block_states[1]  # the engine's KV blocks end in the same state, cache and LRU order
    return results, schedules


def _block_state(blocks) -> tuple:
    return (list(blocks.free_blocks), list(blocks.cached_free), dict(blocks.hash_to_block), list(blocks.ref_counts))


def _polynomial() -> PolynomialCostModel:
    return PolynomialCostModel(
        CostProfile(
            name="poly",
            fits={(1, "all"): PhaseFit((10.0, 0.05, 1e-6), (12.0, 2.5e-4, 0.07), (9.0, 2.7e-4, 0.09), 24)},
            kv_bytes_per_token=131072,
            kv_link_gb_per_s=25.0,
            kv_capacity_tokens=200_000,
            max_context=32768,
        )
    )


CASES = {
    "colocated x2": (random_workload(120, rate=30.0, output_len_mean=150, seed=1), SimConfig(chunk_size=256), {}),
    "disaggregated 1P:2D, latencies": (
        random_workload(120, rate=30.0, output_len_mean=150, seed=2),
        SimConfig(chunk_size=256, token_latency_s=0.4e-3, control_latency_s=0.3e-3),
        {"mode": "disaggregated", "num_prefill": 1, "num_decode": 2},
    ),
    "auto 1P:2D": (
        random_workload(120, rate=30.0, prompt_len_mean=700, output_len_mean=120, seed=3),
        SimConfig(chunk_size=256),
        {"mode": "auto", "num_prefill": 1, "num_decode": 2},
    ),
    "preemption (a small KV pool)": (
        random_workload(80, rate=20.0, output_len_mean=300, seed=4),
        SimConfig(chunk_size=512, num_kv_blocks=300),
        {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1},
    ),
    "shared prefixes, prefix caching": (
        shared_prefix_workload(60, num_prefixes=2, prefix_len=300, suffix_len=20, output_len=80, rate=30.0, seed=5),
        SimConfig(chunk_size=128, num_kv_blocks=260),
        {"num_instances": 2},
    ),
    "identical prompts (decode blocks hash alike)": (
        [WorkloadRequest(f"same-{i}", [7] * 200, 90, 0.002 * i) for i in range(12)],
        SimConfig(chunk_size=256),
        {},
    ),
    "chunking off, concurrency cap": (
        random_workload(60, output_len_mean=100, seed=6),
        SimConfig(enable_chunked_prefill=False),
        {"num_instances": 2, "max_concurrency": 8},
    ),
    "interference": (
        interference_workload(
            num_streams=6,
            stream_prompt_len=64,
            stream_output_len=200,
            num_long=3,
            long_prompt_len=1500,
            long_output_len=4,
            long_period_s=0.15,
            long_start_s=0.05,
        ),
        SimConfig(chunk_size=256),
        {},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_coalesced_decode_runs_reproduce_the_step_by_step_run_exactly(monkeypatch, case):
    requests, config, kwargs = CASES[case]
    (plain, coalesced), (plain_calls, coalesced_calls) = _both_ways(
        monkeypatch, requests, H100_8B, config, **dict(kwargs)
    )
    assert coalesced.records == plain.records  # every token's time, bit for bit
    assert coalesced.steps == plain.steps and coalesced.step_chunks == plain.step_chunks
    assert coalesced.num_steps == plain.num_steps == len(plain.steps) == plain_calls
    if case.startswith("preemption"):
        assert sum(s.num_preempted for s in plain.steps) > 0
        assert coalesced_calls < plain_calls  # runs end where the next step would need blocks
    else:
        assert coalesced_calls < plain_calls / 2  # most decode steps were never scheduled one by one


def _linear() -> LinearCostModel:
    # the calibrated kind: it prices the decodes' padded keys (read through the generic path)
    fit = RoleFit((2e-3, 4e-5, 1e-4, 1e-8, 3e-7, 2e-8))
    return LinearCostModel(LinearProfile(model="tiny", roles={"all": fit}), get_model("tiny"))


@pytest.mark.parametrize(
    ("name", "cost_model"),
    [("A100 x4, 70B", A100_70B_TP4), ("a polynomial", _polynomial()), ("a linear fit", _linear())],
)
def test_coalesced_runs_price_steps_as_the_cost_model_does(monkeypatch, name, cost_model):
    requests = random_workload(80, rate=20.0, output_len_mean=120, seed=7)
    config = SimConfig(chunk_size=512, kv_link_bw=25e9, kv_link_latency_s=20e-6)
    kwargs = {"mode": "disaggregated", "num_prefill": 1, "num_decode": 2}
    (plain, coalesced), (plain_calls, coalesced_calls) = _both_ways(monkeypatch, requests, cost_model, config, **kwargs)
    assert coalesced.records == plain.records and coalesced.steps == plain.steps
    assert coalesced_calls < plain_calls / 2


def test_without_step_records_only_the_count_is_kept():
    requests = random_workload(40, rate=20.0, output_len_mean=60, seed=8)
    kept = simulate(requests, H100_8B, SimConfig(chunk_size=256))
    counted = simulate(requests, H100_8B, SimConfig(chunk_size=256, keep_steps=False))
    assert counted.records == kept.records
    assert counted.steps == () and counted.step_chunks == () and counted.num_steps == len(kept.steps) > 100
    assert kept.wall_s > 0 and kept.steps_per_s == kept.num_steps / kept.wall_s


def test_sim_prints_its_speed_and_puts_it_in_json(tmp_path, capsys):
    argv = ["--num-requests", "30", "--rate", "20", "--prefill-workers", "1", "--decode-workers", "1"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "simulator speed:" in out and "simulated steps per second" in out
    assert main([*argv, "--out", str(tmp_path / "b"), "--json", "--no-report"]) == 0
    doc = json.loads(capsys.readouterr().out)
    speed = doc["speed"]
    assert speed["runs"] == 2 and speed["steps"] == sum(r["num_steps"] for r in doc["runs"]) > 0
    assert speed["steps_per_s"] == pytest.approx(speed["steps"] / speed["wall_s"])
    assert not os.path.exists(tmp_path / "b")  # --no-report writes nothing


def test_replay_of_a_recorded_simulated_run_from_the_command_line_reproduces_it(tmp_path, capsys):
    out = tmp_path / "run"
    record = ["--num-requests", "40", "--rate", "25", "--prefill-workers", "1", "--decode-workers", "2"]
    assert main([*record, "--mode", "both", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--replay", str(out / "results.json"), "--json", "--no-report"]) == 0
    doc = json.loads(capsys.readouterr().out)
    recorded = {r["name"]: r for r in json.load(open(out / "results.json", encoding="utf-8"))["runs"]}
    assert [r["name"] for r in doc["replay"]] == ["colocated x3", "disaggregated 1P:2D"]
    for rep in doc["replay"]:
        assert rep["step_agreement"] == 1.0 and rep["num_steps"] == len(recorded[rep["name"]]["steps"]) > 100
        assert rep["unreplayed_steps"] == 0 and rep["passed"]
        for figure, ms in rep["recorded_ms"].items():
            assert rep["replayed_ms"][figure] == pytest.approx(ms, abs=1e-6)
    assert main(["--replay", str(out)]) == 0  # the directory will do, and the table is printed
    text = capsys.readouterr().out
    assert "replay of disaggregated 1P:2D:" in text and "step agreement 100.0%" in text and "TTFT p50" in text


def test_replay_refuses_what_it_cannot_replay(tmp_path, capsys):
    assert main(["--replay", str(tmp_path / "nothing.json"), "--no-report"]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["--replay", str(bad), "--no-report"]) == 2
    assert "not a results.json" in capsys.readouterr().err
    counted = tmp_path / "counted"
    assert main(["--num-requests", "10", "--mode", "colocated", "--no-steps", "--out", str(counted)]) == 0
    capsys.readouterr()
    assert main(["--replay", str(counted), "--no-report"]) == 2
    assert "kept no steps" in capsys.readouterr().err
    other = tmp_path / "other"
    assert main(["--num-requests", "10", "--mode", "colocated", "--out", str(other)]) == 0
    capsys.readouterr()
    assert main(["--replay", str(other), "--hardware", "A100", "--no-report"]) == 2
    assert "was simulated on H100" in capsys.readouterr().err


def test_replay_reads_a_measured_runs_file_as_pdserve_bench_writes_it(tmp_path, capsys):
    # a measured run's results.json: pdserve bench's arguments as its config, the deployment in each run's
    # meta, wall-clock send times; here its records and steps are a simulated run's, so the replay
    # (under the command line's settings) must agree step for step
    from pdserve.bench.runner import _config
    from pdserve.bench.runner import build_parser as bench_parser
    from pdserve.workload.generator import WorkloadSpec, build_workload
    from pdserve.workload.report import RunData, write_report

    bench_args = bench_parser().parse_args(["--num-requests", "30", "--rate", "20", "--max-output", "40"])
    spec = WorkloadSpec(num_requests=30, rate=20.0)
    requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 40)) for r in build_workload(spec).requests]
    from pdserve.sim.api import SimSettings, Simulation

    config = dataclasses.replace(Simulation(SimSettings()).config, max_num_batched_tokens=512)  # as the replay's
    run = simulate(requests, H100_8B, config, mode="disaggregated", num_prefill=1, num_decode=2)
    epoch = 1000.0  # the records clock: the run began 1000 s into it
    records = [
        dataclasses.replace(r, send_time=r.send_time + epoch, token_times=[t + epoch for t in r.token_times])
        for r in run.records
    ]
    steps = [s._replace(started=s.started + epoch) for s in run.steps]
    meta = {"architecture": "disaggregated", "prefill_workers": 1, "decode_workers": 2}
    write_report(
        str(tmp_path), [RunData("disaggregated", records, steps, meta=meta)], config=_config(bench_args, "random")
    )
    argv = ["--replay", str(tmp_path), "--json", "--no-report", "--max-num-batched-tokens", "512"]
    assert main(argv) == 0
    (report,) = json.loads(capsys.readouterr().out)["replay"]
    assert report["name"] == "disaggregated" and report["num_steps"] == len(steps)
    assert report["step_agreement"] == 1.0 and report["passed"]
    assert report["replayed_ms"]["ITL p50"] == pytest.approx(report["recorded_ms"]["ITL p50"], rel=1e-6)
