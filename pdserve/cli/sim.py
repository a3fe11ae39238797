"""``pdserve sim``: replay workloads on a step-time cost model through the real engine scheduler.

Actions (combinable; without ``--demo``/``--sweep``/``--pd-search``/``--calibrate`` it runs the
workload on the chosen architecture(s) and writes a report):

- default: colocated, disaggregated and/or auto runs of one workload → ``--out`` (results.json, report.md,
  PNGs); ``--mode both`` (the default) runs colocated and disaggregated, ``--mode all`` adds auto
- ``--demo``: the chunked-prefill demo (8k prompt, chunk 1024, 24 decodes, 50 ms ITL target by
  default, on one colocated instance unless ``--mode``/``--prefill-workers``/``--decode-workers`` say
  otherwise) plus the 32k chunking off-vs-on worst-ITL ratio
- ``--sweep chunk=128,256,...``: chunk-size sweep, P99 ITL vs prefill throughput and the knee
- ``--pd-search N``: colocated vs every P:D split of N GPUs, disaggregated and auto, goodput per GPU
  under ``--slo``
- ``--calibrate [PATH]``: measure our engine on this CPU and write the cpu-measured profile JSON
- ``--replay FILE``: replay the runs of a ``results.json`` (``pdserve sim``'s or ``pdserve bench``'s
  ``--out``) with their recorded step durations: step agreement and latency figures, replay vs run
- ``--serve``: serve the explorer's playground (a web page that runs the demo above for its controls)
  on ``--serve-host``:``--serve-port`` until interrupted; no cluster needed

Every run ends with the simulator's speed (simulated engine steps per wall-clock second).

Exit status: 0 on success, 2 on bad arguments or configuration (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdserve.deployment_config import DeploymentConfig
from pdserve.engine.config import EngineConfig
from pdserve.options import HelpFormatter, add_config_arguments, config_from_args, config_values, plain_text
from pdserve.router.config import RouterConfig
from pdserve.sim.api import DEFAULT_CALIBRATION, SimSettings, Simulation
from pdserve.sim.config import ENGINE_OPTIONS
from pdserve.workload.generator import add_workload_arguments, workload_spec_from_args

if TYPE_CHECKING:
    from pdserve.workload.metrics import SweepPoint
    from pdserve.workload.report import RunData

DEFAULT_OUT = os.path.join("results", "sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve sim", description=plain_text(__doc__.split("\n\n")[0]), formatter_class=HelpFormatter
    )
    add_config_arguments(p, SimSettings, title="hardware, model and architecture")
    add_config_arguments(
        p,
        DeploymentConfig,
        only=("num_prefill_workers", "num_decode_workers"),
        title="workers",
        description="disaggregated and auto: these instances; colocated: prefill + decode instances when compared "
        "with the others, else decode instances",
    )
    add_config_arguments(p, RouterConfig, only=("auto_min_remote_tokens",), title="router")
    add_config_arguments(p, EngineConfig, title="engine", only=ENGINE_OPTIONS)
    add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=DEFAULT_OUT, help="results directory")
    g.add_argument(
        "--no-report",
        action="store_true",
        help="write no files, print only (long runs: results.json holds every token)",
    )
    _add_action_arguments(p)
    _add_goodput_arguments(p)
    return p


def _add_goodput_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput and JSON")
    g.add_argument(
        "--goodput",
        action="store_true",
        help="per architecture of --mode: SLO attainment and goodput per GPU (the highest rate at which "
        "--attainment of the requests meet every --slo), found by a rate search",
    )
    g.add_argument("--json", action="store_true", help="print the result as JSON on stdout (nothing else)")


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    """The ``SimSettings`` of ``build_parser``'s options. Raises ValueError for bad values."""
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    return SimSettings(
        **config_values(SimSettings, args),
        prefill_workers=args.num_prefill_workers,
        decode_workers=args.num_decode_workers,
        engine=config_from_args(EngineConfig, args),
        auto_min_remote_tokens=args.auto_min_remote_tokens,
        seed=args.seed,
    )


def _add_action_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("actions")
    g.add_argument("--demo", action="store_true", help="the chunked-prefill demo and the 32k off/on ratio")
    g.add_argument("--demo-prompt-len", type=int, default=8192, help="demo: the long prompt's tokens")
    g.add_argument("--demo-chunk", type=int, default=1024, help="demo: the chunk size")
    g.add_argument("--demo-decodes", type=int, default=24, help="demo: the decodes running alongside")
    g.add_argument(
        "--demo-long-prompt-len", type=int, default=32768, help="demo: the prompt of the chunking off/on ratio"
    )
    g.add_argument("--pd-search", type=int, default=None, metavar="N", help="P:D search over N GPUs")
    g.add_argument("--attainment", type=float, default=0.9, help="pd search: SLO attainment target")
    g.add_argument("--no-rate-search", action="store_true", help="pd search: only the workload's own rate")
    g.add_argument(
        "--pd-min-duration",
        type=float,
        default=5.0,
        help="pd search: each rate-search run spans at least this many seconds of arrivals",
    )
    g.add_argument(
        "--calibrate",
        nargs="?",
        const=DEFAULT_CALIBRATION,
        default=None,
        metavar="PATH",
        help=f"measure the engine, write the cpu-measured JSON to PATH (without PATH: {DEFAULT_CALIBRATION})",
    )
    g.add_argument("--calibrate-model", default="bench", choices=("tiny", "bench"), help="calibration: the model")
    g.add_argument("--calibrate-quick", action="store_true", help="a tiny grid (seconds)")
    g.add_argument("--calibrate-budget-s", type=float, default=40.0, help="calibration: seconds to spend")
    g.add_argument("--torch-threads", type=int, default=None, help="calibration: torch threads of the engine")
    g.add_argument("--sweep", default=None, metavar="chunk=128,256,...", help="chunk-size sweep")
    g.add_argument(
        "--replay",
        default=None,
        metavar="FILE",
        help="replay the runs of FILE (a results.json of pdserve sim or pdserve bench --out, or its directory) "
        "with their recorded step durations: step agreement and TTFT/ITL of the replay vs the run",
    )
    g.add_argument("--quiet", action="store_true", help="print nothing but errors")
    g.add_argument("--serve", action="store_true", help="serve the explorer's playground page (Ctrl-C stops)")
    g.add_argument("--serve-host", default="127.0.0.1", help="--serve: the address to listen on")
    g.add_argument("--serve-port", type=int, default=8088, help="--serve: the port (0 = any free port)")


@dataclass(frozen=True)
class Findings:
    """What one action adds to the report (``write_report``'s arguments)."""

    runs: list[RunData] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sweep: list[SweepPoint] | None = None
    pd_rows: list[Any] | None = None


def _spec(args: argparse.Namespace, kind: str, default_requests: int = 100) -> Any:
    return workload_spec_from_args(args, kind, default_requests)


def run(args: argparse.Namespace) -> int:
    """Run the actions ``args`` ask for and write their report; returns the exit status.

    Raises ValueError on bad arguments or configuration."""
    from pdserve.sim.simulator import speed_tally

    say = (lambda *a: None) if args.quiet or args.json else print
    if args.serve:
        return serve_explorer(args.serve_host, args.serve_port)
    if args.calibrate:
        calibrate_profile(args, say)
        if not (args.demo or args.sweep or args.pd_search):
            return 0
    sim = Simulation(settings_from_args(args))
    actions = [(args.demo, run_demo), (args.sweep, run_sweep), (args.pd_search, run_pd_search)]
    actions += [(args.goodput, run_goodput), (args.replay, run_replay)]
    with speed_tally() as speed:
        findings = [action(args, sim, say) for wanted, action in actions if wanted]
        if not findings:
            findings = [run_architectures(args, sim, say)]
    if speed.num_runs:
        say(
            f"simulator speed: {speed.num_steps:,} steps in {speed.wall_s:.1f} s over {speed.num_runs} run(s), "
            f"{speed.steps_per_s:,.0f} simulated steps per second"
        )
    if not args.no_report:
        write_files(args, sim, findings, say)
    if args.json:
        print(
            json.dumps(
                {**json_document(args, sim, findings), "speed": speed.to_dict()}, indent=2, default=_json_default
            )
        )
    return 0


def write_files(args: argparse.Namespace, sim: Simulation, findings: list[Findings], say: Callable[..., None]) -> None:
    """The report of every action run: ``--out``'s results.json, report.md and plots."""
    from pdserve.workload.report import write_report

    os.makedirs(args.out, exist_ok=True)
    files = write_report(
        args.out,
        [r for f in findings for r in f.runs],
        config=_merged(
            {
                "hardware": args.hardware,
                "model_profile": sim.cost_model.model.name,
                "tp": args.tp,
                "cost_model": sim.cost_model.name,
                "sim": sim.config.to_dict(),
                "seed": args.seed,
            },
            *(f.config for f in findings),
        ),
        slo_ms=sim.slo_ms,
        itl_target_ms=args.itl_target_ms,
        title=f"pdserve sim: {sim.cost_model.name}",
        sweep=next((f.sweep for f in findings if f.sweep), None),
        pd_rows=next((f.pd_rows for f in findings if f.pd_rows), None),
        extra=_merged(*(f.extra for f in findings)),
        notes=[n for f in findings for n in f.notes],
        extra_plots=_merged(*(f.plots for f in findings)),
    )
    say(f"wrote {files.report_md} and {len(files.all_paths()) - 1} other files in {args.out}")


def serve_explorer(host: str, port: int) -> int:
    """``--serve``: the explorer (playground only) on ``host:port`` until SIGINT/SIGTERM."""
    import uvicorn

    from pdserve.explorer.app import build_explorer_app
    from pdserve.net import reuse_port_socket

    try:
        sock = reuse_port_socket(host, port)
    except OSError as e:
        raise ValueError(f"--serve-port: cannot listen on {host}:{port}: {e.strerror}") from None
    print(f"pdserve explorer (playground) on http://{host}:{sock.getsockname()[1]}/ ; Ctrl-C stops", flush=True)
    config = uvicorn.Config(build_explorer_app(), log_config=None, access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _merged(*dicts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for d in dicts for k, v in d.items()}


def calibrate_profile(args: argparse.Namespace, say: Callable[..., None]) -> None:
    """``--calibrate``: measure the engine on this CPU and write the cpu-measured profile."""
    from pdserve.sim.calibrate import CalibrationGrid, calibrate, describe_profile

    grid = CalibrationGrid.quick() if args.calibrate_quick else CalibrationGrid()
    grid = replace(grid, time_budget_s=args.calibrate_budget_s)
    prof = calibrate(
        args.calibrate_model,
        grid,
        args.calibrate,
        seed=args.seed,
        torch_threads=args.torch_threads,
        progress=None if args.quiet else say,
    )
    say(f"wrote {args.calibrate}\n{describe_profile(prof)}")
    if prof.fit_for("all").mean_abs_rel_error > 0.2:
        print(
            "pdserve sim: warning: the fit is poor (steps vary a lot at the same shape); other load on "
            "this machine? Measure again when it is idle, or with --torch-threads 1.",
            file=sys.stderr,
        )


def run_demo(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """``--demo``: the chunked-prefill demo, chunking on and off, and the long prompt's off/on ratio."""
    from pdserve.workload.plots import plot_step_timeline

    cost_model = sim.cost_model
    main_on = sim.demo(args.demo_prompt_len, args.demo_chunk, args.demo_decodes)
    main_off = sim.demo(args.demo_prompt_len, None, args.demo_decodes)
    cmp = sim.compare_chunking(args.demo_long_prompt_len, args.demo_chunk, args.demo_decodes)
    say(main_on.summary())
    say(
        f"{args.demo_long_prompt_len}-token prompt: worst decode stall "
        f"{cmp.off.worst_decode_stall_ms:.1f} ms "
        f"unchunked vs {cmp.on.worst_decode_stall_ms:.1f} ms with chunk {args.demo_chunk}: "
        f"{cmp.worst_itl_ratio:.1f}x better with chunking (TTFT {cmp.off.long_prompt_ttft_ms:.0f} -> "
        f"{cmp.on.long_prompt_ttft_ms:.0f} ms)"
    )
    plots = {}
    for tag, res in (
        ("demo_on", main_on),
        ("demo_off", main_off),
        ("demo_long_off", cmp.off),
        ("demo_long_on", cmp.on),
    ):
        mode = f"chunk {res.chunk_size}" if res.chunk_size else "chunking off"
        plots[f"timeline_{tag}"] = plot_step_timeline(
            res.window_steps,
            os.path.join(args.out, f"timeline_{tag}.png"),
            args.itl_target_ms,
            f"{res.prompt_len}-token prompt, {mode}, {res.num_decodes} decodes ({cost_model.name})",
        )
    return Findings(
        extra={"demo": {"main": main_on.to_dict(), "main_chunking_off": main_off.to_dict(), "long": cmp.to_dict()}},
        plots=plots,
        notes=[
            "Demo: " + main_on.summary().replace("\n", ";").replace("  ", " "),
            f"Demo, {args.demo_long_prompt_len}-token prompt: worst ITL off/on = {cmp.worst_itl_ratio:.1f}x",
        ],
    )


def run_sweep(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """``--sweep chunk=...``: P99 ITL against prefill throughput per chunk size, and the knee."""
    from pdserve.workload.generator import build_workload
    from pdserve.workload.metrics import find_knee, parse_sweep

    sizes = parse_sweep(args.sweep)
    wl = build_workload(_spec(args, args.workload or "interference"))
    sweep = sim.chunk_sweep(wl.requests, sizes, max_concurrency=args.max_concurrency)
    knee = find_knee(sweep, args.itl_target_ms)
    say("chunk  P99 ITL ms  (whole run)  prefill tok/s  mean TTFT ms")
    for pt in sweep:
        say(
            f"{pt.chunk_size:5d}  {pt.p99_itl_ms:10.1f}  {pt.p99_itl_all_ms:11.1f}  "
            f"{pt.prefill_throughput_tok_s:13.0f}  {pt.mean_ttft_ms:12.1f}"
        )
    say(f"knee for {args.itl_target_ms:g} ms: " + (f"chunk {knee.chunk_size}" if knee else "none meets it"))
    return Findings(config={"sweep_workload": wl.spec.to_dict()}, sweep=sweep)


def run_pd_search(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """``--pd-search N``: colocated against every P:D split of N GPUs, goodput per GPU under the SLOs."""

    spec = _spec(args, args.workload or "random", default_requests=400)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    pd_rows = sim.pd_search(
        spec,
        args.pd_search,
        attainment=args.attainment,
        search_rate=not args.no_rate_search,
        min_duration_s=args.pd_min_duration,
        progress=progress,
    )
    pd_rows = rank_pd_rows(say, pd_rows, args.attainment)
    return Findings(
        config={"pd_search_workload": spec.to_dict()},
        notes=[
            f"P:D search: SLO attainment target {100 * args.attainment:.0f}%; rate-search runs use at least "
            f"{spec.num_requests} requests and {args.pd_min_duration:g} s of arrivals."
        ],
        pd_rows=pd_rows,
    )


def run_goodput(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """``--goodput``: per architecture, the SLO attainments at the workload's rate and the goodput per
    GPU (rate search), best first."""
    spec = _spec(args, args.workload or "random", default_requests=200)
    rows = sim.goodput(
        spec, attainment=args.attainment, search_rate=not args.no_rate_search, min_duration_s=args.pd_min_duration
    )
    _say_goodput_rows(say, rows, args.attainment)
    return Findings(
        config={"goodput_workload": spec.to_dict(), "attainment_target": args.attainment},
        notes=[_goodput_note(args, spec.num_requests)],
        pd_rows=rows,
    )


def run_replay(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """``--replay FILE``: each recorded run replayed with its own step durations, against the run."""
    from pdserve.sim.replay import AGREEMENT_TARGET, FIGURES, P50_TOLERANCE

    reports = sim.replay(args.replay)
    notes = []
    for name, rep in reports:
        say(
            f"replay of {name}: {rep.num_steps} steps compared, step agreement {100 * rep.step_agreement:.1f}% "
            f"({rep.num_matched} match; {rep.unreplayed_steps} past the recorded steps)"
        )
        say(f"  {'figure':<9} {'replay ms':>10} {'run ms':>10} {'error':>8}")
        for figure in FIGURES:
            say(
                f"  {figure:<9} {rep.replayed[figure]:10.2f} {rep.recorded[figure]:10.2f} "
                f"{100 * rep.error(figure):+7.1f}%"
            )
        a = rep.alignment
        if a.get("events"):
            say(
                f"  admissions at their recorded step: {a['on_time']:.0f} on the replayed timeline, "
                f"{a['moved']:.0f} moved there (at most {a['moved_max_ms']:.1f} ms), {a['off']:.0f} further off"
            )
        verdict = "pass" if rep.passed else "fail"
        say(
            f"  {verdict}: step agreement >= {100 * AGREEMENT_TARGET:.0f}% and TTFT p50, ITL p50 within "
            f"{100 * P50_TOLERANCE:.0f}%"
        )
        notes.append(f"Replay of {name}: step agreement {100 * rep.step_agreement:.1f}%, {verdict}")
    return Findings(
        config={"replay_file": args.replay},
        extra={"replay": [{"name": name, **rep.to_dict()} for name, rep in reports]},
        notes=notes,
    )


def _goodput_note(args: argparse.Namespace, num_requests: int) -> str:
    return (
        f"Goodput: the highest request rate at which {100 * args.attainment:.0f}% of requests meet every SLO "
        f"(TTFT and TPOT), per GPU; rate-search runs use at least {num_requests} requests and "
        f"{args.pd_min_duration:g} s of arrivals. Attainments at the workload's own rate."
    )


def _say_goodput_rows(say: Callable[..., None], rows: list[Any], attainment: float) -> None:
    say(f"{'rank':>4}  {'config':<26} goodput/GPU  SLO met  TTFT met  TPOT met  (at the workload's rate)")
    for i, r in enumerate(rows, 1):
        goodput = "-" if r.goodput_per_gpu is None else f"{r.goodput_per_gpu:.3f}"
        say(
            f"{i:>4}  {r.name:<26} {goodput:>11}  {100 * r.slo_attainment:6.0f}%  {100 * r.ttft_attainment:7.0f}%  "
            f"{100 * r.tpot_attainment:7.0f}%"
        )
    say(f"goodput: req/s per GPU at which {100 * attainment:.0f}% of requests meet every SLO")


def json_document(args: argparse.Namespace, sim: Simulation, findings: list[Findings]) -> dict[str, Any]:
    """``--json``: the result of every action run. ``architectures``: the goodput or P:D search rows,
    best first (``goodput_per_gpu``, ``ttft_attainment``, ``tpot_attainment``, ...); ``runs``: each
    simulated architecture's metrics; ``sweep``: the chunk sweep's points; plus the demo's figures."""
    doc: dict[str, Any] = {
        "cost_model": sim.cost_model.name,
        "model": sim.cost_model.model.name,
        "slo_ms": dict(sim.slo_ms),
        "out": args.out,
    }
    runs = [r for f in findings for r in f.runs]
    if runs:
        doc["runs"] = [
            {
                "name": r.name,
                "num_gpus": r.meta.get("num_gpus"),
                "num_steps": r.meta.get("num_steps"),
                "steps_per_s": r.meta["num_steps"] / r.meta["wall_s"] if r.meta.get("wall_s") else None,
                **r.metrics(sim.slo_ms).to_dict(),
            }
            for r in runs
        ]
    rows = [row for f in findings for row in (f.pd_rows or [])]
    if rows:
        doc["architectures"] = [row.to_dict() for row in rows]
        doc["attainment_target"] = args.attainment
    sweeps = [f.sweep for f in findings if f.sweep]
    if sweeps:
        doc["sweep"] = [p.to_dict() for p in sweeps[0]]
    for f in findings:
        doc.update(f.extra)
    return doc


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def rank_pd_rows(say: Callable[..., None], rows: list[Any], attainment: float) -> list[Any]:
    """The P:D search's rows best first (goodput per GPU), printed."""
    from pdserve.sim.experiments import rank_rows

    ranked = rank_rows(rows)
    _say_goodput_rows(say, ranked, attainment)
    say(f"best per GPU: {ranked[0].name}")
    return ranked


def run_architectures(args: argparse.Namespace, sim: Simulation, say: Callable[..., None]) -> Findings:
    """The default action: the workload on colocated, disaggregated and/or auto instances."""
    from pdserve.workload.generator import build_workload
    from pdserve.workload.report import RunData, markdown_table

    spec = _spec(args, args.workload or "random")
    runs = []
    for run in sim.architectures(build_workload(spec).requests, max_concurrency=args.max_concurrency):
        res = run.result
        kv_moved = res.kv_bytes_moved if run.mode != "colocated" else None
        meta = {**res.config, "num_gpus": res.num_gpus, "num_steps": res.num_steps, "wall_s": res.wall_s}
        runs.append(RunData(run.name, res.records, res.steps, kv_moved, meta=meta))
    say(markdown_table([(r.name, r.metrics(sim.slo_ms), r.kv_bytes_moved) for r in runs]))
    return Findings(runs=runs, config={"workload": spec.to_dict()})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pdserve sim``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"pdserve sim: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
