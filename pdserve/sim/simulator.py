# Over 500 lines: one discrete-event loop whose handlers (arrival, step, its timing, its results) share its state.
"""Discrete-event replay of a workload through the engine's real scheduler, protocol and routing policy.

Nothing of the serving logic is re-typed here. Every instance (``sim.instance``) owns an
``engine.scheduler.Scheduler`` over an ``engine.block_manager.BlockManager`` whose ``clock`` is the virtual
clock; a step is what ``Scheduler.schedule()`` returns, priced by a cost model (``sim.cost_model``) instead
of run. Requests are routed by the router's own ``router.policy.RoutingPolicy`` (``route``, then the
bookkeeping calls ``start``, ``prefill_done`` and ``finish`` at the moments the router makes them), so
``auto`` is the router's rule. Every sampled token goes through the stop rule (``append_token``).

This module is the event loop: arrivals, the steps of every instance, the clock. Its parts:
``sim.instance`` (an instance's state, the coalesced decode runs), ``sim.disaggregation`` (the prefill
FIFO, the reservation, the KV link and the handoff, as ``engine.remote_kv`` runs them) and
``sim.alignment`` (trace replay's admission events at their recorded steps).

Modes (the deployment's default mode; ``auto`` decides per request):

- **colocated**: ``num_instances`` decode instances, chunked prefill + decode in one batch;
- **disaggregated** / **auto**: ``num_prefill`` prefill + ``num_decode`` decode instances
  (``sim.disaggregation``).

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
on its own view, would have chosen others, counted in ``rerouted``); ``admission_steps`` and
``tie_window_s``, the alignment of ``sim.alignment``.

Speed: a decode instance whose step is decode-only with nothing waiting runs the same batch step
after step until a request finishes or something reaches it (``Scheduler.decode_run_length``). Such a run
of steps (``instance.DecodeRun``) is planned ahead, each step priced by the cost model and the clock advanced
by the same additions as one event per step would, and applied to the scheduler
(``Scheduler.advance_decode_run``), the requests and the step records only when something reaches the
instance or the run ends, in the order the steps one by one would have; the results are the same bit for
bit (``coalesce_decode_steps=False`` runs step by step).

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
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.messages import Mode, StepStats
from pdserve.router.config import RouterConfig
from pdserve.router.policy import Route, RoutingPolicy
from pdserve.sim.alignment import ADMISSION_EVENTS, AlignmentTally, ReplayAlignment
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel, StepShape
from pdserve.sim.disaggregation import DUMMY_TOKEN, DisaggregationProtocol
from pdserve.sim.instance import Client, DecodeRun, Instance, Step
from pdserve.sim.profiles import quantile_at
from pdserve.workload.generator import WorkloadRequest
from pdserve.workload.metrics import BenchmarkMetrics, RequestRecord, compute_metrics

__all__ = [
    "ADMISSION_EVENTS",
    "AlignmentTally",
    "SimConfig",
    "SimResult",
    "Simulator",
    "SpeedTally",
    "count_speed",
    "simulate",
    "speed_tally",
]


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
        self.count(1, result.num_steps, result.wall_s)

    def count(self, runs: int, steps: int, wall_s: float) -> None:
        """Add runs made elsewhere (another process)."""
        self.num_runs += runs
        self.num_steps += steps
        self.wall_s += wall_s

    def to_dict(self) -> dict[str, float]:
        return {
            "runs": self.num_runs,
            "steps": self.num_steps,
            "wall_s": self.wall_s,
            "steps_per_s": self.steps_per_s,
        }


_ACTIVE_TALLIES: list[SpeedTally] = []


def count_speed(runs: int, steps: int, wall_s: float) -> None:
    """Add runs made in another process to every active ``speed_tally``."""
    for tally in _ACTIVE_TALLIES:
        tally.count(runs, steps, wall_s)


@contextmanager
def speed_tally() -> Iterator[SpeedTally]:
    """Count the steps and wall time of every simulator run inside the ``with`` block (nested blocks each count)."""
    tally = SpeedTally()
    _ACTIVE_TALLIES.append(tally)
    try:
        yield tally
    finally:
        del _ACTIVE_TALLIES[next(i for i, t in enumerate(_ACTIVE_TALLIES) if t is tally)]  # by identity


class Simulator(DisaggregationProtocol, ReplayAlignment):
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
        prefill_cost_model: CostModel | None = None,
        prefill_gpus: int | None = None,
        prefill_pp: int = 1,
        prefill_config: SimConfig | None = None,
    ) -> None:
        Mode.parse(mode, "sim: mode")
        if min(num_instances, num_prefill, num_decode, prefill_pp) < 1:
            raise ValueError("sim: instance counts and prefill_pp must be >= 1")
        if config.kv_link_bw is None or config.kv_link_latency_s is None:
            raise ValueError("sim: the config must set kv_link_bw and kv_link_latency_s (see simulate)")
        self.link_bw: float = config.kv_link_bw
        self.link_latency_s: float = config.kv_link_latency_s
        self.cost_model = cost_model
        self.prefill_cost_model = prefill_cost_model or cost_model
        self.config = config
        self.mode = mode
        self.tp = tp
        self.prefill_gpus = tp if prefill_gpus is None else prefill_gpus  # GPUs of one prefill instance (tp x pp)
        self.prefill_pp = prefill_pp  # a pipelined prefill instance runs as this many engines
        # the prefill instances' engine settings (token budget, chunking, policy) where they differ from the others'
        self.prefill_config = prefill_config or config
        self.now = 0.0
        self.num_blocks = self._pool_blocks(cost_model, 1)
        self.prefill_blocks = self._pool_blocks(self.prefill_cost_model, prefill_pp)
        self._counts = (num_instances, num_prefill, num_decode)
        self.instances: dict[str, Instance] = {}
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
        self._init_alignment(admission_steps, tie_window_s)
        self._wake: list[Instance] = []  # idle instances that work just reached
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
    def _pool_blocks(self, cost_model: CostModel, engines: int) -> int:
        """KV blocks of one engine: the config's, else the instance's capacity shared by its ``engines``."""
        c = self.config
        return c.num_kv_blocks or max(1, cost_model.kv_capacity_tokens() // engines // c.block_size)

    def _build(self, budget: int, prefill_budget: int, max_model_len: int) -> None:
        n, p, d = self._counts
        decodes = [f"decode-{i}" for i in range(n if self.mode == "colocated" else d)]
        prefills = []
        if self.mode != "colocated":
            pp = self.prefill_pp
            prefills = [f"prefill-{i}" if pp == 1 else f"prefill-{i}.{k}" for i in range(p) for k in range(pp)]
        for name in [*prefills, *decodes]:
            is_prefill = name in prefills
            c = self.prefill_config if is_prefill else self.config
            blocks = self.prefill_blocks if is_prefill else self.num_blocks
            sched = Scheduler(
                SchedulerConfig(
                    prefill_budget if is_prefill else budget,
                    c.max_num_seqs,
                    max_model_len,
                    c.enable_chunked_prefill,
                    c.chunk_size,
                    c.scheduling,
                ),
                BlockManager(blocks, c.block_size, c.enable_prefix_caching),
            )
            sched.clock = self._clock
            decode_role = "auto-decode" if self.mode == "auto" else "decode"
            role = "prefill" if is_prefill else (decode_role if prefills else "colocated")
            cost = self.prefill_cost_model if is_prefill else self.cost_model
            self.instances[name] = Instance(name, role, sched, cost, len(self.instances))
        self._expect_admissions(self.instances)
        self._prefills = [inst for inst in self.instances.values() if inst.cost_role == "prefill"]
        self._ready = dict.fromkeys(self.instances.values())  # idle instances that may have work (ordered set)
        self._stalled: dict[Instance, None] = {}  # idle instances with work that could not schedule (blocks)
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

    def _reserve_leg(self, client: Client) -> float:
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
        longest = max(r.num_prompt_tokens for r in requests)
        self._budget = self.config.token_budget(longest)
        self._build(self._budget, self.prefill_config.token_budget(longest), self._max_model_len)
        self._clients = {r.request_id: Client(r) for r in requests}
        self._max_concurrency = max_concurrency
        self._in_flight = 0
        self._backlog: deque[Client] = deque()  # sent-able, held back by the concurrency cap
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

    def _woken(self, inst: Instance) -> None:
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
    def _on_arrival(self, client: Client) -> None:
        if self._max_concurrency is not None and self._in_flight >= self._max_concurrency:
            self._backlog.append(client)
            return
        self._in_flight += 1
        client.send_time = self.now
        w = client.wreq
        fewest = min(self.num_blocks, self.prefill_blocks) if self.mode != "colocated" else self.num_blocks
        if -(-(w.num_prompt_tokens + 1) // self.config.block_size) > fewest:
            self._complete(
                client,
                error=f"prompt of {w.num_prompt_tokens} tokens needs more KV blocks than an "
                f"instance has ({fewest} x {self.config.block_size})",
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

    def _on_dispatch(self, client: Client) -> None:
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

    def _deliver(self, client: Client, finished: bool) -> None:
        """A token (or the end of the stream) reaches the client ``token_latency_s`` after now."""
        t = self.now + self.config.token_latency_s
        client.token_times.append(t)
        if finished:
            self._at(t, self._complete, client)

    def _complete(self, client: Client, error: str | None = None) -> None:
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

    def _new_request(self, client: Client, max_tokens: int) -> Request:
        """The engine's request for ``client``, its prompt's block hashes known (as the engine would compute them)."""
        w = client.wreq
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(w.request_id, w.prompt_token_ids, params, eos_token_id=None, arrival_time=self.now)
        request.block_hashes = list(client.prompt_hashes)
        return request

    # ---- steps ---------------------------------------------------------------------------------
    def _start_step(self, inst: Instance) -> None:
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
        inst.step = Step(shape, self.now, work, self.now)
        self._retime(inst)

    def _price(self, inst: Instance, shape: StepShape) -> float:
        """The step's priced time: the next recorded duration of ``inst`` under replay, else the cost model's."""
        k = inst.num_steps_started
        inst.num_steps_started += 1
        if self.step_durations is not None:
            recorded = self.step_durations.get(inst.name, ())
            if k < len(recorded):
                return max(float(recorded[k]), 1e-9)
            self.unreplayed_steps += 1
        return max(inst.cost_model.step_time(shape, inst.cost_role), 1e-9)

    # ---- coalesced decode runs -----------------------------------------------------------------
    # A decode instance whose step is decode-only, with nothing waiting, runs the same batch step after
    # step until a request finishes or something reaches the instance. Such a run is planned ahead
    # (each step priced as the cost model prices it, the clock advanced by the same additions) and
    # applied to the scheduler's state only when something looks at the instance (``_touch``) or the
    # run ends, exactly as the steps one by one would have left it.
    def _start_run(self, inst: Instance, output: SchedulerOutput, shape: StepShape, work: float) -> bool:
        """Begin a run at the step ``output`` (just scheduled, priced ``work``) when it can; False if not."""
        run = inst.begin_decode_run(output, shape, self.now, work, self._clients, self.config.token_latency_s)
        if run is None:
            return False
        inst.run = run
        self._schedule_checkpoint(inst, run)
        return True

    def _schedule_checkpoint(self, inst: Instance, run: DecodeRun) -> None:
        run.version = next(self._seq)
        self._at(run.ends[-1], self._on_run_checkpoint, inst, run.version)

    def _on_run_checkpoint(self, inst: Instance, version: int) -> None:
        """The last planned step of the run ends now: plan further, or end the run with its last step."""
        run = inst.run
        if run is None or run.version != version:
            return
        planned = len(run.ends)
        if planned < run.last_step:
            run.plan(min(run.last_step, 2 * planned), self.config.block_size, self.config.token_latency_s)
            self._schedule_checkpoint(inst, run)
            return
        self._materialize(inst, planned)
        assert inst.step is not None
        self._on_step_end(inst, inst.step.version)

    def _touch(self, inst: Instance) -> None:
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

    def _materialize(self, inst: Instance, j: int) -> None:
        """End the run at its step ``j``: apply the steps before it to the scheduler, the requests, the
        clients and the step records, allocate step ``j``'s blocks and make it an ordinary running step."""
        run = inst.run
        assert run is not None and run.at <= j <= len(run.ends)
        inst.run = None
        a, b = run.at, run.num_seqs
        n = j - a  # steps a .. j-1 complete now
        if n:
            ends, deliveries = run.ends[a - 1 : j - 1], run.deliveries[a - 1 : j - 1]
            for request, client in zip(run.requests, run.clients, strict=True):
                request.times.tokens.extend(ends)
                client.token_times.extend(deliveries)
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
        output = inst.scheduler.advance_decode_run(run.requests, run.first_starts, a, j, DUMMY_TOKEN)
        started, ended = run.starts[j - 1], run.ends[j - 1]
        inst.output = output
        inst.step = Step(run.shape(j, self.config.block_size), started, ended - started, started, 1.0, next(self._seq))
        self._at(ended, self._on_step_end, inst, inst.step.version)

    def _co_run_multiplier(self, inst: Instance) -> float:
        """``1 + co_run_slowdown`` x the fraction of the other instances running a step now."""
        others = len(self.instances) - 1
        k = self.config.co_run_slowdown
        if not k or not others:
            return 1.0
        busy = sum(1 for other in self.instances.values() if other is not inst and other.output is not None)
        return 1.0 + k * busy / others

    def _retime(self, changed: Instance) -> None:
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

    def _on_step_end(self, inst: Instance, version: int) -> None:
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
    def _preempted(inst: Instance) -> int:
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

    def _on_step_done(self, inst: Instance) -> None:
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

    def _gap_after(self, inst: Instance) -> float:
        """The engine loop's time after the step just ended: recorded under replay, else ``step_gap_s``."""
        if self.step_gaps is not None:
            recorded = self.step_gaps.get(inst.name, ())
            k = inst.num_steps_started - 1
            if k < len(recorded) and recorded[k] is not None:
                return float(recorded[k])  # type: ignore[arg-type]
        return self.config.step_gap_s

    def _on_gap_done(self, inst: Instance) -> None:
        inst.busy = False
        self._ready[inst] = None

    def _after_step_chunks(self, inst: Instance, output: SchedulerOutput) -> None:
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
            gpus = n * self.tp
        else:
            config.update(num_prefill=p, num_decode=d)
            if self.prefill_config is not self.config:
                config["prefill_sim"] = self.prefill_config.to_dict()
            if self.prefill_cost_model is not self.cost_model or self.prefill_gpus != self.tp or self.prefill_pp > 1:
                config.update(
                    prefill_cost_model=self.prefill_cost_model.name,
                    prefill_gpus=self.prefill_gpus,
                    prefill_pp=self.prefill_pp,
                    prefill_num_kv_blocks=self.prefill_blocks,
                )
            gpus = p * self.prefill_gpus + d * self.tp
        order = sorted(range(len(self.steps)), key=self._step_order.__getitem__)
        if self.step_durations is not None:
            config["unreplayed_steps"] = self.unreplayed_steps
        return SimResult(
            self.mode,
            tuple(records),
            tuple(self.steps[i] for i in order),
            tuple(self.instances),
            self.kv_bytes_moved,
            gpus,
            config,
            tuple(self.step_chunks[i] for i in order),
            self.num_steps,
        )

    def _record(self, client: Client) -> RequestRecord:
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
    prefill_cost_model: CostModel | None = None,
    prefill_tp: int | None = None,
    prefill_pp: int = 1,
    prefill_config: SimConfig | None = None,
) -> SimResult:
    """Replay ``requests`` on ``cost_model``: the simulator's main entry point.

    ``cost_model`` prices the colocated or decode instances' steps, ``prefill_cost_model`` (default: the
    same) the prefill instances': each already prices its instance's tensor and pipeline parallelism.
    ``tp`` (GPUs of a colocated or decode instance), ``prefill_tp`` (default ``tp``) and ``prefill_pp`` count
    the GPUs for per-GPU figures; a prefill instance of ``prefill_pp`` > 1 stages runs as that many engines
    (its stages work on as many steps at once), each with its share of the instance's KV pool.
    ``kv_link_bw``/``kv_link_latency_s`` apply unless ``config`` sets them.
    """
    config = config or SimConfig()
    if config.kv_link_bw is None or config.kv_link_latency_s is None:
        config = dataclasses.replace(
            config,
            kv_link_bw=config.kv_link_bw or kv_link_bw,
            kv_link_latency_s=kv_link_latency_s if config.kv_link_latency_s is None else config.kv_link_latency_s,
        )
    sim = Simulator(
        cost_model,
        config,
        mode,
        num_instances,
        num_prefill,
        num_decode,
        tp,
        prefill_cost_model=prefill_cost_model,
        prefill_gpus=(tp if prefill_tp is None else prefill_tp) * prefill_pp,
        prefill_pp=prefill_pp,
        prefill_config=prefill_config,
    )
    return sim.run(requests, max_concurrency)
