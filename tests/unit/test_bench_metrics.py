"""bench.metrics against hand-worked examples (vLLM ``bench serve`` definitions) and bench.report."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pdserve.messages import StepStats
from pdserve.workload.metrics import (
    LatencyStats,
    RequestRecord,
    SweepPoint,
    benchmark_duration,
    compute_metrics,
    find_knee,
    interference_itls,
    itls_during_prefill,
    meets_slo,
    parse_slo,
    prefill_throughput,
    sweep_point,
)
from pdserve.workload.report import RunData, load_results, markdown_table, write_report
from pdserve.workload.spread import Spread, differences, summarize


def step(started: float, duration: float, prefill: int, decode: int, worker: str = "") -> StepStats:
    return StepStats(started, duration, num_prefill_tokens=prefill, num_decode_tokens=decode, worker=worker)


def hand_records() -> list[RequestRecord]:
    # A: sent 0.0, tokens at 0.1, 0.3, 0.4 -> TTFT 100 ms, E2E 400 ms, TPOT (400-100)/2 = 150 ms, ITL 200, 100
    # B: sent 1.0, tokens at 1.2, 1.25     -> TTFT 200 ms, E2E 250 ms, TPOT 50 ms, ITL 50
    # C: sent 0.5, one token at 0.55       -> TTFT 50 ms, E2E 50 ms, no TPOT (counts as 0 for goodput), no ITL
    # D: sent 0.2, failed at 0.6           -> only counts as failed; its end time is inside the duration
    return [
        RequestRecord("A", 0.0, (0.1, 0.3, 0.4), num_prompt_tokens=10),
        RequestRecord("B", 1.0, (1.2, 1.25), num_prompt_tokens=20),
        RequestRecord("C", 0.5, (0.55,), num_prompt_tokens=5),
        RequestRecord("D", 0.2, (), num_prompt_tokens=7, ok=False, error="boom", end_time=0.6),
    ]


def test_hand_worked_latencies():
    m = compute_metrics(hand_records())
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 6)  # failed D is not counted
    # TTFT sample [100, 200, 50] ms: mean 116.67; population std sqrt((16.67² + 83.33² + 66.67²)/3) = 62.36;
    # sorted [50, 100, 200]: p50 = 100; p90 at index 1.8 -> 100 + 0.8*100 = 180; p99 at 1.98 -> 198
    assert m.ttft.count == 3
    assert m.ttft.mean_ms == pytest.approx(116.6667, abs=1e-3)
    assert m.ttft.std_ms == pytest.approx(62.3610, abs=1e-3)
    assert m.ttft.p50_ms == pytest.approx(100.0)
    assert m.ttft.p90_ms == pytest.approx(180.0)
    assert m.ttft.p99_ms == pytest.approx(198.0)
    assert m.ttft.max_ms == pytest.approx(200.0)
    # TPOT only over requests with > 1 token: [150, 50] -> mean 100, p90 = 50 + 0.9*100 = 140
    assert m.tpot.count == 2
    assert m.tpot.mean_ms == pytest.approx(100.0)
    assert m.tpot.p90_ms == pytest.approx(140.0)
    # ITL pooled over requests: [200, 100, 50]
    assert m.itl.count == 3
    assert m.itl.mean_ms == pytest.approx(116.6667, abs=1e-3)
    assert m.itl.p50_ms == pytest.approx(100.0)
    assert m.itl.max_ms == pytest.approx(200.0)
    # E2E [400, 250, 50]: mean 233.33; p99 at index 1.98 -> 250 + 0.98*150 = 397
    assert m.e2el.mean_ms == pytest.approx(233.3333, abs=1e-3)
    assert m.e2el.p99_ms == pytest.approx(397.0)


def test_hand_worked_throughput_and_goodput():
    recs = hand_records()
    # duration: first send 0.0 to the last time covered, B's last token at 1.25 -> 1.25 s
    assert benchmark_duration(recs) == pytest.approx(1.25)
    m = compute_metrics(recs, "ttft=150,tpot=100")
    assert m.duration_s == pytest.approx(1.25)
    assert m.request_throughput == pytest.approx(3 / 1.25)  # 2.4 req/s
    assert m.output_throughput == pytest.approx(6 / 1.25)  # 4.8 tok/s
    assert m.total_token_throughput == pytest.approx(41 / 1.25)  # 32.8 tok/s
    # A: TPOT 150 > 100 fails; B: TTFT 200 > 150 fails; C: TTFT 50 ok, TPOT counts as 0 -> 1 good request
    assert m.good_completed == 1
    assert m.request_goodput == pytest.approx(1 / 1.25)
    assert m.slo_attainment == pytest.approx(1 / 4)  # the failed request counts as missing the SLO
    # per SLO alone: TTFT met by A (100) and C (50), not B (200); TPOT met by B (50) and C (0), not A (150)
    assert m.ttft_attainment == pytest.approx(2 / 4) and m.tpot_attainment == pytest.approx(2 / 4)
    assert m.to_dict()["ttft_attainment"] == pytest.approx(0.5) and m.attainment_of("e2el") is None
    # the bound is inclusive (metric <= slo): with ttft=200 all three succeed
    m2 = compute_metrics(recs, {"ttft": 200.0})
    assert m2.good_completed == 3
    assert compute_metrics(recs).request_goodput is None  # no SLO, no goodput


def test_duration_override_and_e2el_slo():
    recs = hand_records()
    m = compute_metrics(recs, "e2el=300", duration_s=2.0)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.good_completed == 2  # B (250) and C (50); A's 400 ms misses
    assert meets_slo(recs[1], {"e2el": 250.0}) and not meets_slo(recs[3], {"ttft": 1e9})


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(3)
    recs = []
    for i in range(40):
        send = float(i)
        times = np.cumsum(rng.exponential(0.02, size=int(rng.integers(2, 30)))) + send + 0.1
        recs.append(RequestRecord(str(i), send, tuple(times), 1))
    m = compute_metrics(recs)
    ttft = [r.token_times[0] - r.send_time for r in recs]
    itl = np.concatenate([np.diff(r.token_times) for r in recs])
    assert m.ttft.p90_ms == pytest.approx(np.percentile(ttft, 90) * 1000)
    assert m.itl.p99_ms == pytest.approx(np.percentile(itl, 99) * 1000)
    assert m.itl.std_ms == pytest.approx(np.std(itl) * 1000)
    assert m.itl.count == len(itl)


def test_bundled_tokens_use_explicit_count():
    # two messages at 0.1 and 0.4 carrying 4 tokens: TPOT = (0.4 - 0.1) / (4 - 1) = 100 ms;
    # one ITL gap of 300 ms
    r = RequestRecord("x", 0.0, (0.1, 0.4), 3, num_output_tokens=4)
    m = compute_metrics([r])
    assert m.tpot.mean_ms == pytest.approx(100.0)
    assert m.itl.count == 1 and m.itl.mean_ms == pytest.approx(300.0)
    assert m.total_output_tokens == 4


def test_ok_without_tokens_counts_as_failed_and_empty_is_zero():
    m = compute_metrics([RequestRecord("x", 0.0, (), 3)])
    assert (m.completed, m.failed) == (0, 1)
    assert m.ttft == LatencyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_record_json_round_trip_and_validation():
    r = RequestRecord("a", 1.5, [1.6, 1.7], 12, label="stream", meta={"instance": "colo-0", "kv_bytes": 10})
    back = RequestRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and isinstance(back.token_times, tuple)
    with pytest.raises(ValueError):
        RequestRecord("b", 0.0, (0.3, 0.2), 1)


@pytest.mark.parametrize("bad", ["ttft", "foo=1", "ttft=abc", "tpot=-5", "ttft=inf"])
def test_parse_slo_rejects(bad):
    with pytest.raises(ValueError):
        parse_slo(bad)


def test_parse_slo():
    assert parse_slo("ttft=200, tpot=50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("") == {} and parse_slo(None) == {}


def test_steps_prefill_throughput_and_knee():
    # steps with prefill: 1000 tokens in 0.1 s and 500 in 0.05 s -> 1500 / 0.15 = 10000 tok/s;
    # the decode-only step does not count
    steps = [step(0.0, 0.1, 1000, 4), step(0.1, 0.02, 0, 4), step(0.12, 0.05, 500, 4)]
    assert prefill_throughput(steps) == pytest.approx(10000.0)
    pts = [
        SweepPoint(256, 20, 25, 20, 5000, 0, 0),
        SweepPoint(1024, 45, 50, 40, 9000, 0, 0),
        SweepPoint(4096, 120, 130, 60, 9900, 0, 0),
    ]
    assert find_knee(pts, 50.0).chunk_size == 1024
    assert find_knee(pts, 10.0) is None


def test_interference_itls_window():
    # the long prompt is in prefill from 1.0 to 1.5:
    # stream gaps ending in (1.0, 1.5] are 0.9->1.2 and 1.2->1.5
    recs = [
        RequestRecord("s", 0.0, (0.5, 0.9, 1.2, 1.5, 1.6), 1, label="stream"),
        RequestRecord("l", 1.0, (1.5,), 100, label="long"),
    ]
    assert interference_itls(recs) == pytest.approx([0.3, 0.3])
    pt = sweep_point(512, recs, [step(1.0, 0.5, 100, 1)])
    assert pt.p99_itl_ms == pytest.approx(300.0)
    assert interference_itls([recs[0]]) is None


def test_itls_during_prefill_counts_gaps_whose_later_token_lands_in_a_window():
    streams = [(0.0, 1.0, 2.0, 3.0), (0.5, 2.5, 2.6)]
    # windows (0.9, 2.0] and (2.55, 3.0]: 0.0->1.0, 1.0->2.0, 2.0->3.0 of the first; 2.5->2.6 of the second
    gaps = itls_during_prefill(streams, [(0.9, 2.0), (2.55, 3.0)])
    assert sorted(gaps) == pytest.approx([0.1, 1.0, 1.0, 1.0])
    assert itls_during_prefill(streams, [(3.0, 4.0)]) == []  # a token at the window's start is not in it
    assert max(itls_during_prefill(streams, [(0.4, 2.5)])) == pytest.approx(2.0)  # 0.5->2.5 is the worst


def test_write_report_and_load_back(tmp_path):
    recs = hand_records()
    steps = [step(0.0, 0.1, 1000, 2, "w0"), step(0.1, 0.02, 0, 2, "w0")]
    out = str(tmp_path / "r")
    files = write_report(
        out,
        [
            RunData("colocated", recs, steps),
            RunData("disagg", recs[:2], kv_bytes_moved=123, series="disaggregated"),
        ],
        config={"mode": "ab"},
        slo_ms={"ttft": 150},
        itl_target_ms=50.0,
        sweep=[SweepPoint(256, 20, 25, 20, 5000, 0, 0)],
    )
    for p in files.all_paths():
        assert os.path.getsize(p) > 0, p
    assert {"itl_cdf", "ttft_cdf", "throughput_latency", "chunk_sweep"} <= set(files.plots)
    assert any(k.startswith("timeline_") for k in files.plots)
    md = open(files.report_md).read()
    assert "| colocated | 3/1 |" in md and "123 B" in md
    doc, runs = load_results(files.results_json)
    assert doc["runs"][0]["metrics"]["good_completed"] == 2  # A (100 ms) and C (50 ms) meet ttft <= 150
    assert [r.request_id for r in runs[0].records] == ["A", "B", "C", "D"]
    assert runs[0].records[0].token_times == recs[0].token_times
    assert runs[1].series == "disaggregated" and runs[1].kv_bytes_moved == 123
    assert runs[0].steps == steps  # the one step shape, back from JSON
    assert markdown_table([("x", compute_metrics(recs), None)]).count("\n") == 2


def _stream(rid: str, send: float, gaps: list[float]) -> RequestRecord:
    times, t = [], send + 0.1
    for g in [0.0, *gaps]:
        t += g
        times.append(t)
    return RequestRecord(rid, send, tuple(times), 10)


def test_repeats_median_spread_and_differences_beyond_it(tmp_path):
    # A's ITLs are 20, 22, 24 ms in its three repeats; B's 30, 50, 40 ms; their TTFTs (100 ms) are equal
    a = [RunData(f"A #{i}", [_stream("x", 0.0, [g] * 4)], group="A") for i, g in enumerate((0.020, 0.022, 0.024))]
    b = [RunData(f"B #{i}", [_stream("x", 0.0, [g] * 4)], group="B") for i, g in enumerate((0.030, 0.050, 0.040))]
    summary = summarize({"A": [r.metrics() for r in a], "B": [r.metrics() for r in b]})
    assert summary["A"]["ITL p50"] == pytest.approx(Spread(22.0, 20.0, 24.0, 3))
    assert summary["B"]["ITL p50"] == pytest.approx(Spread(40.0, 30.0, 50.0, 3))
    found = differences(summary)
    itl = [d for d in found if d.figure == "ITL p50"]
    assert len(itl) == 1 and (itl[0].better, itl[0].worse) == ("A", "B")
    assert not [d for d in found if d.figure.startswith("TTFT")]  # equal: nothing called out
    # overlapping spreads are not a difference, whichever median is lower
    c = [compute_metrics([_stream("x", 0.0, [g] * 4)]) for g in (0.019, 0.023, 0.030)]
    close = summarize({"A": [r.metrics() for r in a], "C": c})
    assert not [d for d in differences(close) if d.figure == "ITL p50"]
    files = write_report(str(tmp_path / "rep"), a + b)
    md = open(files.report_md).read()
    assert "## Median and spread over repeats" in md and "| A | 3 |" in md and "22.0 (20.0–24.0)" in md
    assert "ITL p50: A 22.0 (20.0–24.0) beats B 40.0 (30.0–50.0) ms" in md
    doc = json.load(open(files.results_json))
    assert doc["repeats"]["B"]["ITL p50"]["median"] == pytest.approx(40.0)
    assert any(d.startswith("ITL p50: A") for d in doc["differences"])
    single = write_report(str(tmp_path / "one"), [a[0], b[0]])
    assert "Median and spread" not in open(single.report_md).read()


def test_bench_repeats_run_each_architecture_on_fresh_deployments(monkeypatch, tmp_path, capsys):
    import pdserve.bench.runner as runner
    from pdserve.bench.runner import MeasuredRun

    calls = []

    def fake_run(arch, args, requests, engine):  # one call = one fresh deployment
        calls.append(arch)
        gap = {"colocated": 0.05, "disaggregated": 0.02}[arch] * (1 + 0.01 * len(calls))
        return MeasuredRun([_stream(r.request_id, 0.0, [gap] * 3) for r in requests], [], 0, 1.0), {}

    monkeypatch.setattr(runner, "run_architecture", fake_run)
    monkeypatch.setattr(runner, "target_problem", lambda target: None)  # nothing listens on x:1
    argv = ["--architectures", "colocated,disaggregated", "--repeats", "3", "--num-requests", "2"]
    assert runner.main([*argv, "--target", "x:1", "--no-progress", "--out", str(tmp_path)]) == 0
    assert calls == ["colocated", "disaggregated"] * 3  # interleaved, one deployment per run
    doc = json.load(open(tmp_path / "results.json"))
    assert [r["name"] for r in doc["runs"]][:2] == ["colocated #1", "disaggregated #1"]
    assert {r["group"] for r in doc["runs"]} == {"colocated", "disaggregated"}
    out = capsys.readouterr().out
    assert "median (min–max) over the repeats" in out and "ITL p50: disaggregated" in out
    assert runner.main(["--repeats", "0"]) == 2


def test_bench_baseline_is_colocated_under_prefill_first_with_whole_prompts():
    from pdserve.bench.runner import ARCHITECTURES, build_parser, deployment_config, engine_config
    from pdserve.engine import EngineConfig

    assert "baseline" in ARCHITECTURES
    args = build_parser().parse_args(["--prefill-workers", "1", "--decode-workers", "2", "--max-chunk-tokens", "64"])
    engine = engine_config(args)
    base = deployment_config("baseline", args, engine)
    assert (base.mode, base.num_prefill_workers, base.num_decode_workers) == ("colocated", 0, 3)
    assert (base.engine.scheduling, base.engine.enable_chunked_prefill, base.engine.max_chunk_tokens) == (
        "prefill-first",
        False,
        None,
    )
    colocated = deployment_config("colocated", args, engine)
    assert (colocated.engine.scheduling, colocated.engine.enable_chunked_prefill) == ("mixed", True)
    assert colocated.engine.max_chunk_tokens == 64
    assert isinstance(colocated.engine, EngineConfig)


def test_bench_baseline_refuses_a_target(capsys):
    import pdserve.bench.runner as runner

    assert runner.main(["--architectures", "baseline", "--target", "x:1", "--num-requests", "2"]) == 2
    assert "not with --target" in capsys.readouterr().err
