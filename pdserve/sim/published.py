"""The simulator on two published comparisons, with the papers' models, hardware, workloads and SLOs as
closely as their material allows (``docs/simulator.md`` sets the papers' figures next to these):

- **DistServe** (OSDI 2024), its OPT-13B chatbot comparison on A100-80GB GPUs (ShareGPT conversations,
  SLOs TTFT 0.25 s and TPOT 0.1 s): vLLM on one GPU against DistServe with a prefill instance of TP 2
  and a decode instance of TP 1. The simulator runs the very requests of DistServe's measured runs
  (their artifact's per-request results, shipped in ``published_data``), vLLM on DistServe's fit of
  vLLM's step times under the prefill-first policy with whole prompts, DistServe on its fit of its own
  engine with that placement, and is compared with the measured TTFT, TPOT and SLO attainment of every
  run, then searched for each system's goodput per GPU on the same conversations at Poisson arrivals;
- **Sarathi-Serve** (OSDI 2024): Mistral-7B on one A100, a workload shaped like openchat_sharegpt4
  (lognormal lengths with its median and P90), capacity = the highest rate with P99 time-between-tokens
  within the SLO and the median scheduling delay (here: TTFT) under 2 s, chunked prefill at a token
  budget of 512 against whole prompts under the prefill-first policy (vLLM's scheduler of the time).

``python -m pdserve.sim.published [--quick]`` prints both tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import RooflineCostModel
from pdserve.sim.cost_profile import PUBLISHED_DIR, PolynomialCostModel, load_cost_profile
from pdserve.sim.experiments import max_rate_meeting_slo
from pdserve.sim.profiles import get_hardware, get_model
from pdserve.sim.simulator import SimResult, simulate
from pdserve.workload.generator import WorkloadRequest, WorkloadSpec, build_workload

DISTSERVE_CHATBOT_SLO_MS = {"ttft": 250.0, "tpot": 100.0}  # DistServe's Table 1, chatbot, OPT-13B
DISTSERVE_REFERENCE = os.path.join(PUBLISHED_DIR, "distserve-opt-13b-sharegpt-measured.json")
SARATHI_TBT_SLOS_S = {"strict": 0.1, "relaxed": 0.5}
SARATHI_MAX_MEDIAN_DELAY_S = 2.0
NVLINK_GB_S = 300.0  # DistServe places its prefill and decode instances in one node: the KV moves over NVLink


def lognormal_from_median_p90(median: float, p90: float) -> tuple[float, float]:
    """(arithmetic mean, log-space sigma) of the lognormal with this median and P90."""
    sigma = math.log(p90 / median) / 1.2815515655446004
    return median * math.exp(sigma * sigma / 2), sigma


@dataclass(frozen=True)
class MeasuredRun:
    """One of DistServe's measured runs: its system, GPUs, rate and every request as measured."""

    name: str
    system: str  # "vllm" or "distserve"
    num_gpus: int
    rate: float
    requests: tuple[tuple[int, int, float, float, float], ...]  # prompt, output, issue s, ttft ms, tpot ms

    @property
    def rate_per_gpu(self) -> float:
        return self.rate / self.num_gpus


def load_distserve_reference(path: str = DISTSERVE_REFERENCE) -> list[MeasuredRun]:
    """DistServe's measured runs shipped with pdserve (see the file's ``source``), in file order."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return [
        MeasuredRun(name, run["system"], run["num_gpus"], run["rate"], tuple(tuple(r) for r in run["requests"]))
        for name, run in doc["runs"].items()
    ]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50000) for _ in range(n)]


def trace_requests(run: MeasuredRun, seed: int = 0) -> list[WorkloadRequest]:
    """The run's requests as sent (its prompt and output lengths, its issue times), random prompt tokens."""
    rng = random.Random(seed)
    return [
        WorkloadRequest(f"{run.name}-{i}", _prompt(rng, prompt), output, issue)
        for i, (prompt, output, issue, _, _) in enumerate(run.requests)
    ]


def poisson_requests(lengths: Sequence[tuple[int, int]], rate: float, num: int, seed: int) -> list[WorkloadRequest]:
    """``num`` requests drawn from ``lengths`` (prompt, output) at Poisson arrivals of ``rate``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num):
        prompt, output = lengths[rng.randrange(len(lengths))]
        out.append(WorkloadRequest(f"r{i}", _prompt(rng, prompt), output, t))
        t += rng.expovariate(rate)
    return out


def simulate_system(system: str, requests: Sequence[WorkloadRequest]) -> SimResult:
    """``requests`` on DistServe's setting for ``system``: vLLM (its fit, one GPU, prefill-first, whole
    prompts) or DistServe (its fit, a prefill instance of TP 2 with whole prompts, a decode instance of TP 1,
    the KV over NVLink)."""
    if system == "vllm":
        cost = PolynomialCostModel(load_cost_profile("vllm-opt-13b-a100"))
        config = SimConfig(
            enable_chunked_prefill=False,
            scheduling="prefill-first",
            max_num_seqs=256,  # vLLM's default
            enable_prefix_caching=False,
            kv_link_bw=NVLINK_GB_S * 1e9,
            kv_link_latency_s=20e-6,
        )
        return simulate(requests, cost, config)
    if system != "distserve":
        raise ValueError(f"unknown system {system!r} (vllm or distserve)")
    profile = load_cost_profile("distserve-opt-13b-a100")
    config = SimConfig(
        enable_chunked_prefill=False,
        max_num_seqs=256,
        enable_prefix_caching=False,
        kv_link_bw=NVLINK_GB_S * 1e9,
        kv_link_latency_s=20e-6,
    )
    return simulate(
        requests,
        PolynomialCostModel(profile, tp=1),
        config,
        mode="disaggregated",
        num_prefill=1,
        num_decode=1,
        prefill_cost_model=PolynomialCostModel(profile, tp=2),
        prefill_tp=2,
    )


def _attained(ttft_ms: float, tpot_ms: float, slo_ms: dict[str, float]) -> bool:
    return ttft_ms <= slo_ms["ttft"] and tpot_ms <= slo_ms["tpot"]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_figures(ttfts_ms: Sequence[float], tpots_ms: Sequence[float], slo_ms: dict[str, float]) -> dict[str, float]:
    """SLO attainment, TTFT p50/p90 and TPOT p50/p90 (ms) of per-request figures."""
    attained = sum(_attained(a, b, slo_ms) for a, b in zip(ttfts_ms, tpots_ms, strict=True))
    return {
        "attainment": attained / len(ttfts_ms),
        "ttft_p50_ms": _percentile(ttfts_ms, 0.5),
        "ttft_p90_ms": _percentile(ttfts_ms, 0.9),
        "tpot_p50_ms": _percentile(tpots_ms, 0.5),
        "tpot_p90_ms": _percentile(tpots_ms, 0.9),
    }


def distserve_chatbot_runs(slo_ms: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Every measured run of ``load_distserve_reference`` against the simulator on its very requests: per run
    the measured and the simulated ``run_figures``."""
    slo = dict(slo_ms or DISTSERVE_CHATBOT_SLO_MS)
    rows = []
    for run in load_distserve_reference():
        measured = run_figures([r[3] for r in run.requests], [r[4] for r in run.requests], slo)
        result = simulate_system(run.system, trace_requests(run))
        records = result.records
        ttfts = [1000 * (r.ttft if r.ttft is not None else math.inf) for r in records]
        tpots = [1000 * (r.tpot or 0.0) for r in records]
        rows.append(
            {
                "run": run.name,
                "system": run.system,
                "num_gpus": run.num_gpus,
                "rate_per_gpu": run.rate_per_gpu,
                "measured": measured,
                "simulated": run_figures(ttfts, tpots, slo),
            }
        )
    return rows


def distserve_chatbot_goodput(
    system: str, seeds: Sequence[int] = (0, 1, 2), duration_s: float = 120.0, iterations: int = 6
) -> dict[str, Any]:
    """``system``'s goodput per GPU (the highest rate at which 90 % of requests attain both SLOs) on the
    measured runs' conversations at Poisson arrivals, per seed: mean and range."""
    lengths = sorted({(r[0], r[1]) for run in load_distserve_reference() for r in run.requests})
    gpus = 1 if system == "vllm" else 3
    slo = DISTSERVE_CHATBOT_SLO_MS
    goodputs = []
    for seed in seeds:

        def attain(rate: float, seed: int = seed) -> float:
            requests = poisson_requests(lengths, rate, max(200, math.ceil(rate * duration_s)), seed)
            records = simulate_system(system, requests).records
            met = sum(r.ttft is not None and _attained(1000 * r.ttft, 1000 * (r.tpot or 0.0), slo) for r in records)
            return met / len(records)

        goodputs.append(max_rate_meeting_slo(attain, 0.9, 1.0 * gpus, iterations) / gpus)
    return {"system": system, "num_gpus": gpus, "goodput_per_gpu": statistics.mean(goodputs), "seeds": goodputs}


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
        else replace(base, enable_chunked_prefill=False, scheduling="prefill-first")
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
    slo = DISTSERVE_CHATBOT_SLO_MS
    print(f"DistServe, OPT-13B chatbot on A100-80GB (ShareGPT; SLOs TTFT {slo['ttft']:g} ms, TPOT {slo['tpot']:g} ms):")
    print("  run                       rate/GPU  attained (measured / simulated)  TTFT p90 ms          TPOT p90 ms")
    for row in distserve_chatbot_runs():
        m, s = row["measured"], row["simulated"]
        attained = f"{100 * m['attainment']:5.1f}% / {100 * s['attainment']:5.1f}%"
        print(
            f"  {row['run']:<25} {row['rate_per_gpu']:8.2f}  {attained}                  {m['ttft_p90_ms']:7.0f} / "
            f"{s['ttft_p90_ms']:7.0f}   {m['tpot_p90_ms']:6.1f} / {s['tpot_p90_ms']:6.1f}"
        )
    seeds = (0,) if args.quick else (0, 1, 2)
    for system in ("vllm", "distserve"):
        g = distserve_chatbot_goodput(system, seeds, 4 * duration, iterations)
        spread = f" ({min(g['seeds']):.2f}-{max(g['seeds']):.2f})" if len(g["seeds"]) > 1 else ""
        print(f"  simulated goodput per GPU, {system:<9}: {g['goodput_per_gpu']:.2f} req/s{spread}")
    print("Sarathi-Serve (Mistral-7B, one A100, sharegpt4-shaped lengths):")
    for name, tbt in SARATHI_TBT_SLOS_S.items():
        cap = {c: sarathi_capacity(tbt, c, 4 * duration, iterations) for c in (True, False)}
        ratio = cap[True]["capacity_rps"] / cap[False]["capacity_rps"] if cap[False]["capacity_rps"] else math.inf
        print(
            f"  P99 TBT <= {tbt:g} s ({name}): chunked {cap[True]['capacity_rps']:.2f} req/s, whole prompts "
            f"{cap[False]['capacity_rps']:.2f} req/s: {ratio:.1f}x"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
