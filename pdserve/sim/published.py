"""The simulator on two published comparisons, with the papers' models, hardware, workloads and SLOs as
closely as their text allows (``docs/simulator.md`` sets the papers' figures next to these):

- **DistServe** (OSDI 2024), its Figure 1: a 13B model (OPT-13B) on A100-80GB GPUs, a synthetic
  workload of 512-token prompts and 64-token outputs, SLOs on P90 TTFT (0.4 s) and P90 TPOT (0.04 s):
  goodput per GPU (the highest rate at which 90 % of requests attain both) of one colocated GPU, of a
  prefill-only and a decode-only instance, and of 2 prefill + 1 decode;
- **Sarathi-Serve** (OSDI 2024): Mistral-7B on one A100, a workload shaped like openchat_sharegpt4
  (lognormal lengths with its median and P90), capacity = the highest rate with P99 time-between-tokens
  within the SLO and the median scheduling delay (here: TTFT) under 2 s, chunked prefill at a token
  budget of 512 against whole-prompt steps.

``python -m pdserve.sim.published [--quick]`` prints both tables.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from typing import Any

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import RooflineCostModel
from pdserve.sim.experiments import Architecture, max_rate_meeting_slo, search_goodput
from pdserve.sim.profiles import get_hardware, get_model
from pdserve.sim.simulator import simulate
from pdserve.workload.generator import WorkloadSpec, build_workload

DISTSERVE_SLO_MS = {"ttft": 400.0, "tpot": 40.0}
SARATHI_TBT_SLOS_S = {"strict": 0.1, "relaxed": 0.5}
SARATHI_MAX_MEDIAN_DELAY_S = 2.0


def lognormal_from_median_p90(median: float, p90: float) -> tuple[float, float]:
    """(arithmetic mean, log-space sigma) of the lognormal with this median and P90."""
    sigma = math.log(p90 / median) / 1.2815515655446004
    return median * math.exp(sigma * sigma / 2), sigma


def distserve_figure1(min_duration_s: float = 30.0, iterations: int = 6) -> list[dict[str, Any]]:
    """Goodput per GPU of the Figure 1 setups (OPT-13B on A100, 512 in / 64 out, P90 TTFT 0.4 s and TPOT 0.04 s)."""
    hw = get_hardware("A100")
    cost = RooflineCostModel(hw, get_model("OPT-13B"))
    spec = WorkloadSpec(
        num_requests=200,
        rate=2.0,
        prompt_len_mean=512,
        prompt_len_sigma=0.0,
        output_len_mean=64,
        output_len_sigma=0.0,
        seed=0,
    )
    config = SimConfig(kv_link_bw=hw.kv_link_bw, kv_link_latency_s=hw.kv_link_latency_s, enable_chunked_prefill=False)
    setups = [
        ("colocated, 1 GPU (whole-prompt steps)", Architecture("colocated x1", "colocated", 0, 0, 1, False), None, 1),
        ("colocated, 1 GPU (chunked, budget 512)", Architecture("colocated x1", "colocated", 0, 0, 1, True), None, 1),
        ("prefill-only, 1 GPU (TTFT SLO only)", Architecture("1P:4D", "disaggregated", 1, 4, 5, False), "ttft", 1),
        ("decode-only, 1 GPU (TPOT SLO only)", Architecture("4P:1D", "disaggregated", 4, 1, 5, False), "tpot", 1),
        ("2 prefill + 1 decode, 3 GPUs", Architecture("2P:1D", "disaggregated", 2, 1, 3, False), None, 3),
    ]
    rows = []
    for label, arch, only, gpus in setups:
        slo = {only: DISTSERVE_SLO_MS[only]} if only else DISTSERVE_SLO_MS
        cfg = replace(config, enable_chunked_prefill=True, max_num_batched_tokens=512) if arch.chunked else config
        row = search_goodput(arch, spec, cost, slo, cfg, iterations=iterations, min_duration_s=min_duration_s)
        assert row.goodput is not None
        rows.append({"setup": label, "goodput_rps": row.goodput, "goodput_per_gpu": row.goodput / gpus})
    return rows


def sarathi_capacity(
    tbt_slo_s: float, chunked: bool, min_duration_s: float = 120.0, iterations: int = 6
) -> dict[str, Any]:
    """Capacity (req/s) of one Mistral-7B A100 instance on the sharegpt4-shaped workload: the highest
    rate with P99 TBT <= ``tbt_slo_s`` and median TTFT <= 2 s."""
    hw = get_hardware("A100")
    cost = RooflineCostModel(hw, get_model("Mistral-7B"))
    prompt_mean, prompt_sigma = lognormal_from_median_p90(1730, 5696)
    output_mean, output_sigma = lognormal_from_median_p90(415, 834)
    spec = WorkloadSpec(
        num_requests=128,
        rate=0.5,
        prompt_len_mean=prompt_mean,
        prompt_len_sigma=prompt_sigma,
        prompt_len_max=16384,
        output_len_mean=output_mean,
        output_len_sigma=output_sigma,
        output_len_max=2048,
        seed=0,
    )
    base = SimConfig(kv_link_bw=hw.kv_link_bw, kv_link_latency_s=hw.kv_link_latency_s)
    cfg = (
        replace(base, enable_chunked_prefill=True, max_num_batched_tokens=512)
        if chunked
        else replace(base, enable_chunked_prefill=False)
    )
    found: dict[float, tuple[float, float]] = {}

    def meets(rate: float) -> float:
        num = max(spec.num_requests, math.ceil(rate * min_duration_s))
        reqs = build_workload(replace(spec, rate=rate, num_requests=num)).requests
        m = simulate(reqs, cost, cfg).metrics()
        found[rate] = (m.itl.p99_ms, m.ttft.p50_ms)
        ok = m.failed == 0 and m.itl.p99_ms <= tbt_slo_s * 1000 and m.ttft.p50_ms <= SARATHI_MAX_MEDIAN_DELAY_S * 1000
        return 1.0 if ok else 0.0

    capacity = max_rate_meeting_slo(meets, 0.5, spec.rate, iterations)
    p99_tbt, p50_ttft = found.get(capacity, (math.nan, math.nan))
    return {"capacity_rps": capacity, "p99_tbt_ms": p99_tbt, "p50_ttft_ms": p50_ttft}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs and coarser searches (a smoke test)")
    args = p.parse_args(argv)
    duration, iterations = (10.0, 3) if args.quick else (30.0, 6)
    t0 = time.perf_counter()
    print("DistServe Figure 1 (OPT-13B, A100, 512 in / 64 out, P90 TTFT 0.4 s, P90 TPOT 0.04 s):")
    for row in distserve_figure1(duration, iterations):
        print(f"  {row['setup']:<42} goodput {row['goodput_rps']:6.2f} req/s, {row['goodput_per_gpu']:5.2f} per GPU")
    print("Sarathi-Serve (Mistral-7B, one A100, sharegpt4-shaped lengths):")
    for name, slo in SARATHI_TBT_SLOS_S.items():
        cap = {c: sarathi_capacity(slo, c, 4 * duration, iterations) for c in (True, False)}
        ratio = cap[True]["capacity_rps"] / cap[False]["capacity_rps"] if cap[False]["capacity_rps"] else math.inf
        print(
            f"  P99 TBT <= {slo:g} s ({name}): chunked {cap[True]['capacity_rps']:.2f} req/s, whole prompts "
            f"{cap[False]['capacity_rps']:.2f} req/s: {ratio:.1f}x"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
