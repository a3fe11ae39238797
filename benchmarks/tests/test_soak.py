"""The soak's short version: one mixed phase and one overload phase on a local deployment of the ``tiny``
preset, through ``benchmarks/soak.py``'s own ``main``; zero unexpected errors and zero leaked blocks."""

from __future__ import annotations

import json

import pytest
from soak import main

from pdserve.messages import Mode

pytestmark = pytest.mark.cluster


def test_a_short_soak_has_no_unexpected_error_and_leaks_no_block(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--duration-s", "12", "--phase-s", "6", "--streams", "32", "--seed", "1"]
    args += ["--decode-workers", "1", "--prefill-workers", "1", "--transport", "grpc", "--kv-blocks", "1024"]
    rc = main([*args, "--drain-timeout-s", "30", "--json", str(out)])
    report = json.loads(out.read_text())
    total = report["total"]
    assert total["failed"] == 0, total["errors"]
    assert total["blocks_leaked"] == 0 and all(p["blocks_leaked"] == 0 for p in report["phases"])
    assert rc == 0
    mixed, overload = report["phases"]
    assert (mixed["kind"], overload["kind"]) == ("mixed", "overload")
    assert mixed["rejected"] == 0 and overload["rejected"] > 0  # refused only when deliberately overloaded
    assert total["completed"] > 0 and total["walked_away"] > 0 and total["deadline"] > 0 and total["aborted"] > 0
    assert set(total["asked_modes"]) == set(Mode)
    assert {"auto->colocated", "auto->disaggregated"} <= set(total["served_modes"])
    assert total["ttft_p99_ms"] > 0 and total["itl_p99_ms"] > 0
