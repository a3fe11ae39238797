# Over 500 lines: the runner drives every target (in-process deployments, a gRPC router, an HTTP server) and sweep.
"""``pdserve bench``: the A/B benchmark of the real system, one architecture after another.

Each architecture gets a fresh deployment on the same number of workers (disaggregated and
auto: ``--prefill-workers`` P + ``--decode-workers`` D; colocated and baseline: P + D workers; the baseline
is colocated under the prefill-first policy with whole prompts, ``architecture_engine``), a warm-up that is
left out of the figures, then the workload, sent on its arrival schedule from an asyncio client
that timestamps every token.
With ``--target HOST:PORT`` it runs against a router that is already serving (the architectures
then name the per-request mode override). ``--target http://HOST:PORT`` sends the same workload to any
OpenAI-compatible server instead (streaming ``/v1/completions`` with token-id prompts, ``ignore_eos`` and
``return_token_ids``; pdserve's own HTTP API, vLLM, llama.cpp's ``llama-server``, ...), with the same
per-token client timestamps.
Writes results.json, report.md and PNG plots.

    pdserve bench --architectures colocated,disaggregated,auto --num-requests 64 --rate 4 --out results/ab
    pdserve bench --architectures colocated,disaggregated --repeats 3 ...   # median and spread of each figure
    pdserve bench --sweep chunk=128,256,512,1024 --workload interference --out results/sweep
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from tqdm import tqdm

from pdserve.deployment_config import DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.messages import Mode, StepStats, WorkerStats, request_id_of
from pdserve.options import (
    RawDescriptionHelpFormatter,
    add_config_arguments,
    config_from_args,
    config_values,
    option_fields,
    plain_text,
)
from pdserve.router.config import RouterConfig
from pdserve.transport_config import TransportConfig
from pdserve.workload.generator import (
    WorkloadRequest,
    add_workload_arguments,
    build_workload,
    uniform_workload,
    workload_spec_from_args,
)
from pdserve.workload.metrics import RequestRecord, SweepPoint, find_knee, parse_slo, parse_sweep, sweep_point
from pdserve.workload.report import RunData, markdown_table, write_report
from pdserve.workload.spread import differences, spread_table, summarize

BASELINE = "baseline"
ARCHITECTURES = (*Mode, BASELINE)
# the classic baseline of the disaggregation papers (vLLM v0's scheduler): colocated, prompts whole, a step of
# prompts runs while any prompt can and the decodes wait (``architecture_engine``)
BASELINE_SCHEDULING = "prefill-first"


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: the client's records and every worker's steps (``worker`` set), on one clock
    (unix time), ordered by start."""

    records: list[RequestRecord]
    steps: list[StepStats]
    kv_bytes_moved: int
    duration_s: float


# ---- sending a workload --------------------------------------------------------------------------------


async def _timed_request(
    req: WorkloadRequest,
    start: float,
    limit: asyncio.Semaphore | None,
    bar: Any,
    fetch: Callable[[list[float]], Awaitable[tuple[str | None, int | None, dict[str, Any]]]],
) -> RequestRecord:
    """Send ``req`` at its arrival offset (within the concurrency ``limit``) and record it.

    ``fetch(times)`` streams the request, appending a client timestamp per token to ``times``, and
    returns ``(error, output tokens as the server counts them or None for len(times), meta)``.
    """
    await asyncio.sleep(max(0.0, start + req.arrival_offset_s - time.time()))
    if limit is not None:
        await limit.acquire()
    send = time.time()
    times: list[float] = []
    try:
        error, num_output, meta = await fetch(times)
    finally:
        if limit is not None:
            limit.release()
        bar.update()
    return RequestRecord(
        req.request_id,
        send,
        tuple(times),
        req.num_prompt_tokens,
        num_output,  # None: one token per timestamp
        ok=error is None,
        error=error,
        end_time=time.time(),
        label=req.label,
        meta=meta,
    )


async def send_workload(
    address: str,
    requests: Sequence[WorkloadRequest],
    mode: str | None,
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "",
) -> list[RequestRecord]:
    """Send every request at its arrival offset; one RequestRecord (client timestamps) each."""
    from pdserve.router.client import AsyncClient

    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False, file=sys.stderr)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client: AsyncClient, req: WorkloadRequest, start: float) -> RequestRecord:
        async def fetch(times: list[float]) -> tuple[str | None, int | None, dict[str, Any]]:
            meta: dict[str, Any] = {}
            try:
                params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
                async for chunk in client.generate(req.prompt_token_ids, params, mode=mode):
                    now = time.time()
                    times.extend([now] * len(chunk.token_ids))
                    if chunk.metadata is not None:
                        meta = chunk.metadata._asdict()
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}", None, meta
            return None, None, meta

        return await _timed_request(req, start, limit, bar, fetch)

    async with AsyncClient(address) as client:
        start = time.time()
        records = await asyncio.gather(*[one(client, r, start) for r in requests])
    bar.close()
    return list(records)


def is_http_target(target: str | None) -> bool:
    return bool(target) and target.startswith(("http://", "https://"))  # type: ignore[union-attr]


async def send_workload_http(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    mode: str | None,
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "",
) -> list[RequestRecord]:
    """``send_workload`` against an OpenAI-compatible server: streaming ``/v1/completions``, one record each.

    A chunk's ``token_ids`` (``return_token_ids``, as pdserve and vLLM support it) says how many tokens it
    brought; else the growth of its ``timings.predicted_n`` (llama.cpp's ``llama-server`` with
    ``timings_per_token``, which holds back a token that ends inside a UTF-8 character); else each
    non-empty chunk counts as one token, and the final ``usage`` gives the total (ITL then has one gap per
    chunk). ``mode`` goes out as ``pdserve_mode``; ``pdserve_metrics`` lands in
    the record's ``meta``.
    """
    import aiohttp

    base_url = base_url.rstrip("/")
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False, file=sys.stderr)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(session: aiohttp.ClientSession, model: str, req: WorkloadRequest, start: float) -> RequestRecord:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(req.prompt_token_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "timings_per_token": True,  # llama.cpp: each chunk's timings.predicted_n counts its tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if mode is not None:
            body["pdserve_mode"] = mode

        async def fetch(times: list[float]) -> tuple[str | None, int | None, dict[str, Any]]:
            try:
                async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        return f"HTTP {resp.status}: {(await resp.text())[:500]}", None, {}
                    return await _read_events(resp.content, times)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                return f"{type(e).__name__}: {e}", None, {}

        return await _timed_request(req, start, limit, bar, fetch)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{base_url}/v1/models") as resp:
            resp.raise_for_status()
            model = (await resp.json())["data"][0]["id"]
        start = time.time()
        records = await asyncio.gather(*[one(session, model, r, start) for r in requests])
    bar.close()
    return list(records)


async def _read_events(content: Any, times: list[float]) -> tuple[str | None, int | None, dict[str, Any]]:
    """Read an OpenAI completion stream; appends one arrival time per token. (error, usage tokens, metrics)."""
    num_output: int | None = None
    meta: dict[str, Any] = {}
    predicted = 0  # llama.cpp's running count of generated tokens (timings.predicted_n)
    async for line in content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        now = time.time()
        chunk = json.loads(data)
        if "error" in chunk:
            return f"stream error: {chunk['error'].get('message')}", num_output, meta
        choices = chunk.get("choices") or ()
        counted = (chunk.get("timings") or {}).get("predicted_n")
        if isinstance(counted, int) and not any(c.get("token_ids") is not None for c in choices):
            times.extend([now] * max(0, counted - predicted))
            predicted = max(predicted, counted)
            choices = ()
        for choice in choices:
            ids = choice.get("token_ids")
            times.extend([now] * (len(ids) if ids is not None else int(bool(choice.get("text")))))
        if chunk.get("usage"):
            num_output = chunk["usage"].get("completion_tokens")
        meta = chunk.get("pdserve_metrics") or meta
    return None, num_output, meta


def _measure_http(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    mode: str | None,
    warmup: Sequence[WorkloadRequest],
    max_concurrency: int | None,
    progress: bool,
    desc: str,
) -> MeasuredRun:
    """An OpenAI-compatible server: client records only (no worker steps); KV bytes from ``pdserve_metrics``."""
    if warmup:
        asyncio.run(send_workload_http(base_url, warmup, mode, None, False))
    t0 = time.time()
    records = asyncio.run(send_workload_http(base_url, requests, mode, max_concurrency, progress, desc))
    duration = time.time() - t0
    moved = sum(int(r.meta.get("kv_transfer_bytes", 0)) for r in records)
    return MeasuredRun(records, [], moved, duration)


def measure(
    address: str,
    requests: Sequence[WorkloadRequest],
    mode: str | None,
    *,
    warmup: Sequence[WorkloadRequest] = (),
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "",
) -> MeasuredRun:
    """Warm up (not recorded), then run the workload; collect client records and the workers' steps.

    ``address`` is a router's ``HOST:PORT`` (gRPC), or ``http(s)://HOST:PORT`` of an OpenAI-compatible server.
    """
    from pdserve.router.client import Client

    if is_http_target(address):
        return _measure_http(address, requests, mode, warmup, max_concurrency, progress, desc)
    if warmup:
        asyncio.run(send_workload(address, warmup, mode, None, False))
    with Client(address) as client:
        before = {w.worker_id: w.kv_bytes_moved for w in client.stats()}
        t0 = time.time()
        records = asyncio.run(send_workload(address, requests, mode, max_concurrency, progress, desc))
        duration = time.time() - t0
        stats = client.stats(steps_since=t0)
    steps = sorted((s._replace(worker=w.worker_id) for w in stats for s in w.steps), key=lambda s: s.started)
    moved = sum(w.kv_bytes_moved - before.get(w.worker_id, 0) for w in stats if w.role == "prefill")
    return MeasuredRun(with_admission_steps(records, stats), steps, moved, duration)


def admission_steps(stats: Sequence[WorkerStats]) -> dict[str, dict[str, int]]:
    """Per request, each worker's step count when it took the request in, from the workers' admission traces:
    ``{client's request id: {"decode_queued_step": k, "decode_reserved_step": k, "prefill_queued_step": k}}``, ``k``
    counting that worker's steps in ``stats`` that started before the admission (the position of the first
    step it could join among them). A trace replay (``sim.replay``) reads them from the records' meta."""
    out: dict[str, dict[str, int]] = {}
    for w in stats:
        starts = sorted(s.started for s in w.steps)
        for event in w.admissions:
            name = f"{w.role}_{event.event}_step"
            out.setdefault(request_id_of(event.request_id), {})[name] = bisect.bisect_left(starts, event.time)
    return out


def with_admission_steps(records: Sequence[RequestRecord], stats: Sequence[WorkerStats]) -> list[RequestRecord]:
    """``records`` with each one's ``admission_steps`` in its meta (of each kind, the latest)."""
    steps = admission_steps(stats)
    return [
        dataclasses.replace(r, meta={**r.meta, **steps[r.request_id]}) if r.request_id in steps else r for r in records
    ]


def target_problem(target: str, timeout_s: float = 10.0) -> str | None:
    """Why ``target`` (a router's ``HOST:PORT`` or an ``http(s)://`` server) cannot be benchmarked, in one
    line naming it; None when it answers."""
    if is_http_target(target):
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(target.rstrip("/") + "/v1/models", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            return None  # it answers (an auth error or a missing route shows in the requests' failures)
        except (urllib.error.URLError, OSError) as e:
            return f"cannot reach {target}: {getattr(e, 'reason', e)}"
        return None
    from pdserve.router.client import Client

    try:
        with Client(target, timeout_s=timeout_s) as client:
            client.health()
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"cannot reach {target}: {e.code().name}: {e.details()}"
    return None


def warmup_requests(n: int, seed: int) -> list[WorkloadRequest]:
    """Requests that warm a deployment up before a measured run (left out of its figures)."""
    return uniform_workload(n, (32, 256), (8, 8), seed=seed + 12345, prefix="warmup", label="warmup")


# ---- deployments ---------------------------------------------------------------------------------------


def worker_counts(args: argparse.Namespace) -> tuple[int, int]:
    """``(prefill, decode)`` workers of the disaggregated and auto deployments; colocated gets their sum."""
    prefill = 1 if args.num_prefill_workers is None else args.num_prefill_workers
    if prefill < 0 or args.num_decode_workers < 1:
        raise ValueError("--prefill-workers must be >= 0 and --decode-workers >= 1")
    return prefill, args.num_decode_workers


def architecture_engine(architecture: str, engine: EngineConfig) -> EngineConfig:
    """The engine options ``architecture`` runs with: ``engine``'s; the baseline's under the prefill-first policy
    with whole prompts."""
    if architecture != BASELINE:
        return engine
    return dataclasses.replace(
        engine, scheduling=BASELINE_SCHEDULING, enable_chunked_prefill=False, max_chunk_tokens=None
    )


def deployment_config(architecture: str, args: argparse.Namespace, engine: EngineConfig) -> DeploymentConfig:
    prefill, decode = worker_counts(args)
    if architecture in ("colocated", BASELINE):
        prefill, decode = 0, prefill + decode
    values = config_values(DeploymentConfig, args)
    return DeploymentConfig(
        **{**values, "num_prefill_workers": prefill, "num_decode_workers": decode},
        engine=architecture_engine(architecture, engine),
        mode="colocated" if architecture == BASELINE else architecture,
        port=0,
        router=config_from_args(RouterConfig, args),
    )


def engine_config(args: argparse.Namespace, chunk: int | None = None) -> EngineConfig:
    """The engine options of ``args``; torch threads default to the cores shared among the workers.

    ``chunk`` (the sweep) caps each request's chunk and raises the budget by ``max_num_seqs``, so that
    decodes never squeeze the chunk."""
    threads = args.torch_threads or max(1, (os.cpu_count() or 2) // max(1, sum(worker_counts(args))))
    if chunk is None:
        return config_from_args(EngineConfig, args, torch_threads=threads)
    return config_from_args(
        EngineConfig,
        args,
        torch_threads=threads,
        max_chunk_tokens=chunk,
        max_num_batched_tokens=chunk + args.max_num_seqs,
    )


@contextlib.contextmanager
def deployed(architecture: str, args: argparse.Namespace, engine: EngineConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh deployment of ``architecture`` (or ``--target``): yields its address and a description."""
    from pdserve.deployment import Deployment

    if args.target:
        yield args.target, {"target": args.target}
        return
    config = deployment_config(architecture, args, engine)
    engine = config.engine
    meta = {
        "architecture": architecture,
        "scheduling": engine.scheduling,
        "enable_chunked_prefill": engine.enable_chunked_prefill,
        "prefill_workers": config.num_prefill_workers,
        "decode_workers": config.num_decode_workers,
        "transport": config.transport,
        "torch_threads": engine.torch_threads,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_chunk_tokens": engine.max_chunk_tokens,
    }
    with Deployment(config) as deployment:
        yield deployment.address, meta


def run_architecture(
    architecture: str, args: argparse.Namespace, requests: Sequence[WorkloadRequest], engine: EngineConfig
) -> tuple[MeasuredRun, dict[str, Any]]:
    """Warm up and run ``requests`` once on a fresh deployment of ``architecture``."""
    with deployed(architecture, args, engine) as (address, meta):
        run = measure(
            address,
            requests,
            architecture if args.target else None,
            warmup=warmup_requests(args.warmup, args.seed),
            max_concurrency=args.max_concurrency,
            progress=not args.no_progress,
            desc=architecture,
        )
    return run, meta


# ---- the command ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench", description=plain_text(__doc__ or ""), formatter_class=RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("architectures")
    g.add_argument(
        "--architectures",
        default="colocated,disaggregated",
        help=f"comma-separated, from {', '.join(ARCHITECTURES)} (baseline: colocated, prefill-first, whole prompts)",
    )
    add_config_arguments(
        p,
        DeploymentConfig,
        only=("num_prefill_workers", "num_decode_workers", "gpus_per_worker", *option_fields(TransportConfig)),
        title="deployments",
        description="colocated runs on prefill + decode workers, all colocated",
    )
    g.add_argument(
        "--target",
        default=None,
        help="HOST:PORT of a running router, or http://HOST:PORT of any OpenAI-compatible server "
        "(no deployment is started)",
    )
    g.add_argument("--warmup", type=int, default=4, help="warm-up requests per architecture (not measured)")
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per architecture, each on a fresh deployment; the report gives every figure's median and "
        "spread (min–max) and calls out only differences beyond the spread",
    )
    add_config_arguments(p, RouterConfig, title="router")
    add_config_arguments(p, EngineConfig, title="engine", exclude=("seed",))  # --seed seeds the workload
    add_workload_arguments(p)
    p.add_argument("--max-output", type=int, default=None, help="shortcut: cap every output length")
    g = p.add_argument_group("targets and output")
    g.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft=500,tpot=100")
    g.add_argument("--itl-target-ms", type=float, default=None)
    g.add_argument(
        "--sweep",
        default=None,
        metavar="chunk=128,256,...",
        help="chunk-size sweep on one colocated deployment per size",
    )
    g.add_argument("--out", default=os.path.join("results", "bench"))
    g.add_argument("--no-progress", action="store_true")
    return p


def _workload(args: argparse.Namespace, kind: str) -> list[WorkloadRequest]:
    spec = workload_spec_from_args(args, kind, default_requests=64)
    requests = list(build_workload(spec).requests)
    if args.max_output:
        requests = [
            WorkloadRequest(
                r.request_id, r.prompt_token_ids, min(r.max_tokens, args.max_output), r.arrival_offset_s, r.label
            )
            for r in requests
        ]
    return requests


def main(argv: list[str] | None = None) -> int:
    import ray

    args = build_parser().parse_args(argv)
    try:
        slo = parse_slo(args.slo)
        archs = [a.strip() for a in args.architectures.split(",") if a.strip()]
        bad = [a for a in archs if a not in ARCHITECTURES]
        if bad or not archs:
            raise ValueError(f"--architectures: unknown {bad} (choose from {', '.join(ARCHITECTURES)})")
        if args.target and BASELINE in archs:
            raise ValueError("--architectures baseline starts a deployment of its own: not with --target")
        if worker_counts(args)[0] == 0 and set(archs) - {"colocated", BASELINE}:
            raise ValueError("--prefill-workers 0: disaggregated and auto need at least one prefill worker")
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        kind = args.workload or ("interference" if args.sweep else "random")
        requests = _workload(args, kind)
        chunks = parse_sweep(args.sweep) if args.sweep else None
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    if args.target:
        problem = target_problem(args.target)
        if problem is not None:
            print(f"pdserve bench: error: {problem}", file=sys.stderr)
            return 1

    started_ray = False
    if not args.target and not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
        started_ray = True
    try:
        if chunks:
            return _sweep(args, chunks, requests, slo)
        runs = _run_repeats(args, archs, requests, kind)
        files = write_report(
            args.out,
            runs,
            config=_config(args, kind),
            slo_ms=slo,
            itl_target_ms=args.itl_target_ms,
            title=f"pdserve A/B benchmark ({kind} workload, {sum(worker_counts(args))} workers each)",
        )
        print()
        print(markdown_table([(r.name, r.metrics(slo), r.kv_bytes_moved) for r in runs]))
        if args.repeats > 1:
            summary = summarize({a: [r.metrics(slo) for r in runs if r.group == a] for a in archs})
            print("\nmedian (min–max) over the repeats:\n" + spread_table(summary))
            found = differences(summary)
            print("\ndifferences beyond the spread:\n" + ("\n".join(f"- {d}" for d in found) or "- none"))
        print(f"\nwrote {', '.join(files.all_paths())}")
        return 0
    finally:
        if started_ray:
            ray.shutdown()


def _run_repeats(
    args: argparse.Namespace, archs: list[str], requests: list[WorkloadRequest], kind: str
) -> list[RunData]:
    """Every architecture ``--repeats`` times, each on a fresh deployment, interleaved (colocated #1,
    disaggregated #1, colocated #2, ...) so that a change in the machine's load hits them alike."""
    runs = []
    for i in range(args.repeats):
        for arch in archs:
            name = arch if args.repeats == 1 else f"{arch} #{i + 1}"
            print(f"[{name}] {len(requests)} requests ({kind}) ...", flush=True)
            run, meta = run_architecture(arch, args, requests, engine_config(args))
            meta = {**meta, "repeat": i + 1}
            runs.append(RunData(name, run.records, run.steps, run.kv_bytes_moved, run.duration_s, meta, group=arch))
            failed = sum(1 for r in run.records if not r.succeeded)
            print(f"[{name}] done in {run.duration_s:.1f} s, {failed} failed", flush=True)
    return runs


def _sweep(args: argparse.Namespace, chunks: list[int], requests: list[WorkloadRequest], slo: dict) -> int:
    points: list[SweepPoint] = []
    runs = []
    for chunk in chunks:
        print(f"[chunk {chunk}] ...", flush=True)
        run, meta = run_architecture("colocated", args, requests, engine_config(args, chunk))
        points.append(sweep_point(chunk, run.records, run.steps))
        runs.append(RunData(f"chunk {chunk}", run.records, run.steps, None, run.duration_s, meta))
        p = points[-1]
        print(
            f"[chunk {chunk}] P99 ITL {p.p99_itl_ms:.1f} ms, prefill {p.prefill_throughput_tok_s:.0f} tok/s, "
            f"long TTFT p99 {p.p99_ttft_ms:.0f} ms",
            flush=True,
        )
    target = args.itl_target_ms or 50.0
    knee = find_knee(points, target)
    files = write_report(
        args.out,
        runs,
        config=_config(args, "sweep"),
        slo_ms=slo,
        itl_target_ms=target,
        title="pdserve chunk-size sweep (measured)",
        sweep=points,
        notes=[
            f"knee for a {target:g} ms ITL target: "
            + (f"chunk {knee.chunk_size}" if knee else "no chunk size meets it")
        ],
    )
    print(f"\nknee for {target:g} ms: {knee.chunk_size if knee else 'none'}; wrote {files.report_md}")
    return 0


def _config(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    d = {
        k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
        for k, v in vars(args).items()
        if not k.startswith("_")  # the parser's own records
    }
    d["workload"] = kind
    return d


if __name__ == "__main__":
    sys.exit(main())
