"""One simulated instance (an engine: its scheduler, block pool and cost model) and the state the event loop
(``sim.simulator``) keeps for it and for every request: the step running on it, a coalesced run of identical
decode steps, a prefill instance's queue of accepted prompts, and the client's view of each request.

A coalesced run (``DecodeRun``): a decode instance whose step is decode-only with nothing waiting runs the same
batch step after step until a request finishes or something reaches it (``Scheduler.decode_run_length``). The
run's steps are priced and timed ahead here, each as the step-by-step loop would price and time it, and applied
to the scheduler (``Scheduler.advance_decode_run``) only when something reaches the instance or the run ends.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.router.policy import Route
from pdserve.sim.cost_model import DECODE_GROUP_SIZE, CostModel, DecodePricer, StepShape, decode_pricer
from pdserve.workload.generator import WorkloadRequest

if TYPE_CHECKING:
    from pdserve.sim.alignment import Deferred

RUN_PLAN_STEPS = 8  # a coalesced run plans this many steps ahead at first, then doubles


@dataclass
class Client:
    """The client's view of one request, plus where the router sent it and the handoff state."""

    wreq: WorkloadRequest
    send_time: float = math.nan
    token_times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    end_time: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    route: Route | None = None
    decode: Instance | None = None
    prefill: Instance | None = None
    decode_req: Request | None = None
    prefill_req: Request | None = None
    sent_upto: int = 0  # prompt tokens whose KV is on the decode side or on its way
    prompt_hashes: list[bytes] = field(default_factory=list)  # the prompt's block hashes, computed once
    kv_complete: bool = False
    decode_called: bool = False
    queued_at: float = 0.0  # when it joined a prefill instance's FIFO


@dataclass
class Step:
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
class DecodeRun:
    """A run of identical decode-only steps on one instance, advanced without an event per step.

    Step ``i`` (1-based) computes one token of every request of ``requests``, the ``q``-th at position
    ``first_starts[q] + i - 1``; it starts at ``starts[i - 1]`` and ends at ``ends[i - 1]`` (planned up to
    ``len(ends)``, at most ``last_step``: a request finishes in that step or the next one would need more
    blocks than are free). The scheduler's state is that of step ``at`` running: the steps before it
    applied, its blocks allocated. ``groups``: (size, longest context in step 1) of each group of the
    engine's decode attention (the keys it reads)."""

    requests: list[Request]
    clients: list[Client]
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

    def shape(self, step: int, block_size: int) -> StepShape:
        """Step ``step``'s shape, as ``StepShape.from_output`` gives it."""
        b, context = self.num_seqs, self.context_tokens(step)
        return StepShape(0, b, context, context - b, b, b, context, self.decode_keys(step, block_size))

    def plan(self, upto: int, block_size: int, token_latency_s: float) -> None:
        """Price and time the steps up to ``upto``, as the step-by-step loop would."""
        price, b = self.price, self.num_seqs
        base = sum(self.first_starts) + b  # the decodes' summed context in step 1
        starts, ends, deliveries = self.starts, self.ends, self.deliveries
        for i in range(len(ends) + 1, upto + 1):
            context = base + b * (i - 1)
            keys = self.decode_keys(i, block_size) if self.reads_keys else 0
            start = ends[-1]
            end = start + max(price(context, context - b, keys), 1e-9)
            starts.append(start)
            ends.append(end)
            deliveries.append(end + token_latency_s)


class Instance:
    """One engine of the deployment, as the event loop drives it."""

    def __init__(self, name: str, cost_role: str, scheduler: Scheduler, cost_model: CostModel, index: int = 0) -> None:
        self.name = name
        self.index = index  # its place in the deployment's order (prefill instances first)
        self.cost_role = cost_role  # how the cost model prices its steps (cost_model.ROLES)
        self.cost_model = cost_model  # its GPUs' (its tensor and pipeline parallelism priced in)
        self.scheduler = scheduler
        self.busy = False
        self.output: SchedulerOutput | None = None  # the step running now, if any
        self.step: Step | None = None  # its timing
        self.link_free_at = 0.0
        self.fifo: deque[Client] = deque()  # a prefill instance's accepted prompts, not yet admitted
        self.reserving = False  # a prefill instance waits for the reservation of its FIFO's head
        self.waiting_for_room: set[Instance] = set()  # a decode instance: prefill instances whose head found no room
        self.commands: list[tuple[Callable[..., None], tuple]] = []  # calls that arrived during a step
        self.num_steps_started = 0
        self.tick_waiting_tokens = 0  # a prefill instance: waiting prompt tokens just before the running step
        self.admitted_since_tick = 0  # ... and prompt tokens admitted since it started
        self.run: DecodeRun | None = None  # a coalesced run of decode-only steps in progress
        # replay: admission events held back to the step the run recorded for them, and the recorded
        # (step, request id, event) still to come here, in step order; when the next step waits for one
        self.deferred: list[Deferred] = []
        self.expected: deque[tuple[int, str, str]] = deque()
        self.hold_since: float | None = None

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.deferred)

    def deferred_prompt_tokens(self) -> int:
        """Prompt tokens of the prefills held back from this (prefill) instance's scheduler."""
        return sum(d.prompt_tokens for d in self.deferred if d.event == "prefill_queued")

    def begin_decode_run(
        self,
        output: SchedulerOutput,
        shape: StepShape,
        now: float,
        work: float,
        clients: dict[str, Client],
        token_latency_s: float,
    ) -> DecodeRun | None:
        """A run beginning with the step ``output`` (just scheduled at ``now``, priced ``work``) when one can
        (at least two steps; no reservation waiting for this instance's blocks), its first steps planned."""
        sched = self.scheduler
        chunks = output.chunks
        if self.waiting_for_room or shape.prefill_tokens or shape.decode_tokens != len(chunks):
            return None
        last = sched.decode_run_length(output)
        if last < 2:
            return None
        first_starts = [c.start for c in chunks]
        contexts = sorted(start + 1 for start in first_starts)
        groups = [
            (len(contexts[g : g + DECODE_GROUP_SIZE]), contexts[min(g + DECODE_GROUP_SIZE, len(contexts)) - 1])
            for g in range(0, len(contexts), DECODE_GROUP_SIZE)
        ]
        end = now + work
        price, reads_keys = decode_pricer(self.cost_model, len(chunks), self.cost_role)
        run = DecodeRun(
            requests=[sched.requests[c.request_id] for c in chunks],
            clients=[clients[c.request_id] for c in chunks],
            first_starts=first_starts,
            last_step=last,
            price=price,
            reads_keys=reads_keys,
            groups=groups,
            composition=tuple((c.request_id, 1) for c in chunks),
            starts=[now],
            ends=[end],
            deliveries=[end + token_latency_s],
        )
        run.plan(min(last, RUN_PLAN_STEPS), sched.block_manager.block_size, token_latency_s)
        return run
