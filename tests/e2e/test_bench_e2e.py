"""A short `pdserve bench` run against real deployments on the tiny preset writes every output file."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.runner import main

pytestmark = pytest.mark.cluster


def test_pdserve_bench_writes_results_report_and_plots(tmp_path):
    out = tmp_path / "ab"
    rc = main(
        [
            "--architectures",
            "colocated,disaggregated",
            "--prefill-workers",
            "1",
            "--verify-kv",
            "--decode-workers",
            "1",
            "--num-requests",
            "6",
            "--rate",
            "20",
            "--prompt-len-mean",
            "80",
            "--prompt-len-max",
            "200",
            "--output-len-mean",
            "6",
            "--output-len-max",
            "10",
            "--warmup",
            "1",
            "--transport",
            "grpc",
            "--slo",
            "ttft=5000,tpot=1000",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    for name in ("results.json", "report.md", "itl_cdf.png", "ttft_cdf.png", "throughput_latency.png"):
        assert (out / name).stat().st_size > 0, name
    assert list(out.glob("timeline_*.png")), "no per-step timeline plot"
    results = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert set(runs) == {"colocated", "disaggregated"}
    for name, run in runs.items():
        assert len(run["requests"]) == 6
        for req in run["requests"]:
            assert req["ok"], req["error"]
            assert len(req["token_times"]) == req["num_output_tokens"] >= 1  # a timestamp for every token
            assert req["meta"]["mode"] == name
        assert run["steps"], "no server-side step timings"
        assert run["metrics"]["completed"] == 6
    assert runs["disaggregated"]["kv_bytes_moved"] > 0 and runs["colocated"]["kv_bytes_moved"] == 0
    report = (out / "report.md").read_text()
    assert "colocated" in report and "disaggregated" in report


def test_pdserve_bench_rejects_bad_arguments(capsys):
    assert main(["--architectures", "sideways"]) == 2
    assert "--architectures" in capsys.readouterr().err
    assert main(["--slo", "ttft=fast"]) == 2
