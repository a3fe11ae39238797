# Over 500 lines: one discrete-event loop whose handlers (arrival, step, KV link, admission) share its state.
"""Discrete-event replay of a workload through the engine's real scheduler, protocol and routing policy.

Nothing of the serving logic is re-typed here. Every instance owns an ``engine.scheduler.Scheduler``
over an ``engine.block_manager.BlockManager`` whose ``clock`` is the virtual clock; a step is what
``Scheduler.schedule()`` returns, priced by a cost model (``sim.cost_model``) instead of run.
Requests are routed by the router's own ``router.policy.RoutingPolicy`` (``route``, then the
bookkeeping calls ``start``, ``prefill_done`` and ``finish`` at the moments the router makes them),
so ``auto`` is the router's rule. Disaggregation follows ``engine.remote_kv``: a prefill instance keeps
a FIFO of accepted prompts and admits the head while ``prefill_admission_open`` holds, reserving its
blocks on the decode instance at that moment (``reserve_remote_blocks``; a head that finds no room
waits); every sampled token goes through the stop rule (``append_token``); the decode instance admits
a request (``admit_remote``) once its whole prompt's KV has arrived *and* the router's decode call,
sent when the first token reached it, has.

Modes (the deployment's default mode; ``auto`` decides per request):

- **colocated**: ``num_instances`` decode instances, chunked prefill + decode in one batch;
- **disaggregated** / **auto**: ``num_prefill`` prefill + ``num_decode`` decode instances. After each
  prefill chunk its KV (tokens x ``kv_bytes_per_token``) is queued on the prefill instance's link (FIFO,
  ``kv_link_bw`` plus ``kv_link_latency_s``), overlapping the next chunk; the last chunk samples the
  first token; the prefill side holds its blocks until its last transfer has landed.

Around the steps, ``SimConfig`` adds a deployment's latencies (a token's delivery; each control call:
starting a request, the reservation, applied between the decode instance's steps, and its answer, the
decode call, the last three priced as worker-to-worker paths where the config measures them; the engine
loop's gap between steps) and, with ``step_tail``, the machine's measured
slowdown: one factor per window of virtual time, shared by all instances, stretching the steps there.
With a ``co_run_slowdown`` (instances sharing one machine's cores), a step also runs slower while
other instances run steps: every step's end is re-timed when another instance starts or ends one.

The engine loop's timing, as ``engine.engine_loop`` runs it: an idle instance starts a step on the
first work that reaches it (a request, an admitted prompt, a decode handed over): work reaching it
later at the same virtual instant joins its next step, as the real loop, woken by the first command,
steps before the next call arrives. When a step ends, everything that arrived meanwhile or arrives
at that instant joins the next one (the loop drains its commands between steps). A prefill instance's
admission rule reads the waiting prompt tokens as the loop last saw them: while a step runs, those of
just before it (the prompts it is computing included) plus the prompts admitted since.

``step_durations`` (trace replay, ``sim.replay``) replaces the cost model: an instance's ``k``-th step
lasts the ``k``-th recorded duration of that instance; ``step_gaps``, the loop's time after it;
``call_latencies`` and ``handoff_latencies``, per request, its call's recorded latency from the client to
its worker and its recorded handoff from the prefill to the decode instance; ``reserve_latencies``, its
reservation's recorded round trip; ``routes``, the workers it was served by (where the routing policy,
on its own view, would have chosen others, counted in ``rerouted``). ``admission_steps`` gives, per request
and admission event (``ADMISSION_EVENTS``: its prompt or its remote KV queued on a worker, its blocks
reserved on the decode worker), the worker's step count the run recorded for it: an event that the
replayed timeline puts within ``tie_window_s`` of the step boundary the run put it behind is moved across
that boundary (held back to the recorded step, or the step waits for it), and one further off is left where
the timeline puts it (``alignment`` counts both).
Speed: a decode instance whose step is decode-only with nothing waiting runs the same batch step
after step until a request finishes or something reaches it. Such a run of steps (``_DecodeRun``) is
planned ahead, each step priced by the cost model and the clock advanced by the same additions as one
event per step would, and applied to the scheduler, the requests and the step records only when
something reaches the instance or the run ends, in the order the steps one by one would have; the
results are the same bit for bit (``coalesce_decode_steps=False`` runs step by step).

The simulator is deterministic for a given seed.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine import remote_kv
from pdserve.engine.block_manager import BlockManager, compute_block_hashes
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.messages import Mode, StepStats
from pdserve.router.config import RouterConfig
from pdserve.router.policy import Route, RoutingPolicy
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import DECODE_GROUP_SIZE, CostModel, DecodePricer, StepShape, decode_pricer
from pdserve.sim.profiles import quantile_at
from pdserve.workload.generator import WorkloadRequest
from pdserve.workload.metrics import BenchmarkMetrics, RequestRecord, compute_metrics

_DECODE_GROUP = DECODE_GROUP_SIZE  # the engine's decode attention groups (the keys a decode step reads)
_RUN_PLAN_STEPS = 8  # a coalesced run plans this many steps ahead at first, then doubles
DUMMY_TOKEN = 0  # what a simulated step "samples"; never EOS (requests run to max_tokens)
# a request's admission events on a worker, named as its record's meta names their step counts (``<event>_step``)
ADMISSION_EVENTS = ("decode_queued", "decode_reserved", "prefill_queued")


@dataclass(frozen=True)
class SimResult:
    """Everything one simulated run produced; ``steps`` carry their instance in ``worker``."""

    mode: str
    records: tuple[RequestRecord, ...]
    steps: tuple[StepStats, ...]
    instances: tuple[str, ...]
    kv_bytes_moved: int = 0
    num_gpus: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    step_chunks: tuple[tuple[tuple[str, int], ...], ...] = ()  # per step (as ``steps``): (request id, tokens)
    num_steps: int = 0  # steps simulated (also when the config keeps no step records)
    wall_s: float = 0.0  # wall-clock seconds the simulation took

    @property
    def steps_per_s(self) -> float:
        """The simulator's speed: simulated engine steps per wall-clock second."""
        return self.num_steps / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self, slo_ms: dict[str, float] | str | None = None) -> BenchmarkMetrics:
        return compute_metrics(self.records, slo_ms)

    def steps_of(self, instance: str) -> list[StepStats]:
        return [s for s in self.steps if s.worker == instance]

    def record(self, request_id: str) -> RequestRecord:
        for r in self.records:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)


@dataclass
class SpeedTally:
    """The simulator's speed over the runs made while it is active (``speed_tally``)."""

    num_runs: int = 0
    num_steps: int = 0
    wall_s: float = 0.0

    @property
    def steps_per_s(self) -> float:
        """Simulated engine steps per wall-clock second."""
        return self.num_steps / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, result: SimResult) -> None:
        self.num_runs += 1
        self.num_steps += result.num_steps
        self.wall_s += result.wall_s

    def to_dict(self) -> dict[str, float]:
        return {
            "runs": self.num_runs,
            "steps": self.num_steps,
            "wall_s": self.wall_s,
            "steps_per_s": self.steps_per_s,
        }


_ACTIVE_TALLIES: list[SpeedTally] = []


@contextmanager
def speed_tally() -> Iterator[SpeedTally]:
    """Count the steps and wall time of every simulator run inside the ``with`` block (nested blocks each count)."""
    tally = SpeedTally()
    _ACTIVE_TALLIES.append(tally)
    try:
        yield tally
    finally:
        _ACTIVE_TALLIES.remove(tally)


class _Instance:
    def __init__(self, name: str, cost_role: str, scheduler: Scheduler, index: int = 0) -> None:
        self.name = name
        self.index = index  # its place in the deployment's order (prefill instances first)
        self.cost_role = cost_role  # how the cost model prices its steps (cost_model.ROLES)
        self.scheduler = scheduler
        self.busy = False
        self.output: SchedulerOutput | None = None  # the step running now, if any
        self.step: _Step | None = None  # its timing
        self.link_free_at = 0.0
        self.fifo: deque[_Client] = deque()  # a prefill instance's accepted prompts, not yet admitted
        self.reserving = False  # a prefill instance waits for the reservation of its FIFO's head
        self.waiting_for_room: set[_Instance] = set()  # a decode instance: prefill instances whose head found no room
        self.commands: list[tuple[Callable[..., None], tuple]] = []  # calls that arrived during a step
        self.num_steps_started = 0
        self.tick_waiting_tokens = 0  # a prefill instance: waiting prompt tokens just before the running step
        self.admitted_since_tick = 0  # ... and prompt tokens admitted since it started
        self.run: _DecodeRun | None = None  # a coalesced run of decode-only steps in progress
        # replay: admission events held back to the step the run recorded for them, and the recorded
        # (step, request id, event) still to come here, in step order; when the next step waits for one
        self.deferred: list[_Deferred] = []
        self.expected: deque[tuple[int, str, str]] = deque()
        self.hold_since: float | None = None

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.deferred)

    def deferred_prompt_tokens(self) -> int:
        """Prompt tokens of the prefills held back from this (prefill) instance's scheduler."""
        return sum(d.prompt_tokens for d in self.deferred if d.event == "prefill_queued")


@dataclass
class _Deferred:
    """Replay: an admission event that reached its instance before the step the run recorded for it."""

    step: int  # the recorded step count: it joins that step
    since: float  # when the replayed timeline brought it
    request_id: str
    event: str
    action: Callable[[], None]
    prompt_tokens: int = 0
    moved: float = 0.0  # since it came, to the start of the last step before the recorded one


@dataclass
class AlignmentTally:
    """Replay: how the admission events compared with the step counts the run recorded for them."""

    on_time: int = 0  # the replayed timeline put it before the recorded step, as the run did
    moved: list[float] = field(default_factory=list)  # within the tie window: moved by this much (s) to match
    off: int = 0  # further off than the window: left where the timeline put it

    @property
    def num_events(self) -> int:
        return self.on_time + len(self.moved) + self.off

    def to_dict(self) -> dict[str, float]:
        return {
            "events": self.num_events,
            "on_time": self.on_time,
            "moved": len(self.moved),
            "moved_max_ms": 1e3 * max(self.moved, default=0.0),
            "off": self.off,
        }


@dataclass
class _Step:
    """A running step's timing: ``work_s`` of priced time left as of ``since``, done at ``1 / multiplier``
    of the machine's pace (the co-run slowdown while other instances run steps); ``version`` tells the
    current completion event from those a re-timing superseded (unique over the run)."""

    shape: StepShape
    started: float
    work_s: float
    since: float
    multiplier: float = 1.0
    version: int = -1


@dataclass
class _DecodeRun:
    """A run of identical decode-only steps on one instance, advanced without an event per step.

    Step ``i`` (1-based) computes one token of every request of ``requests``, the ``q``-th at position
    ``first_starts[q] + i - 1``; it starts at ``starts[i - 1]`` and ends at ``ends[i - 1]`` (planned up to
    ``len(ends)``, at most ``last_step``: a request finishes in that step or the next one would need more
    blocks than are free). The scheduler's state is that of step ``at`` running: the steps before it
    applied, its blocks allocated. ``groups``: (size, longest context in step 1) of each group of the
    engine's decode attention (the keys it reads)."""

    requests: list[Request]
    clients: list[_Client]
    first_starts: list[int]
    last_step: int
    price: DecodePricer
    reads_keys: bool
    groups: list[tuple[int, int]]
    composition: tuple[tuple[str, int], ...]
    starts: list[float]
    ends: list[float]
    deliveries: list[float]  # ``ends`` plus the token latency: when each step's tokens reach the clients
    at: int = 1
    version: int = -1

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    def context_tokens(self, step: int) -> int:
        return sum(self.first_starts) + self.num_seqs * step

    def decode_keys(self, step: int, block_size: int) -> int:
        """``cost_model.decode_keys`` of step ``step``'s decodes: every context grows by one a step, so
        the groups stay and each pads to its longest."""
        return sum(size * (-(-(longest + step - 1) // block_size) * block_size) for size, longest in self.groups)


@dataclass
class _Client:
    """The client's view of one request, plus where the router sent it and the handoff state."""

    wreq: WorkloadRequest
    send_time: float = math.nan
    token_times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    end_time: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    route: Route | None = None
    decode: _Instance | None = None
    prefill: _Instance | None = None
    decode_req: Request | None = None
    prefill_req: Request | None = None
    sent_upto: int = 0  # prompt tokens whose KV is on the decode side or on its way
    prompt_hashes: list[bytes] = field(default_factory=list)  # the prompt's block hashes, computed once
    kv_complete: bool = False
    decode_called: bool = False
    queued_at: float = 0.0  # when it joined a prefill instance's FIFO


class Simulator:
    """One run of one architecture. Use ``simulate(...)`` unless you need the internals."""

    def __init__(
        self,
        cost_model: CostModel,
        config: SimConfig,
        mode: str = "colocated",
        num_instances: int = 1,
        num_prefill: int = 1,
        num_decode: int = 1,
        tp: int = 1,
        step_durations: Mapping[str, Sequence[float]] | None = None,
        step_gaps: Mapping[str, Sequence[float | None]] | None = None,
        call_latencies: Mapping[str, float] | None = None,
        handoff_latencies: Mapping[str, float] | None = None,
        routes: Mapping[str, tuple[str, str]] | None = None,
        reserve_latencies: Mapping[str, float] | None = None,
        admission_steps: Mapping[tuple[str, str], tuple[str, int]] | None = None,
        tie_window_s: float = 0.0,
    ) -> None:
        Mode.parse(mode, "sim: mode")
        if min(num_instances, num_prefill, num_decode) < 1:
            raise ValueError("sim: instance counts must be >= 1")
        if config.kv_link_bw is None or config.kv_link_latency_s is None:
            raise ValueError("sim: the config must set kv_link_bw and kv_link_latency_s (see simulate)")
        self.link_bw: float = config.kv_link_bw
        self.link_latency_s: float = config.kv_link_latency_s
        self.cost_model = cost_model
        self.config = config
        self.mode = mode
        self.tp = tp
        self.now = 0.0
        self.num_blocks = config.num_kv_blocks or max(1, cost_model.kv_capacity_tokens() // config.block_size)
        self._counts = (num_instances, num_prefill, num_decode)
        self.instances: dict[str, _Instance] = {}
        self.steps: list[StepStats] = []
        self.step_chunks: list[tuple[tuple[str, int], ...]] = []
        self._step_order: list[tuple[float, int]] = []  # per kept step: (start, instance index), the result's order
        self.step_durations = step_durations
        self.step_gaps = step_gaps  # replay: the loop's recorded time after each step (None: the config's)
        self.unreplayed_steps = 0  # replay: steps beyond an instance's recorded ones (priced by the cost model)
        self.call_latencies = call_latencies or {}  # replay: request id -> its recorded call's latency
        self.handoff_latencies = handoff_latencies or {}  # replay: request id -> its recorded handoff
        self.routes = routes or {}  # replay: request id -> its recorded (decode worker, prefill worker or "")
        self.rerouted = 0  # replay: requests the policy would have routed otherwise than recorded
        self.reserve_latencies = reserve_latencies or {}  # replay: request id -> its reservation's round trip
        # replay: (request id, admission event) -> (worker, its step count then), as the run recorded them
        self.admission_steps = admission_steps or {}
        self.tie_window_s = tie_window_s
        self.alignment = AlignmentTally()
        self._admitted: set[tuple[str, str]] = set()  # admission events applied (or given up waiting for)
        self._wake: list[_Instance] = []  # idle instances that work just reached
        self.kv_bytes_moved = 0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._rng = random.Random(config.seed)
        self._slowdown: dict[int, float] = {}  # window index -> the machine's slowdown factor there
        self.num_steps = 0
        self._keep_steps = config.keep_steps
        self._coalesce = (
            config.coalesce_decode_steps
            and not (config.step_tail and config.slowdown_percentiles)
            and not config.co_run_slowdown
            and not config.step_gap_s
            and config.stop_time_s is None
            and step_durations is None
            and step_gaps is None
        )

    # ---- setup ---------------------------------------------------------------------------------
    def _build(self, budget: int, max_model_len: int) -> None:
        n, p, d = self._counts
        decodes = [f"decode-{i}" for i in range(n if self.mode == "colocated" else d)]
        prefills = [] if self.mode == "colocated" else [f"prefill-{i}" for i in range(p)]
        c = self.config
        for name in [*prefills, *decodes]:
            sched = Scheduler(
                SchedulerConfig(budget, c.max_num_seqs, max_model_len, c.enable_chunked_prefill, c.chunk_size),
                BlockManager(self.num_blocks, c.block_size, c.enable_prefix_caching),
            )
            sched.clock = self._clock
            decode_role = "auto-decode" if self.mode == "auto" else "decode"
            role = "prefill" if name in prefills else (decode_role if prefills else "colocated")
            self.instances[name] = _Instance(name, role, sched, len(self.instances))
        if self.tie_window_s > 0:
            for (request_id, event), (worker, step) in sorted(self.admission_steps.items(), key=lambda kv: kv[1][1]):
                if worker in self.instances:
                    self.instances[worker].expected.append((step, request_id, event))
        self._prefills = [inst for inst in self.instances.values() if inst.cost_role == "prefill"]
        self._ready = dict.fromkeys(self.instances.values())  # idle instances that may have work (ordered set)
        self._stalled: dict[_Instance, None] = {}  # idle instances with work that could not schedule (blocks)
        router = RouterConfig(
            default_mode=self.mode,
            block_size=c.block_size,
            auto_min_remote_tokens=c.auto_min_remote_tokens,
            auto_max_prefill_queue_tokens=c.auto_max_prefill_queue_tokens,
        )
        self.policy = RoutingPolicy(router, decodes, prefills)

    def _clock(self) -> float:
        return self.now

    def _control_latency(self) -> float:
        """One router-to-worker call: the median, or a draw from the measured distribution with the tail."""
        c = self.config
        if c.step_tail and c.control_latency_percentiles:
            return quantile_at(c.control_latency_percentiles, self._rng.random())
        return c.control_latency_s

    def _reserve_leg(self, client: _Client) -> float:
        """One leg of a reservation's round trip: the prefill instance's call, or the decode instance's answer
        (half the request's recorded round trip in a replay, where its records show it)."""
        round_trip = self.reserve_latencies.get(client.wreq.request_id, self.config.reserve_latency_s)
        return self._control_latency() if round_trip is None else round_trip / 2

    def _at(self, t: float, handler: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), handler, args))

    # ---- the run -------------------------------------------------------------------------------
    def run(self, requests: Sequence[WorkloadRequest], max_concurrency: int | None = None) -> SimResult:
        """Replay ``requests`` (sent at their arrival offsets, at most ``max_concurrency`` in flight)."""
        if not requests:
            raise ValueError("sim: the workload is empty")
        wall_start = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # millions of live objects and no garbage cycles: the collector's passes only cost time
        try:
            return self._run(requests, max_concurrency, wall_start)
        finally:
            if collecting:
                gc.enable()

    def _run(self, requests: Sequence[WorkloadRequest], max_concurrency: int | None, wall_start: float) -> SimResult:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("sim: request ids must be unique")
        self._max_model_len = max(r.num_prompt_tokens + r.max_tokens for r in requests)
        self._budget = self.config.token_budget(max(r.num_prompt_tokens for r in requests))
        self._build(self._budget, self._max_model_len)
        self._clients = {r.request_id: _Client(r) for r in requests}
        self._max_concurrency = max_concurrency
        self._in_flight = 0
        self._backlog: deque[_Client] = deque()  # sent-able, held back by the concurrency cap
        for r in sorted(requests, key=lambda r: r.arrival_offset_s):
            self._at(r.arrival_offset_s, self._on_arrival, self._clients[r.request_id])
        stop = self.config.stop_time_s
        while self._events:
            t = self._events[0][0]
            if stop is not None and t > stop:
                break
            self.now = t
            while self._events and self._events[0][0] == t:
                _, _, handler, args = heapq.heappop(self._events)
                handler(*args)
                self._start_woken()
                if not self._events or self._events[0][0] != t:  # admissions may add events at t
                    for inst in self._prefills:
                        if inst.fifo and not inst.reserving:
                            self._admit_prefills(inst)
            self._start_ready()
        if stop is not None:
            self.now = max(self.now, stop)
        result = dataclasses.replace(self._result(), wall_s=time.perf_counter() - wall_start)
        for tally in _ACTIVE_TALLIES:
            tally.add(result)
        return result

    def _start_ready(self) -> None:
        """Every idle instance with work starts a step, in the deployment's order. Only instances that
        became idle or got work since the last call, and those that could not schedule (no blocks), can."""
        ready = self._ready
        if self._stalled:
            ready.update(self._stalled)
        self._ready = {}
        for inst in sorted(ready, key=lambda i: i.index) if len(ready) > 1 else ready:
            if not inst.busy and inst.has_work():
                self._start_step(inst)
            else:
                self._stalled.pop(inst, None)

    def _woken(self, inst: _Instance) -> None:
        """Work reached ``inst``: if its loop is idle (no step, no gap), it starts a step at once."""
        self._ready[inst] = None
        if not inst.busy:
            self._wake.append(inst)

    def _start_woken(self) -> None:
        woken, self._wake = self._wake, []
        for inst in woken:
            if not inst.busy and inst.has_work():
                self._start_step(inst)

    # ---- the client and the router -------------------------------------------------------------
    def _on_arrival(self, client: _Client) -> None:
        if self._max_concurrency is not None and self._in_flight >= self._max_concurrency:
            self._backlog.append(client)
            return
        self._in_flight += 1
        client.send_time = self.now
        w = client.wreq
        if -(-(w.num_prompt_tokens + 1) // self.config.block_size) > self.num_blocks:
            self._complete(
                client,
                error=f"prompt of {w.num_prompt_tokens} tokens needs more KV blocks than an "
                f"instance has ({self.num_blocks} x {self.config.block_size})",
            )
            return
        client.prompt_hashes = compute_block_hashes(w.prompt_token_ids, self.config.block_size)
        route = self.policy.route(w.prompt_token_ids, w.max_tokens, None, client.prompt_hashes)
        recorded_route = self.routes.get(w.request_id)
        if recorded_route is not None and recorded_route != (route.decode_worker, route.prefill_worker or ""):
            route = self._recorded_route(w, client.prompt_hashes, *recorded_route)
        self.policy.start(route, w.prompt_token_ids, w.max_tokens, client.prompt_hashes)
        client.route, client.decode = route, self.instances[route.decode_worker]
        client.meta.update(
            mode=route.mode, decode_worker=route.decode_worker, prefill_worker=route.prefill_worker or ""
        )
        recorded = self.call_latencies.get(w.request_id)
        self._at(self.now + (self._control_latency() if recorded is None else recorded), self._on_dispatch, client)

    def _recorded_route(
        self, w: WorkloadRequest, hashes: Sequence[bytes], decode_worker: str, prefill_worker: str
    ) -> Route:
        """Replay: the route the run took (the real router's order of arrivals can differ from the sends')."""
        view = self.policy.decode.get(decode_worker)
        if view is None or (prefill_worker and prefill_worker not in self.policy.prefill):
            raise ValueError(f"replay: {w.request_id} was served by workers this deployment lacks")
        self.rerouted += 1
        bs = self.config.block_size
        cached = view.matched_tokens(list(hashes[: (w.num_prompt_tokens - 1) // bs]), bs)
        mode = "disaggregated" if prefill_worker else "colocated"
        return Route(mode, decode_worker, prefill_worker or None, cached)

    def _on_dispatch(self, client: _Client) -> None:
        route = client.route
        assert route is not None and client.decode is not None
        if route.prefill_worker is None:
            decode = client.decode

            def queue() -> None:
                self._touch(decode)
                client.meta["decode_queued_step"] = decode.num_steps_started
                decode.scheduler.add(self._new_request(client, client.wreq.max_tokens))
                self._woken(decode)

            self._take_in(decode, client, "decode_queued", queue)
        else:
            client.prefill = self.instances[route.prefill_worker]
            self._enqueue_prefill(client.prefill, client)

    def _deliver(self, client: _Client, finished: bool) -> None:
        """A token (or the end of the stream) reaches the client ``token_latency_s`` after now."""
        t = self.now + self.config.token_latency_s
        client.token_times.append(t)
        if finished:
            self._at(t, self._complete, client)

    def _complete(self, client: _Client, error: str | None = None) -> None:
        if client.done:
            return
        client.done, client.end_time = True, self.now
        client.decode_req = None  # the engine's copies of its tokens are no longer needed
        if client.kv_complete or client.prefill is None:
            client.prefill_req = None
        if error is not None:
            client.error = error
        if client.route is not None:
            self.policy.finish(client.route, client.wreq.prompt_token_ids, client.wreq.max_tokens)
        self._in_flight -= 1
        while self._backlog and (self._max_concurrency is None or self._in_flight < self._max_concurrency):
            self._on_arrival(self._backlog.popleft())

    def _new_request(self, client: _Client, max_tokens: int) -> Request:
        """The engine's request for ``client``, its prompt's block hashes known (as the engine would compute them)."""
        w = client.wreq
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(w.request_id, w.prompt_token_ids, params, eos_token_id=None, arrival_time=self.now)
        request.block_hashes = list(client.prompt_hashes)
        return request

    # ---- steps ---------------------------------------------------------------------------------
    def _start_step(self, inst: _Instance) -> None:
        if (inst.deferred or inst.expected) and self._aligning(inst):
            return
        if inst.cost_role == "prefill":  # the loop's tick before the step: what the admission rule reads
            inst.tick_waiting_tokens = remote_kv.waiting_prompt_tokens(inst.scheduler)
            inst.admitted_since_tick = inst.deferred_prompt_tokens()
        output = inst.scheduler.schedule()
        if not output.chunks:
            self._stalled[inst] = None  # waiting for blocks; retried after the next event
            return
        self._stalled.pop(inst, None)
        shape = StepShape.from_output(output, self.config.block_size)
        work = self._price(inst, shape)
        inst.busy, inst.output = True, output
        if self._coalesce and inst.cost_role != "prefill" and self._start_run(inst, output, shape, work):
            return
        inst.step = _Step(shape, self.now, work, self.now)
        self._retime(inst)

    def _price(self, inst: _Instance, shape: StepShape) -> float:
        """The step's priced time: the next recorded duration of ``inst`` under replay, else the cost model's."""
        k = inst.num_steps_started
        inst.num_steps_started += 1
        if self.step_durations is not None:
            recorded = self.step_durations.get(inst.name, ())
            if k < len(recorded):
                return max(float(recorded[k]), 1e-9)
            self.unreplayed_steps += 1
        return max(self.cost_model.step_time(shape, inst.cost_role), 1e-9)

    # ---- coalesced decode runs -----------------------------------------------------------------
    # A decode instance whose step is decode-only, with nothing waiting, runs the same batch step after
    # step until a request finishes or something reaches the instance. Such a run is planned ahead
    # (each step priced as the cost model prices it, the clock advanced by the same additions) and
    # applied to the scheduler's state only when something looks at the instance (``_touch``) or the
    # run ends, exactly as the steps one by one would have left it.
    def _start_run(self, inst: _Instance, output: SchedulerOutput, shape: StepShape, work: float) -> bool:
        """Begin a run at the step ``output`` (just scheduled, priced ``work``) when it can; False if not."""
        sched = inst.scheduler
        chunks = output.chunks
        if (
            sched.waiting
            or output.preempted
            or inst.waiting_for_room
            or shape.prefill_tokens
            or shape.decode_tokens != len(chunks)
            or len(chunks) != len(sched.running)
        ):
            return False
        requests = [sched.requests[c.request_id] for c in chunks]
        max_len = self._max_model_len
        last = min(min(r.params.max_tokens - r.num_output_tokens, max_len - r.num_tokens) for r in requests)
        if last < 2:
            return False
        first_starts = [c.start for c in chunks]
        last = self._steps_with_blocks(sched.block_manager, requests, first_starts, last)
        if last < 2:
            return False
        contexts = sorted(start + 1 for start in first_starts)
        groups = [
            (len(contexts[g : g + _DECODE_GROUP]), contexts[min(g + _DECODE_GROUP, len(contexts)) - 1])
            for g in range(0, len(contexts), _DECODE_GROUP)
        ]
        end = self.now + work
        price, reads_keys = decode_pricer(self.cost_model, len(chunks), inst.cost_role)
        run = _DecodeRun(
            requests=requests,
            clients=[self._clients[c.request_id] for c in chunks],
            first_starts=first_starts,
            last_step=last,
            price=price,
            reads_keys=reads_keys,
            groups=groups,
            composition=tuple((c.request_id, 1) for c in chunks),
            starts=[self.now],
            ends=[end],
            deliveries=[end + self.config.token_latency_s],
        )
        inst.run = run
        self._plan(run, min(last, _RUN_PLAN_STEPS))
        self._schedule_checkpoint(inst, run)
        return True

    def _steps_with_blocks(
        self, blocks: BlockManager, requests: list[Request], first_starts: list[int], last: int
    ) -> int:
        """The most steps (up to ``last``) of the run whose blocks the free pool holds: step ``i`` needs
        every request's blocks to cover its first start + ``i`` tokens."""
        bs, free = blocks.block_size, blocks.num_available_blocks
        held = [len(r.block_ids) for r in requests]

        def needed(steps: int) -> int:
            return sum(max(0, -(-(s + steps) // bs) - h) for s, h in zip(first_starts, held, strict=True))

        if needed(last) <= free:
            return last
        lo, hi = 1, last  # needed(lo) == 0 (step 1 is allocated), needed(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if needed(mid) <= free else (lo, mid)
        return lo

    def _plan(self, run: _DecodeRun, upto: int) -> None:
        """Price and time the run's steps up to ``upto``, as the step-by-step loop would."""
        bs, latency, price, b = self.config.block_size, self.config.token_latency_s, run.price, run.num_seqs
        base = sum(run.first_starts) + b  # the decodes' summed context in step 1
        starts, ends, deliveries = run.starts, run.ends, run.deliveries
        for i in range(len(ends) + 1, upto + 1):
            context = base + b * (i - 1)
            keys = run.decode_keys(i, bs) if run.reads_keys else 0
            start = ends[-1]
            end = start + max(price(context, context - b, keys), 1e-9)
            starts.append(start)
            ends.append(end)
            deliveries.append(end + latency)

    def _schedule_checkpoint(self, inst: _Instance, run: _DecodeRun) -> None:
        run.version = next(self._seq)
        self._at(run.ends[-1], self._on_run_checkpoint, inst, run.version)

    def _on_run_checkpoint(self, inst: _Instance, version: int) -> None:
        """The last planned step of the run ends now: plan further, or end the run with its last step."""
        run = inst.run
        if run is None or run.version != version:
            return
        planned = len(run.ends)
        if planned < run.last_step:
            self._plan(run, min(run.last_step, 2 * planned))
            self._schedule_checkpoint(inst, run)
            return
        self._materialize(inst, planned)
        assert inst.step is not None
        self._on_step_end(inst, inst.step.version)

    def _touch(self, inst: _Instance) -> None:
        """Something reaches ``inst`` now: bring a run in progress to the state of the step running now
        (the one that ends at or after now; if it ends exactly now, it ends first)."""
        run = inst.run
        if run is None:
            return
        j = bisect.bisect_left(run.ends, self.now, run.at - 1) + 1
        ends_now = run.ends[j - 1] == self.now
        self._materialize(inst, j)
        if ends_now:
            assert inst.step is not None
            self._on_step_end(inst, inst.step.version)

    def _materialize(self, inst: _Instance, j: int) -> None:
        """End the run at its step ``j``: apply the steps before it to the scheduler, the requests, the
        clients and the step records, allocate step ``j``'s blocks and make it an ordinary running step."""
        run = inst.run
        assert run is not None and run.at <= j <= len(run.ends)
        inst.run = None
        a, b = run.at, run.num_seqs
        n = j - a  # steps a .. j-1 complete now
        blocks, bs = inst.scheduler.block_manager, self.config.block_size
        if n:
            zeros = [DUMMY_TOKEN] * n
            ends, deliveries = run.ends[a - 1 : j - 1], run.deliveries[a - 1 : j - 1]
            for request, client in zip(run.requests, run.clients, strict=True):
                request.all_token_ids.extend(zeros)
                request.times.tokens.extend(ends)
                client.token_times.extend(deliveries)
            self._apply_block_steps(run, blocks, a, j)
            self.num_steps += n
            if self._keep_steps:
                for i in range(a, j):
                    context = run.context_tokens(i)
                    started = run.starts[i - 1]
                    self.steps.append(
                        StepStats(
                            started,
                            run.ends[i - 1] - started,
                            0.0,
                            0,
                            b,
                            b,
                            0,
                            context,
                            context,
                            context - b,
                            inst.name,
                        )
                    )
                    self.step_chunks.append(run.composition)
                    self._step_order.append((started, inst.index))
            inst.num_steps_started += n
        for request, first in zip(run.requests, run.first_starts, strict=True):
            request.num_computed_tokens = first + j - 1
        chunks = []
        for request, first in zip(run.requests, run.first_starts, strict=True):
            start = first + j - 1
            chunks.append(
                ScheduledChunk(
                    request.request_id, request.all_token_ids[start : start + 1], start, list(request.block_ids), True
                )
            )
        output = SchedulerOutput(chunks, [])
        context = run.context_tokens(j)
        shape = StepShape(0, b, context, context - b, b, b, context, run.decode_keys(j, bs))
        started, ended = run.starts[j - 1], run.ends[j - 1]
        inst.output = output
        inst.step = _Step(shape, started, ended - started, started, 1.0, next(self._seq))
        self._at(ended, self._on_step_end, inst, inst.step.version)

    @staticmethod
    def _apply_block_steps(run: _DecodeRun, blocks: BlockManager, a: int, j: int) -> None:
        """What steps ``a .. j-1`` did to the blocks, in the engine's order: after each step, every
        request whose computed tokens fill a block registers it (prefix caching); then the next step
        allocates a block to every request whose next token needs one. Only those requests are visited
        (and, with prefix caching, any whose registration is behind: retried after every step)."""
        bs, caching = blocks.block_size, blocks.enable_prefix_caching
        events: list[tuple[int, int, int]] = []  # (step i, 0: register after it / 1: allocate for step i+1, request)
        behind: set[int] = set()
        for q, (request, first) in enumerate(zip(run.requests, run.first_starts, strict=True)):
            if caching:
                if request.num_registered_blocks < _num_full(request, bs, first + a - 1):
                    behind.add(q)
                    events.extend((i, 0, q) for i in range(a, j))
                else:
                    events.extend((i, 0, q) for i in range(a + (-(first + a)) % bs, j, bs))
            covered = len(request.block_ids) * bs  # slots held; step i + 1 needs first + i + 1 of them
            events.extend((i, 1, q) for i in range(max(a, covered - first), j, bs))
        heapq.heapify(events)
        while events:
            i, phase, q = heapq.heappop(events)
            request = run.requests[q]
            request.num_computed_tokens = run.first_starts[q] + i
            if phase == 1:
                ok = blocks.allocate_slots(request, 1)
                assert ok, "the run was planned within the free blocks"
                continue
            blocks.cache_full_blocks(request)
            if q not in behind and request.num_registered_blocks < _num_full(request, bs, request.num_computed_tokens):
                behind.add(q)
                for later in range(i + 1, j):
                    if (run.first_starts[q] + later) % bs:  # the block-filling steps are queued already
                        heapq.heappush(events, (later, 0, q))

    def _co_run_multiplier(self, inst: _Instance) -> float:
        """``1 + co_run_slowdown`` x the fraction of the other instances running a step now."""
        others = len(self.instances) - 1
        k = self.config.co_run_slowdown
        if not k or not others:
            return 1.0
        busy = sum(1 for other in self.instances.values() if other is not inst and other.output is not None)
        return 1.0 + k * busy / others

    def _retime(self, changed: _Instance) -> None:
        """``changed`` started or ended a step: (re)schedule the end of every running step whose pace
        that changes (``changed``'s own new step, and with a co-run slowdown every other running step)."""
        targets = [changed] if changed.step is not None else []
        if self.config.co_run_slowdown:
            targets += [i for i in self.instances.values() if i is not changed and i.step is not None]
        for inst in targets:
            step = inst.step
            assert step is not None
            if step.since < self.now:  # the work done at the old pace since the last re-timing
                step.work_s = max(step.work_s - self._work_between(step.since, self.now) / step.multiplier, 0.0)
                step.since = self.now
            step.multiplier = self._co_run_multiplier(inst)
            step.version = next(self._seq)  # unique: an event of an earlier step never matches
            self._at(
                self.now + self._stretch(self.now, step.work_s * step.multiplier), self._on_step_end, inst, step.version
            )

    def _on_step_end(self, inst: _Instance, version: int) -> None:
        step = inst.step
        if step is None or step.version != version:
            return  # re-timed since: a later event ends it
        inst.step = None
        assert inst.output is not None
        self.num_steps += 1
        if self._keep_steps:
            stats = step.shape.to_stats(inst.name, step.started, self.now - step.started, self._preempted(inst))
            self.steps.append(stats)
            self.step_chunks.append(tuple((c.request_id, len(c.token_ids)) for c in inst.output.chunks))
            self._step_order.append((step.started, inst.index))
        self._on_step_done(inst)
        if self.config.co_run_slowdown:
            self._retime(inst)

    @staticmethod
    def _preempted(inst: _Instance) -> int:
        return len(inst.output.preempted) if inst.output is not None else 0

    def _work_between(self, start: float, end: float) -> float:
        """Priced step time the slowed-down machine does between ``start`` and ``end`` (the inverse of
        ``_stretch``)."""
        c = self.config
        if not (c.step_tail and c.slowdown_percentiles):
            return end - start
        work, t = 0.0, start
        while t < end:
            k = int(t // c.slowdown_window_s)
            stop = min(end, (k + 1) * c.slowdown_window_s)
            work += (stop - t) / self._slowdown_factor(k)
            t = stop if stop > t else math.nextafter(t, math.inf)
        return work

    def _slowdown_factor(self, k: int) -> float:
        """The machine's slowdown in window ``k`` (drawn once, shared by all instances)."""
        if k not in self._slowdown:
            self._slowdown[k] = quantile_at(self.config.slowdown_percentiles, self._rng.random(), 1.0)
        return max(self._slowdown[k], 1e-6)

    def _stretch(self, start: float, work: float) -> float:
        """Wall time of ``work`` seconds of priced step time begun at ``start`` on the slowed-down machine."""
        c = self.config
        if not (c.step_tail and c.slowdown_percentiles):
            return work
        t, k = start, int(start // c.slowdown_window_s)
        while True:
            factor, end = self._slowdown_factor(k), (k + 1) * c.slowdown_window_s
            room = max(end - t, 0.0) / factor  # priced work that fits in the rest of this window
            if work <= room:
                return t + work * factor - start
            work, t, k = work - room, end, k + 1

    def _on_step_done(self, inst: _Instance) -> None:
        output = inst.output
        assert output is not None
        inst.busy, inst.output = False, None
        sched = inst.scheduler
        sched.update_after_step(output)
        self._after_step_chunks(inst, output)
        commands, inst.commands = inst.commands, []
        for handler, args in commands:  # calls that arrived during the step, applied before the next one
            handler(*args)
        waiting, inst.waiting_for_room = inst.waiting_for_room, set()
        for prefill in waiting:  # requests finished in this step may have freed blocks: try again
            prefill.reserving = False
        gap = self._gap_after(inst)
        if gap > 0:  # the engine loop's own time before its next step
            inst.busy = True
            self._at(self.now + gap, self._on_gap_done, inst)
        else:
            self._ready[inst] = None

    def _gap_after(self, inst: _Instance) -> float:
        """The engine loop's time after the step just ended: recorded under replay, else ``step_gap_s``."""
        if self.step_gaps is not None:
            recorded = self.step_gaps.get(inst.name, ())
            k = inst.num_steps_started - 1
            if k < len(recorded) and recorded[k] is not None:
                return float(recorded[k])  # type: ignore[arg-type]
        return self.config.step_gap_s

    def _on_gap_done(self, inst: _Instance) -> None:
        inst.busy = False
        self._ready[inst] = None

    def _after_step_chunks(self, inst: _Instance, output: SchedulerOutput) -> None:
        sched = inst.scheduler
        for chunk in output.chunks:
            request = sched.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            client = self._clients[chunk.request_id]
            if inst.cost_role == "prefill":
                self._after_prefill_chunk(inst, client, chunk.start + len(chunk.token_ids))
            if not chunk.samples:
                continue
            reason = remote_kv.append_token(request, DUMMY_TOKEN, self.now, self._max_model_len)
            if reason is not None:
                sched.finish(request, reason, free_blocks=inst.cost_role != "prefill")  # held until the KV is out
                client.meta["num_preemptions"] = request.num_preemptions
            if inst.cost_role == "prefill":
                self._first_token_remote(client)
            else:
                self._deliver(client, finished=reason is not None)

    # ---- disaggregation ------------------------------------------------------------------------
    def _admit_prefills(self, inst: _Instance) -> None:
        """The prefill worker's FIFO: while ``prefill_admission_open``, reserve blocks for the head on its
        decode instance (a call applied there between steps, and its reply), then add it to the engine.
        One reservation at a time, in order; a head that found no room waits for that decode instance's
        next step (which may free blocks)."""
        if inst.reserving or not inst.fifo or not self._prefill_admission_open(inst):
            return
        client = inst.fifo[0]
        assert client.decode is not None
        inst.reserving = True
        self._at(self.now + self._reserve_leg(client), self._call, client.decode, self._reserve, inst, client)

    @staticmethod
    def _prefill_admission_open(inst: _Instance) -> bool:
        """``remote_kv.admission_open`` as the prefill worker applies it: on an idle loop on the waiting
        prompt tokens now; while a step runs, and while the loop does its own work after one (its pushes:
        the gap before its next tick), on those of the loop's last tick (just before the step, so the
        prompts the step computed still count) plus the prompts admitted since."""
        if inst.output is None and not inst.busy:
            waiting_now = remote_kv.waiting_prompt_tokens(inst.scheduler) + inst.deferred_prompt_tokens()
            return remote_kv.admission_open(waiting_now, inst.scheduler.config.max_num_batched_tokens)
        waiting = inst.tick_waiting_tokens + inst.admitted_since_tick
        return remote_kv.admission_open(waiting, inst.scheduler.config.max_num_batched_tokens)

    def _call(self, target: _Instance, handler: Callable[..., None], *args: Any) -> None:
        """A call reaching ``target``'s engine loop: applied now unless a step runs, else after that step."""
        self._touch(target)
        if target.output is not None:
            target.commands.append((handler, args))
        else:
            handler(*args)

    def _reserve(self, prefill: _Instance, client: _Client) -> None:
        """On the decode instance: ``reserve_remote_blocks``; the answer travels back to the prefill instance."""
        assert client.decode is not None
        self._take_in(client.decode, client, "decode_reserved", lambda: self._apply_reserve(prefill, client))

    def _apply_reserve(self, prefill: _Instance, client: _Client) -> None:
        assert client.decode is not None
        client.meta["decode_reserved_step"] = client.decode.num_steps_started
        reservation = self._new_request(client, client.wreq.max_tokens)
        cached = remote_kv.reserve_remote_blocks(client.decode.scheduler, reservation, self.now)
        if cached is None:
            client.decode.waiting_for_room.add(prefill)
            return
        self._at(self.now + self._reserve_leg(client), self._on_reserved, prefill, client, reservation, cached)

    def _on_reserved(self, inst: _Instance, client: _Client, reservation: Request, cached: int) -> None:
        inst.reserving = False
        inst.fifo.popleft()
        client.decode_req, client.sent_upto = reservation, cached
        client.meta.update(decode_cached_tokens=cached, kv_bytes=0, reserved_at=self.now)
        client.prefill_req = self._new_request(client, 1)
        inst.admitted_since_tick += client.wreq.num_prompt_tokens
        prefill_req = client.prefill_req

        def queue() -> None:
            client.meta["prefill_queued_step"] = inst.num_steps_started
            inst.scheduler.add(prefill_req)
            self._woken(inst)

        self._take_in(inst, client, "prefill_queued", queue, client.wreq.num_prompt_tokens)

    def _after_prefill_chunk(self, inst: _Instance, client: _Client, computed: int) -> None:
        """Queue the chunk's new KV on the prefill instance's link; the last push marks the prompt done."""
        nbytes = max(0, computed - client.sent_upto) * self.cost_model.kv_bytes_per_token
        is_last = computed == client.wreq.num_prompt_tokens
        if not nbytes and not is_last:
            return
        start = max(self.now, inst.link_free_at)
        inst.link_free_at = start + nbytes / self.link_bw
        self.kv_bytes_moved += nbytes
        client.meta["kv_bytes"] += nbytes
        client.sent_upto = max(client.sent_upto, computed)
        if is_last:
            self._at(inst.link_free_at + self.link_latency_s, self._on_kv_complete, client)

    def _first_token_remote(self, client: _Client) -> None:
        """The prefill instance sampled the first token: to the client, and the router calls the decode side."""
        self._deliver(client, finished=False)
        client.meta["prefill_done"] = self.now
        assert client.route is not None
        self.policy.prefill_done(client.route, client.wreq.prompt_token_ids)
        handoff = self.handoff_latencies.get(client.wreq.request_id, self.config.handoff_latency_s)
        called = client.token_times[0] + self._control_latency() if handoff is None else self.now + handoff
        self._at(called, self._on_decode_call, client)

    def _on_kv_complete(self, client: _Client) -> None:
        assert client.prefill is not None and client.prefill_req is not None
        client.prefill.scheduler.block_manager.free(client.prefill_req)  # every push is out: release
        client.kv_complete = True
        if client.done:
            client.prefill_req = None
        client.meta["kv_done"] = self.now
        self._admit_remote(client)

    def _on_decode_call(self, client: _Client) -> None:
        client.decode_called = True
        self._admit_remote(client)

    def _admit_remote(self, client: _Client) -> None:
        if not (client.kv_complete and client.decode_called) or client.done:
            return
        assert client.decode is not None and client.decode_req is not None
        decode, decode_req = client.decode, client.decode_req

        def queue() -> None:
            if client.done:
                return
            self._touch(decode)
            client.meta["decode_queued_step"] = decode.num_steps_started
            reason = remote_kv.admit_remote(decode.scheduler, decode_req, DUMMY_TOKEN, self.now, self._max_model_len)
            self._woken(decode)
            if reason is not None:  # the first token already ended it: only the end of the stream is left
                self._at(self.now + self.config.token_latency_s, self._complete, client)

        self._take_in(decode, client, "decode_queued", queue)

    # ---- replay: admission events at the recorded steps ------------------------------------------
    def _enqueue_prefill(self, inst: _Instance, client: _Client) -> None:
        """Append ``client`` to the prefill instance's FIFO. Under replay, calls that reached it within the tie
        window of each other keep the order in which the run's workers took them in (their recorded step
        counts: the prefill worker's queue, then the decode worker's reservation), not the replayed timeline's."""
        client.queued_at = self.now
        fifo = inst.fifo
        fifo.append(client)
        rank = self._recorded_order(client)
        if rank is None or self.tie_window_s <= 0:
            return
        i, first_movable = len(fifo) - 1, 1 if inst.reserving else 0  # the head being reserved stays
        while i > first_movable:
            before = fifo[i - 1]
            before_rank = self._recorded_order(before)
            if before_rank is None or before_rank <= rank or self.now - before.queued_at > self.tie_window_s:
                break
            fifo[i - 1], fifo[i] = client, before
            i -= 1

    def _recorded_order(self, client: _Client) -> tuple[int, int] | None:
        request_id = client.wreq.request_id
        queued = self.admission_steps.get((request_id, "prefill_queued"))
        reserved = self.admission_steps.get((request_id, "decode_reserved"))
        return None if queued is None or reserved is None else (queued[1], reserved[1])

    def _take_in(
        self, inst: _Instance, client: _Client, event: str, action: Callable[[], None], prompt_tokens: int = 0
    ) -> None:
        """Apply ``action``, the request's admission ``event`` on ``inst``: now, unless the run recorded a later
        step count for it and ``inst`` has a step to run first (then the step count's boundary applies it)."""
        request_id = client.wreq.request_id
        recorded = self.admission_steps.get((request_id, event))
        if recorded is None or recorded[0] != inst.name:
            action()
            return
        step, now_step = recorded[1], inst.num_steps_started
        busy = inst.busy or inst.scheduler.waiting or inst.scheduler.running
        if step > now_step and busy and self.tie_window_s > 0:
            inst.deferred.append(_Deferred(step, self.now, request_id, event, action, prompt_tokens))
            return
        if (request_id, event) not in self._admitted:
            self._admitted.add((request_id, event))
            if step == now_step and inst.hold_since is not None:  # the step it belongs to waits for it
                self.alignment.moved.append(self.now - inst.hold_since)
            elif step == now_step:
                self.alignment.on_time += 1
            else:
                self.alignment.off += 1
        action()

    def _aligning(self, inst: _Instance) -> bool:
        """Before ``inst``'s next step: apply the held-back events that belong to it (or that came more than the
        tie window before it), and wait up to the window for events the run recorded for it that have not come.
        True while the step waits."""
        step, window = inst.num_steps_started, self.tie_window_s
        due = [d for d in inst.deferred if d.step <= step or self.now - d.since > window]
        if due:
            inst.deferred = [d for d in inst.deferred if not (d.step <= step or self.now - d.since > window)]
            for d in due:
                self._admitted.add((d.request_id, d.event))
                if d.step <= step:
                    self.alignment.moved.append(d.moved)
                else:
                    self.alignment.off += 1
                d.action()
        expected = inst.expected
        while expected and (expected[0][1], expected[0][2]) in self._admitted:
            expected.popleft()
        due_here = itertools.takewhile(lambda e: e[0] <= step, expected)
        missing = [e for e in due_here if (e[1], e[2]) not in self._admitted]
        if missing:
            if inst.hold_since is None:
                inst.hold_since = self.now
                self._at(self.now + window, self._on_hold_over, inst, step)
            return True
        inst.hold_since = None
        if not (inst.scheduler.waiting or inst.scheduler.running) and inst.deferred:
            for d in inst.deferred:  # nothing else to step on: the recorded step cannot come first
                self._admitted.add((d.request_id, d.event))
                self.alignment.off += 1
                d.action()
            inst.deferred = []
        for d in inst.deferred:
            d.moved = self.now - d.since
        return False

    def _on_hold_over(self, inst: _Instance, step: int) -> None:
        """The tie window passed with the step still waiting: it starts without the events that did not come."""
        if inst.hold_since is None or inst.num_steps_started != step:
            return
        for recorded_step, request_id, event in inst.expected:
            if recorded_step > step:
                break
            if (request_id, event) not in self._admitted:
                self._admitted.add((request_id, event))
                self.alignment.off += 1
        inst.hold_since = None
        self._ready[inst] = None

    # ---- results -------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        records = [self._record(client) for client in self._clients.values()]
        n, p, d = self._counts
        config = {
            "mode": self.mode,
            "cost_model": self.cost_model.name,
            "num_kv_blocks": self.num_blocks,
            "max_num_batched_tokens": self._budget,
            "tp": self.tp,
            "sim": self.config.to_dict(),
        }
        if self.mode == "colocated":
            config["num_instances"] = n
        else:
            config.update(num_prefill=p, num_decode=d)
        order = sorted(range(len(self.steps)), key=self._step_order.__getitem__)
        if self.step_durations is not None:
            config["unreplayed_steps"] = self.unreplayed_steps
        return SimResult(
            self.mode,
            tuple(records),
            tuple(self.steps[i] for i in order),
            tuple(self.instances),
            self.kv_bytes_moved,
            len(self.instances) * self.tp,
            config,
            tuple(self.step_chunks[i] for i in order),
            self.num_steps,
        )

    def _record(self, client: _Client) -> RequestRecord:
        w = client.wreq
        error = client.error
        if not client.done:
            stopped = self.config.stop_time_s is not None
            error = error or ("unfinished at stop time" if stopped else "stalled: no instance could make progress")
        return RequestRecord(
            request_id=w.request_id,
            send_time=client.send_time if not math.isnan(client.send_time) else self.now,
            token_times=tuple(t for t in client.token_times if client.done or t <= self.now),
            num_prompt_tokens=w.num_prompt_tokens,
            ok=error is None,
            error=error,
            end_time=client.end_time,
            label=w.label,
            meta=dict(client.meta),
        )


def _num_full(request: Request, block_size: int, computed: int) -> int:
    """The request's full blocks when ``computed`` of its tokens are computed (``cache_full_blocks``)."""
    return min(computed // block_size, len(request.block_ids))


def simulate(
    requests: Sequence[WorkloadRequest],
    cost_model: CostModel,
    config: SimConfig | None = None,
    *,
    mode: str = "colocated",
    num_instances: int = 1,
    num_prefill: int = 1,
    num_decode: int = 1,
    tp: int = 1,
    max_concurrency: int | None = None,
    kv_link_bw: float = 25e9,
    kv_link_latency_s: float = 20e-6,
) -> SimResult:
    """Replay ``requests`` on ``cost_model``: the simulator's main entry point.

    ``tp`` only labels the result (GPUs per instance, for per-GPU figures); the cost model already
    prices tensor parallelism. ``kv_link_bw``/``kv_link_latency_s`` apply unless ``config`` sets them.
    """
    config = config or SimConfig()
    if config.kv_link_bw is None or config.kv_link_latency_s is None:
        config = dataclasses.replace(
            config,
            kv_link_bw=config.kv_link_bw or kv_link_bw,
            kv_link_latency_s=kv_link_latency_s if config.kv_link_latency_s is None else config.kv_link_latency_s,
        )
    sim = Simulator(cost_model, config, mode, num_instances, num_prefill, num_decode, tp)
    return sim.run(requests, max_concurrency)
