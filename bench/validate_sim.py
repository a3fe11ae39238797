"""Validate the simulator against the real system on this machine.

1. Calibrate the cpu-measured profile: fit the linear step-time model to the server-side step
   timings of real deployments (colocated and disaggregated) serving a *calibration* workload —
   other requests than the validation ones (another seed). Measured in place, the steps carry what
   a deployment costs on 2 shared cores (two workers, the router, Ray and the client competing);
   ``--offline`` instead measures the engine alone (``pdserve sim --calibrate``), for comparison.
2. Replay the same workloads — the long-prompt interference scenario and a random one — through the
   simulator (with that profile) and through real deployments, colocated and disaggregated, with the
   same number of workers and the same engine settings.
3. Print simulated vs measured TTFT p50/p99 and ITL p50/p99 side by side, with the error of each.

    python bench/validate_sim.py [--model bench] [--calibration results/cpu-profile.json]

Target: every simulated figure within 20% of the measured one. Where it misses, the table says by
how much; the README discusses why (router and Ray overheads the cost model does not see, noise).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pdserve.bench.metrics import compute_metrics
from pdserve.bench.workloads import WorkloadSpec, build_workload


def _workloads(args: argparse.Namespace, seed: int) -> dict[str, list]:
    interference = WorkloadSpec(
        kind="interference",
        num_requests=args.long_prompts,
        num_streams=args.streams,
        stream_prompt_len=64,
        stream_output_len=args.stream_output,
        long_prompt_len=args.long_len,
        long_output_len=8,
        long_period_s=args.long_period,
        long_start_s=0.5,
        seed=seed,
    )
    random_spec = WorkloadSpec(
        kind="random",
        num_requests=args.random_requests,
        rate=args.rate,
        seed=seed,
        prompt_len_mean=256,
        prompt_len_max=1024,
        output_len_mean=48,
        output_len_max=128,
    )
    return {
        "interference": list(build_workload(interference).requests),
        "random": list(build_workload(random_spec).requests),
    }


def _figures(records) -> dict[str, float]:
    m = compute_metrics(records)
    return {"TTFT p50": m.ttft.p50_ms, "TTFT p99": m.ttft.p99_ms, "ITL p50": m.itl.p50_ms, "ITL p99": m.itl.p99_ms}


def main(argv: list[str] | None = None) -> int:
    import ray
    from pdserve.bench.runner import build_parser as bench_parser
    from pdserve.bench.runner import engine_config, run_architecture
    from pdserve.bench.sim.calibrate import CalibrationGrid, MeasuredStep, calibrate, fit_linear_profile
    from pdserve.bench.sim.cost_model import LinearCostModel
    from pdserve.bench.sim.profiles import get_model, load_linear_profile, save_linear_profile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench", choices=["tiny", "bench"])
    p.add_argument("--calibration", default=os.path.join("results", "cpu-profile-validate.json"))
    p.add_argument("--offline", action="store_true", help="calibrate on the engine alone, not in place")
    p.add_argument("--transport", default="nixl", choices=["nixl", "grpc"])
    p.add_argument("--chunk", type=int, default=256, help="token budget per step (max_num_batched_tokens)")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--stream-output", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--long-period", type=float, default=2.0)
    p.add_argument("--random-requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("results", "validate"))
    args = p.parse_args(argv)

    bench_args = bench_parser().parse_args(
        [
            "--model",
            args.model,
            "--workers",
            "2",
            "--transport",
            args.transport,
            "--max-num-batched-tokens",
            str(args.chunk),
            "--torch-threads",
            "1",
            "--no-progress",
            "--warmup",
            "2",
        ]
    )
    engine = engine_config(bench_args)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        if args.offline:
            print(f"calibrating {args.model} alone on this CPU (1 torch thread) ...", flush=True)
            calibrate(args.model, CalibrationGrid(), args.calibration, torch_threads=1)
        else:
            print("calibrating in place: the calibration workloads on real deployments ...", flush=True)
            steps = []
            for requests in _workloads(args, args.seed + 1000).values():
                for arch in ("colocated", "disaggregated"):
                    run, _ = run_architecture(arch, bench_args, requests, engine)
                    steps += [MeasuredStep(s[2], s[3], s[5], s[1]) for s in run.raw_steps]
            save_linear_profile(fit_linear_profile(steps, model=args.model, notes="in place"), args.calibration)
        profile = load_linear_profile(args.calibration)
        cost = LinearCostModel(profile, get_model(args.model))
        rows = _validate(args, bench_args, engine, profile, cost)
    finally:
        ray.shutdown()
    return _report(args, rows)


Row = tuple[str, str, dict[str, float], dict[str, float]]  # workload, architecture, simulated, measured


def _validate(args, bench_args, engine, profile, cost) -> list[Row]:
    from pdserve.bench.runner import run_architecture
    from pdserve.bench.sim.config import SimConfig
    from pdserve.bench.sim.simulator import simulate

    print(
        f"profile: {profile.fixed_overhead_s * 1e3:.2f} ms + {profile.per_prefill_token_s * 1e6:.1f} us/prefill"
        f" tok + {profile.per_decode_token_s * 1e6:.1f} us/decode tok"
        f" + {profile.per_context_token_s * 1e9:.2f} ns/ctx tok"
        f" (fit error {profile.mean_abs_rel_error:.0%})",
        flush=True,
    )

    sim_config = SimConfig.from_engine_config(engine)
    rows: list[Row] = []
    for name, requests in _workloads(args, args.seed).items():
        for arch in ("colocated", "disaggregated"):
            kwargs: dict[str, Any] = (
                {"num_instances": 2} if arch == "colocated" else {"num_prefill": 1, "num_decode": 1}
            )
            sim = simulate(
                requests,
                cost,
                sim_config,
                mode=arch,
                kv_link_bw=profile.kv_link_bw,
                kv_link_latency_s=profile.kv_link_latency_s,
                **kwargs,
            )
            measured, _ = run_architecture(arch, bench_args, requests, engine)
            rows.append((name, arch, _figures(sim.records), _figures(measured.records)))
            print(
                f"{name:>12} {arch:>13}: "
                + "  ".join(f"{k} sim {rows[-1][2][k]:7.1f} / real {rows[-1][3][k]:7.1f} ms" for k in rows[-1][2]),
                flush=True,
            )
    return rows


def _report(args, rows) -> int:
    lines = [
        "| workload | architecture | figure | simulated ms | measured ms | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    errors = []
    for name, arch, sim_fig, real_fig in rows:
        for key in sim_fig:
            err = (sim_fig[key] - real_fig[key]) / real_fig[key] if real_fig[key] else float("inf")
            errors.append(abs(err))
            lines.append(f"| {name} | {arch} | {key} | {sim_fig[key]:.1f} | {real_fig[key]:.1f} | {err:+.0%} |")
    table = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(f"# Simulator vs measured ({args.model}, chunk budget {args.chunk}, {args.transport})\n\n{table}\n")
    print("\n" + table)
    within = sum(1 for e in errors if e <= 0.2)
    print(
        f"\n{within} of {len(errors)} figures within 20% (worst {max(errors):.0%}); "
        f"wrote {os.path.join(args.out, 'validation.md')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
