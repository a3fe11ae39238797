"""Does the pace probe follow the machine? Two engines repeat one fixed job side by side and time the probe
between jobs; if the probe moves with the machine, the job's CPU time divided by the probe's drifts less
than the job's CPU time alone.

    python benchmarks/pace_probe_check.py                 # 2 engines (one per core) for 6 minutes
    python benchmarks/pace_probe_check.py --seconds 60    # shorter

Each engine (the ``bench`` model, one torch thread) generates 24 tokens for each of 10 prompts of 60 tokens,
over and over, and times the probe (``engine.pace_probe``) before and after each job, all on the thread's
CPU clock. It prints, per engine: the jobs, the correlation of a job's CPU time with its probes', and over
windows of ``--window`` jobs the spread (max/min) of the median job's CPU time and of the median job over
its probe.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=360.0, help="how long each engine repeats its job")
    p.add_argument("--engines", type=int, default=2, help="engines side by side, one process each")
    p.add_argument("--window", type=int, default=20, help="jobs per window for the spread")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def repeat_job(seconds: float, out: Any) -> None:
    """One engine's loop: (probe before, job CPU time, probe after) per job, sent to ``out``."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.pace_probe import PaceProbe

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model="bench", device="cpu", num_kv_blocks=1024, max_model_len=1024))
    probe = PaceProbe(1.0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 for j in range(60)] for i in range(10)]
    engine.generate(prompts[:2], params)  # warm up
    jobs = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = probe.time_kernel()
        start = time.thread_time()
        engine.generate(prompts, params)
        job = time.thread_time() - start
        jobs.append((before, job, probe.time_kernel()))
    out.send(jobs)


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation; NaN for fewer than 3 values or a constant series."""
    try:
        return statistics.correlation(xs, ys) if len(xs) > 2 else float("nan")
    except statistics.StatisticsError:
        return float("nan")


def summarize(jobs: list[tuple[float, float, float]], window: int) -> dict[str, float]:
    """Correlation of job and probe CPU time; the spread over windows of the median job and of the median job
    per probe (its mean probe before and after)."""
    job = [j for _, j, _ in jobs]
    probe = [(a + b) / 2 for a, _, b in jobs]
    per_probe = [j / p for j, p in zip(job, probe, strict=True)]
    windows = range(0, len(jobs) - window + 1, window)
    job_medians = [statistics.median(job[i : i + window]) for i in windows]
    ratio_medians = [statistics.median(per_probe[i : i + window]) for i in windows]
    return {
        "jobs": len(jobs),
        "job_ms": 1e3 * statistics.median(job),
        "probe_ms": 1e3 * statistics.median(probe),
        "correlation": correlation(job, probe),
        "windows": len(job_medians),
        "job_spread": max(job_medians) / min(job_medians) if job_medians else float("nan"),
        "job_per_probe_spread": max(ratio_medians) / min(ratio_medians) if ratio_medians else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for _ in range(args.engines):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=repeat_job, args=(args.seconds, send))
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    results = []
    for receive, proc in zip(pipes, procs, strict=True):
        if not receive.poll(args.seconds + 600):
            proc.kill()
            print("an engine did not report in time", file=sys.stderr)
            return 1
        results.append(summarize(receive.recv(), args.window))
        proc.join(30)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{args.engines} engines side by side for {args.seconds:.0f} s; windows of {args.window} jobs")
    print("engine  jobs  job ms  probe ms  correlation  windows  job spread  job/probe spread")
    for i, r in enumerate(results):
        print(
            f"{i:>6}  {r['jobs']:>4}  {r['job_ms']:6.0f}  {r['probe_ms']:8.2f}  {r['correlation']:11.2f}  "
            f"{r['windows']:>7}  {r['job_spread']:10.3f}  {r['job_per_probe_spread']:16.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
