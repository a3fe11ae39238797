"""benchmarks/pace_probe_check.py: how well the engine's pace probe follows a job's speed as the machine drifts."""

from __future__ import annotations

import math

import pytest


def test_the_probe_check_divides_the_machines_drift_out_of_a_job():
    from pace_probe_check import summarize

    # the machine slows 1.3x half way; the job follows it, and so does the probe
    jobs = [(2e-3 * f, 1.2 * f, 2e-3 * f) for f in [1.0] * 10 + [1.3] * 10]
    figures = summarize(jobs, window=5)
    assert figures["jobs"] == 20 and figures["windows"] == 4
    assert figures["job_spread"] == pytest.approx(1.3) and figures["job_per_probe_spread"] == pytest.approx(1.0)
    assert figures["correlation"] == pytest.approx(1.0)
    # a probe that does not move: the drift stays
    flat = summarize([(2e-3, j, 2e-3) for _, j, _ in jobs], window=5)
    assert flat["job_per_probe_spread"] == pytest.approx(1.3) and math.isnan(flat["correlation"])


def test_the_probe_check_runs_an_engine_and_prints_its_figures(capsys):
    import json

    from pace_probe_check import main

    assert main(["--seconds", "0.5", "--engines", "1", "--window", "1", "--json"]) == 0
    [figures] = json.loads(capsys.readouterr().out)
    assert figures["jobs"] >= 1 and figures["job_ms"] > 0 and figures["probe_ms"] > 0
