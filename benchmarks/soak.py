# Over 500 lines: one script; its phases, client kinds and checks share the soak's counters and report.
"""Soak: a few hundred concurrent client streams for minutes against a local deployment, checked for leaks.

One deployment of the ``tiny`` preset (decode and prefill workers on this machine, loopback only) serves
phases of ``--phase-s`` seconds until ``--duration-s`` is spent, alternating:

- **mixed**: ``--streams`` clients, each sending one request after another until the phase ends: every
  mode (colocated, disaggregated, auto), short to long prompts, greedy and seeded sampling, and
  cancellations: clients that walk away mid-stream, client deadlines, and ``Abort`` RPCs sent from the
  client while it reads. Some requests are canaries whose greedy tokens were computed offline first.
- **overload**: the same clients plus as many again, beyond the router's ``max_active_requests``
  (``1.25 x streams``): ``RESOURCE_EXHAUSTED`` is expected there and counted as *rejected*; a rejected
  client backs off 20-200 ms and tries its next request.

After every phase the clients stop starting requests, the ones in flight drain (at most
``--drain-timeout-s``), and ``Stats`` must show every worker with all its KV blocks free or cached,
nothing running, waiting or reserved, and no request active in the router; the workers' block managers
check their own invariants too. A monitor calls ``Health`` and ``Stats`` every second throughout.

An error is *unexpected* (counted as failed) unless it is the expected end of what the client did:
``DEADLINE_EXCEEDED`` for a deadline, an ``abort`` finish after an ``Abort``, ``RESOURCE_EXHAUSTED``
in an overload phase. A completed stream must carry exactly ``max_tokens`` tokens (``ignore_eos``), the
mode asked for, and a canary its offline tokens. ``Health`` not serving, or naming a worker down, fails
too. The run ends with one table (streams started, completed, cancelled, rejected, failed, blocks
leaked, p50/p99 TTFT and ITL per phase) and exits 0 only with zero failures and zero leaked blocks.

    python benchmarks/soak.py --duration-s 180 --streams 300 --seed 0      # the full soak, about 4 minutes
    python benchmarks/soak.py --duration-s 16 --phase-s 8 --streams 32 --decode-workers 1 --transport grpc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

import grpc

from pdserve.bench.drain import Probe, wait_drained
from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.messages import Mode
from pdserve.router.client import AsyncClient, GenerateChunk
from pdserve.router.config import RouterConfig
from pdserve.transport_config import TRANSPORTS
from pdserve.workload.metrics import percentile

MAX_MODEL_LEN = 1024
AUTO_MIN_REMOTE_TOKENS = 128  # auto sends longer uncached prompts to the prefill pool, shorter ones stay local
BEHAVIOURS = ("complete", "walk_away", "deadline", "abort")
BEHAVIOUR_WEIGHTS = (70, 10, 10, 10)
CANARY_SHARE = 0.2  # of the requests that run to completion
CANARY_LENGTHS = (5, 40, 100, 150, 220, 300, 450, 600)
CANARY_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
DEADLINES_S = (0.5, 1.0, 2.0)  # client deadlines: one client (channel) per deadline
STREAMS_PER_CHANNEL = 50
REJECTED_BACKOFF_S = (0.02, 0.2)

Canaries = list[tuple[list[int], list[int]]]  # (prompt, its greedy tokens from the offline engine)


# ---- what each client does ------------------------------------------------------------------------------
class Spec(NamedTuple):
    request_id: str
    mode: str
    prompt: list[int]
    params: SamplingParams
    behaviour: str  # one of BEHAVIOURS
    cancel_after: int  # walk_away / abort: tokens read before leaving or aborting
    deadline_s: float  # deadline: the client's deadline
    expected: list[int] | None  # a canary's offline tokens


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def draw_spec(rng: random.Random, request_id: str, canaries: Canaries) -> Spec:
    mode = rng.choice(list(Mode))
    behaviour = rng.choices(BEHAVIOURS, BEHAVIOUR_WEIGHTS)[0]
    if behaviour == "complete" and rng.random() < CANARY_SHARE:
        prompt, expected = rng.choice(canaries)
        return Spec(request_id, mode, prompt, CANARY_PARAMS, behaviour, 0, 0.0, expected)
    size = rng.random()
    n = rng.randint(4, 64) if size < 0.5 else rng.randint(65, 256) if size < 0.85 else rng.randint(257, 700)
    if behaviour == "complete":
        max_tokens = rng.choice((1, 2, rng.randint(3, 32), rng.randint(3, 32), rng.randint(33, 96)))
    else:  # long enough that the cancellation lands mid-stream
        max_tokens = rng.randint(200, 300)
    greedy = rng.random() < 0.5
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if greedy else 0.9,
        top_k=0 if greedy else 40,
        seed=None if greedy else rng.getrandbits(31),
        ignore_eos=True,
    )
    return Spec(
        request_id, mode, random_prompt(rng, n), params, behaviour, rng.randint(1, 8), rng.choice(DEADLINES_S), None
    )


class Result(NamedTuple):
    outcome: str  # completed, walked_away, deadline, aborted, rejected, failed
    served_mode: str  # "colocated"/"disaggregated" from the last message's metadata; "" without one
    ttft_s: float | None
    itls_s: list[float]
    error: str = ""


def check_completed(spec: Spec, tokens: list[int], last: GenerateChunk) -> str:
    """Why a stream that ended normally is wrong ("" when it is right)."""
    meta = last.metadata
    if last.finish_reason != "length" or meta is None:
        return f"finished with {last.finish_reason!r} (metadata {meta is not None})"
    if len(tokens) != spec.params.max_tokens or meta.num_output_tokens != spec.params.max_tokens:
        return f"{len(tokens)} tokens streamed, {meta.num_output_tokens} counted, max_tokens {spec.params.max_tokens}"
    if meta.num_prompt_tokens != len(spec.prompt):
        return f"num_prompt_tokens {meta.num_prompt_tokens} != {len(spec.prompt)}"
    if spec.mode != "auto" and (meta.mode != spec.mode or meta.fallback):
        return f"asked for {spec.mode}, served {meta.mode} (fallback {meta.fallback!r})"
    if spec.expected is not None and tokens != spec.expected:
        return f"canary tokens differ from the offline engine's: {tokens} != {spec.expected}"
    return ""


@dataclass
class Clients:
    """Channels to the router: plain ones for most streams, one per client deadline."""

    plain: list[AsyncClient]
    by_deadline: dict[float, AsyncClient]

    @staticmethod
    def open(address: str, streams: int) -> Clients:
        plain = [AsyncClient(address) for _ in range(max(1, -(-streams // STREAMS_PER_CHANNEL)))]
        return Clients(plain, {d: AsyncClient(address, timeout_s=d) for d in DEADLINES_S})

    async def close(self) -> None:
        for client in [*self.plain, *self.by_deadline.values()]:
            await client.close()


async def run_one(spec: Spec, client: AsyncClient, clients: Clients, overload: bool) -> Result:
    """Send one request, behave as ``spec`` says, and classify how it ended."""
    caller = clients.by_deadline[spec.deadline_s] if spec.behaviour == "deadline" else client
    sent = time.monotonic()
    arrivals: list[float] = []
    tokens: list[int] = []
    last: GenerateChunk | None = None
    walked = aborted = False
    stream = caller.generate(spec.prompt, spec.params, mode=spec.mode, request_id=spec.request_id)
    try:
        async for chunk in stream:
            if chunk.token_ids:
                arrivals.append(time.monotonic())
                tokens += chunk.token_ids
            if chunk.finished:
                last = chunk
                break
            if len(tokens) >= spec.cancel_after > 0:
                if spec.behaviour == "walk_away":
                    walked = True
                    break
                if spec.behaviour == "abort" and not aborted:
                    aborted = True
                    await client.abort(spec.request_id)  # its stream must end with an "abort" finish
    except grpc.aio.AioRpcError as e:
        code = e.code()
        ttft = arrivals[0] - sent if arrivals else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and overload and not tokens:
            return Result("rejected", "", None, [])
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and spec.behaviour == "deadline":
            return Result("deadline", "", ttft, _gaps(arrivals))
        return Result("failed", "", ttft, _gaps(arrivals), f"{spec.request_id}: {code.name}: {e.details()}")
    finally:
        await stream.aclose()  # cancels the call when the client leaves early
    ttft, itls = (arrivals[0] - sent if arrivals else None), _gaps(arrivals)
    if walked:
        return Result("walked_away", "", ttft, itls)
    served = last.metadata.mode if last is not None and last.metadata is not None else ""
    if last is not None and last.finish_reason == "abort" and aborted:
        return Result("aborted", served, ttft, itls)
    why = "stream ended without a finished message" if last is None else check_completed(spec, tokens, last)
    if why:
        return Result("failed", served, ttft, itls, f"{spec.request_id} ({spec.mode}, {spec.behaviour}): {why}")
    return Result("completed", served, ttft, itls)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in pairwise(times)]


# ---- phases -------------------------------------------------------------------------------------------
@dataclass
class PhaseReport:
    name: str
    kind: str  # mixed or overload
    streams: int  # concurrent clients
    seconds: float = 0.0  # from the first request to the end of the drain check
    outcomes: Counter[str] = field(default_factory=Counter)
    asked_modes: Counter[str] = field(default_factory=Counter)
    served_modes: Counter[str] = field(default_factory=Counter)  # "auto->colocated": 3, ...
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    blocks_leaked: int = 0
    probe: Probe = field(default_factory=Probe)

    @property
    def started(self) -> int:
        return sum(self.outcomes.values())

    @property
    def cancelled(self) -> int:
        return self.outcomes["walked_away"] + self.outcomes["deadline"] + self.outcomes["aborted"]

    @property
    def failed(self) -> int:
        return self.outcomes["failed"]

    def fail(self, message: str) -> None:
        self.outcomes["failed"] += 1
        self.errors.append(message)

    def add(self, asked_mode: str, result: Result) -> None:
        self.outcomes[result.outcome] += 1
        self.asked_modes[asked_mode] += 1
        if result.served_mode:
            self.served_modes[f"{asked_mode}->{result.served_mode}"] += 1
        if result.ttft_s is not None:
            self.ttft_s.append(result.ttft_s)
        self.itl_s += result.itls_s
        if result.error:
            self.errors.append(result.error)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "streams": self.streams,
            "seconds": round(self.seconds, 1),
            "started": self.started,
            "completed": self.outcomes["completed"],
            "cancelled": self.cancelled,
            "walked_away": self.outcomes["walked_away"],
            "deadline": self.outcomes["deadline"],
            "aborted": self.outcomes["aborted"],
            "rejected": self.outcomes["rejected"],
            "failed": self.failed,
            "blocks_leaked": self.blocks_leaked,
            "asked_modes": dict(self.asked_modes),
            "served_modes": dict(self.served_modes),
            "ttft_p50_ms": _ms(percentile(self.ttft_s, 50)),
            "ttft_p99_ms": _ms(percentile(self.ttft_s, 99)),
            "itl_p50_ms": _ms(percentile(self.itl_s, 50)),
            "itl_p99_ms": _ms(percentile(self.itl_s, 99)),
            "health_max_ms": _ms(max(self.probe.health_s, default=0.0)),
            "stats_max_ms": _ms(max(self.probe.stats_s, default=0.0)),
            "errors": self.errors[:20],
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


async def client_loop(
    index: int, phase: PhaseReport, ends_at: float, clients: Clients, rng: random.Random, canaries: Canaries
) -> None:
    client = clients.plain[index % len(clients.plain)]
    overload = phase.kind == "overload"
    n = 0
    while time.monotonic() < ends_at:
        spec = draw_spec(rng, f"{phase.name}-c{index}-{n}", canaries)
        n += 1
        result = await run_one(spec, client, clients, overload)
        phase.add(spec.mode, result)
        if result.outcome == "rejected":
            await asyncio.sleep(rng.uniform(*REJECTED_BACKOFF_S))


async def run_phase(
    d: Deployment, phase: PhaseReport, phase_s: float, drain_timeout_s: float, seed: int, canaries: Canaries
) -> None:
    started = time.monotonic()
    clients = Clients.open(d.address, phase.streams)
    stop = asyncio.Event()
    watcher = asyncio.create_task(phase.probe.run(d.address, stop, interval_s=1.0))
    try:
        ends_at = started + phase_s
        tasks = [
            asyncio.create_task(
                client_loop(i, phase, ends_at, clients, random.Random(f"{seed}/{phase.name}/{i}"), canaries)
            )
            for i in range(phase.streams)
        ]
        _, stuck = await asyncio.wait(tasks, timeout=phase_s + drain_timeout_s)
        for task in stuck:  # a stream that neither ended nor failed long after its phase: a hang
            task.cancel()
            phase.fail(f"a {phase.name} client was still streaming {drain_timeout_s} s after the phase ended")
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                phase.fail(f"client crashed: {task.exception()!r}")
    finally:
        stop.set()
        await watcher
        await clients.close()
    unhealthy = {status: n for status, n in phase.probe.statuses.items() if status != "serving"}
    if unhealthy:  # every worker must answer Health, under load too
        phase.fail(f"Health during {phase.name} answered {unhealthy}")
    drain = await wait_drained(d.address, timeout_s=30.0)
    if not drain.clean:
        phase.blocks_leaked = drain.blocks_in_use
        phase.fail(f"not drained 30 s after {phase.name}: {drain.describe()}")
    try:
        await asyncio.to_thread(d.check_integrity)
    except Exception as e:
        phase.fail(f"block manager integrity after {phase.name}: {e!r}")
    phase.seconds = time.monotonic() - started


# ---- the run -------------------------------------------------------------------------------------------
def engine_config(kv_blocks: int) -> EngineConfig:
    return EngineConfig(
        model="tiny", device="cpu", seed=0, num_kv_blocks=kv_blocks, max_num_seqs=256, max_model_len=MAX_MODEL_LEN
    )


def offline_canaries(engine: EngineConfig, seed: int) -> Canaries:
    rng = random.Random(f"canaries/{seed}")
    prompts = [random_prompt(rng, n) for n in CANARY_LENGTHS]
    outs = LLMEngine(engine).generate(prompts, CANARY_PARAMS)
    return [(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]


def phase_plan(duration_s: float, phase_s: float, streams: int) -> list[PhaseReport]:
    count = max(1, round(duration_s / phase_s))
    kinds = ["mixed" if i % 2 == 0 else "overload" for i in range(count)]
    return [
        PhaseReport(f"{i + 1}-{kind}", kind, streams * (2 if kind == "overload" else 1)) for i, kind in enumerate(kinds)
    ]


def soak(args: argparse.Namespace) -> list[PhaseReport]:
    engine = engine_config(args.kv_blocks)
    canaries = offline_canaries(engine, args.seed)
    router = RouterConfig(
        auto_min_remote_tokens=AUTO_MIN_REMOTE_TOKENS, max_active_requests=args.streams + args.streams // 4
    )
    config = DeploymentConfig(
        engine=engine,
        mode="auto",
        num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers,
        transport=args.transport,
        router=router,
        ray_init_kwargs={"log_to_driver": False},
    )
    phases = phase_plan(args.duration_s, args.phase_s, args.streams)
    with Deployment(config) as d:
        for phase in phases:
            asyncio.run(run_phase(d, phase, args.phase_s, args.drain_timeout_s, args.seed, canaries))
            print(
                f"phase {phase.name}: {phase.started} streams in {phase.seconds:.0f} s, {phase.failed} failed",
                flush=True,
            )
    return phases


COLUMNS = (
    ("phase", "name", "<12"),
    ("secs", "seconds", ">5"),
    ("streams", "streams", ">7"),
    ("started", "started", ">7"),
    ("completed", "completed", ">9"),
    ("cancelled", "cancelled", ">9"),
    ("walked", "walked_away", ">6"),
    ("deadline", "deadline", ">8"),
    ("aborted", "aborted", ">7"),
    ("rejected", "rejected", ">8"),
    ("failed", "failed", ">6"),
    ("leaked", "blocks_leaked", ">6"),
    ("TTFT p50", "ttft_p50_ms", ">8"),
    ("TTFT p99", "ttft_p99_ms", ">8"),
    ("ITL p50", "itl_p50_ms", ">7"),
    ("ITL p99", "itl_p99_ms", ">7"),
    ("health max", "health_max_ms", ">10"),
    ("stats max", "stats_max_ms", ">9"),
)


def _row(values: dict[str, Any]) -> str:
    return " ".join(format(values[key], spec) for _, key, spec in COLUMNS)


def total(phases: list[PhaseReport]) -> PhaseReport:
    merged = PhaseReport("total", "all", max((p.streams for p in phases), default=0))
    for p in phases:
        merged.seconds += p.seconds
        merged.outcomes += p.outcomes
        merged.asked_modes += p.asked_modes
        merged.served_modes += p.served_modes
        merged.ttft_s += p.ttft_s
        merged.itl_s += p.itl_s
        merged.errors += p.errors
        merged.blocks_leaked += p.blocks_leaked
        merged.probe.health_s += p.probe.health_s
        merged.probe.stats_s += p.probe.stats_s
        merged.probe.statuses += p.probe.statuses
    return merged


def print_table(phases: list[PhaseReport]) -> None:
    print(" ".join(format(title, spec) for title, _, spec in COLUMNS))
    for phase in [*phases, total(phases)]:
        print(_row(phase.summary()))
    overall = total(phases).summary()
    print(f"(milliseconds; asked modes {overall['asked_modes']}; served {overall['served_modes']})")
    for error in overall["errors"]:
        print(f"  unexpected: {error}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=180.0, help="time spent in phases (start and drains extra)")
    p.add_argument("--phase-s", type=float, default=30.0, help="length of one phase")
    p.add_argument("--streams", type=int, default=300, help="concurrent client streams in a mixed phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--transport", choices=TRANSPORTS, default="nixl")
    p.add_argument("--kv-blocks", type=int, default=3072, help="KV blocks per worker (16 tokens each)")
    p.add_argument("--drain-timeout-s", type=float, default=120.0, help="how long in-flight streams may take to end")
    p.add_argument("--json", help="also write the per-phase and total figures here")
    args = p.parse_args(argv)
    if args.streams < 1 or args.duration_s <= 0 or args.phase_s <= 0 or args.drain_timeout_s <= 0:
        p.error("--streams, --duration-s, --phase-s and --drain-timeout-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = soak(args)  # the deployment stops Ray when it started it
    print()
    print_table(phases)
    overall = total(phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "phases": [p.summary() for p in phases], "total": overall.summary()}, f)
    return 0 if overall.failed == 0 and overall.blocks_leaked == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
