"""Discrete-event replay of a workload through the engine's real Scheduler and BlockManager.

Nothing of the scheduling policy lives here: every instance owns an ``engine.scheduler.Scheduler``
over an ``engine.block_manager.BlockManager`` (imported, never copied), whose ``clock`` is the
simulator's virtual clock. A step is what ``Scheduler.schedule()`` returns; its duration comes from a
cost model (``bench.sim.cost_model``) instead of a forward pass; then ``update_after_step`` runs, every
chunk that ``samples`` appends a dummy token, and requests stop at ``max_tokens`` through
``Scheduler.finish(request, FinishReason.LENGTH)``. Token timestamps are virtual times of step ends,
written into the same ``RequestRecord`` the real benchmark produces, so ``bench.metrics`` applies as is.

Modes:

- **colocated**: ``num_instances`` instances, each chunked prefill + decode in one batch; a request
  goes to the least-loaded instance (fewest unfinished requests, then fewest uncomputed tokens).
- **disaggregated**: ``num_prefill`` prefill instances and ``num_decode`` decode instances. On arrival
  the least-loaded decode instance reserves blocks for the prompt (leading blocks in its prefix cache
  need no transfer; if blocks are short the request waits, FIFO), then the least-loaded prefill
  instance runs chunked prefill. After each chunk, that chunk's KV (tokens x ``kv_bytes_per_token``)
  is queued on the prefill instance's KV link (FIFO, ``bandwidth``, plus ``latency``), overlapping the
  next chunk's compute. The last chunk samples the first token (that is the client's TTFT); the
  prefill side keeps its blocks until its last transfer is done. When the whole prompt's KV has
  arrived the decode instance admits the request ahead of new arrivals and decodes the rest.

Events at the same virtual time are all applied before any idle instance starts its next step, so
requests sent together are batched together. The simulator is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics
from pdserve.bench.sim.config import SimConfig
from pdserve.bench.sim.cost_model import CostModel, StepShape
from pdserve.bench.workloads import WorkloadRequest
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

MODES = ("colocated", "disaggregated")
DUMMY_TOKEN = 0  # what a simulated step "samples"; never EOS (requests run to max_tokens)


class StepRecord(NamedTuple):
    """One simulated (or measured) step of one instance; times in seconds."""

    instance: str
    start: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    num_seqs: int
    num_preempted: int

    @property
    def end(self) -> float:
        return self.start + self.duration

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


@dataclass(frozen=True)
class SimResult:
    """Everything one simulated run produced."""

    mode: str
    records: tuple[RequestRecord, ...]
    steps: tuple[StepRecord, ...]
    instances: tuple[str, ...]
    kv_bytes_moved: int = 0
    num_gpus: int = 1
    config: dict[str, Any] = field(default_factory=dict)

    def metrics(self, slo_ms: dict[str, float] | str | None = None) -> BenchmarkMetrics:
        return compute_metrics(self.records, slo_ms)

    def steps_of(self, instance: str) -> list[StepRecord]:
        return [s for s in self.steps if s.instance == instance]

    def record(self, request_id: str) -> RequestRecord:
        for r in self.records:
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)


class _Instance:
    def __init__(self, name: str, role: str, scheduler: Scheduler, link_bw: float, link_latency: float) -> None:
        self.name = name
        self.role = role
        self.scheduler = scheduler
        self.busy = False
        self.output: SchedulerOutput | None = None
        self.link_free_at = 0.0
        self.link_bw = link_bw
        self.link_latency = link_latency

    def load(self) -> tuple[int, int]:
        reqs = self.scheduler.requests.values()
        return len(reqs), sum(r.num_uncomputed_tokens for r in reqs)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)


@dataclass
class _Client:
    """The client's view of one request, plus the disaggregation bookkeeping."""

    wreq: WorkloadRequest
    send_time: float = math.nan
    token_times: list[float] = field(default_factory=list)
    done: bool = False
    ok: bool = True
    error: str | None = None
    end_time: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # disaggregated
    decode: _Instance | None = None
    prefill: _Instance | None = None
    decode_req: Request | None = None
    prefill_req: Request | None = None
    sent_upto: int = 0
    arrived_upto: int = 0
    first_token: bool = False


_ARRIVAL, _STEP_DONE, _KV_ARRIVED = 0, 1, 2


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
        kv_link_bw: float = 25e9,
        kv_link_latency_s: float = 20e-6,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"sim: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if min(num_instances, num_prefill, num_decode) < 1:
            raise ValueError("sim: instance counts must be >= 1")
        self.cost_model = cost_model
        self.config = config
        self.mode = mode
        self.tp = tp
        self.now = 0.0
        self.num_blocks = config.num_kv_blocks or max(1, cost_model.kv_capacity_tokens() // config.block_size)
        self.link_bw = config.kv_link_bw or kv_link_bw
        self.link_latency = config.kv_link_latency_s if config.kv_link_latency_s is not None else kv_link_latency_s
        self._counts = (num_instances, num_prefill, num_decode)
        self.instances: list[_Instance] = []
        self.steps: list[StepRecord] = []
        self.kv_bytes_moved = 0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()

    # ---- setup ---------------------------------------------------------------------------------
    def _make_instance(self, name: str, role: str, budget: int, max_model_len: int) -> _Instance:
        c = self.config
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=c.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=c.enable_chunked_prefill,
                max_chunk_tokens=c.chunk_size,
            ),
            BlockManager(self.num_blocks, c.block_size, c.enable_prefix_caching),
        )
        sched.clock = self._clock
        return _Instance(name, role, sched, self.link_bw, self.link_latency)

    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    # ---- the run -------------------------------------------------------------------------------
    def run(self, requests: Sequence[WorkloadRequest], max_concurrency: int | None = None) -> SimResult:
        """Replay ``requests`` (sent at their arrival offsets, at most ``max_concurrency`` in flight)."""
        if not requests:
            raise ValueError("sim: the workload is empty")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("sim: request ids must be unique")
        longest = max(r.num_prompt_tokens for r in requests)
        max_model_len = max(r.num_prompt_tokens + r.max_tokens for r in requests)
        budget = self.config.token_budget(longest)
        n, p, d = self._counts
        if self.mode == "colocated":
            self.instances = [self._make_instance(f"colo-{i}", "colocated", budget, max_model_len) for i in range(n)]
        else:
            self.instances = [
                self._make_instance(f"prefill-{i}", "prefill", budget, max_model_len) for i in range(p)
            ] + [self._make_instance(f"decode-{i}", "decode", budget, max_model_len) for i in range(d)]
        self._budget = budget
        self._clients = {r.request_id: _Client(r) for r in requests}
        self._max_concurrency = max_concurrency
        self._in_flight = 0
        self._backlog: deque[_Client] = deque()  # sent-able, held back by the concurrency cap
        self._reserve_queue: deque[_Client] = deque()  # disaggregated: waiting for decode blocks
        for r in sorted(requests, key=lambda r: r.arrival_offset_s):
            self._push(r.arrival_offset_s, _ARRIVAL, r.request_id)

        stop = self.config.stop_time_s
        while self._events:
            t = self._events[0][0]
            if stop is not None and t > stop:
                break
            self.now = t
            while self._events and self._events[0][0] == t:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == _ARRIVAL:
                    self._on_arrival(self._clients[payload])
                elif kind == _STEP_DONE:
                    self._on_step_done(payload)
                else:
                    self._on_kv_arrived(*payload)
            self._try_reservations()
            for inst in self.instances:
                if not inst.busy and inst.has_work():
                    self._start_step(inst)
        if stop is not None:
            self.now = max(self.now, stop)
        return self._result()

    # ---- client side ---------------------------------------------------------------------------
    def _on_arrival(self, client: _Client) -> None:
        if self._max_concurrency is not None and self._in_flight >= self._max_concurrency:
            self._backlog.append(client)
            return
        self._send(client)

    def _send(self, client: _Client) -> None:
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
        if self.mode == "colocated":
            inst = min((i for i in self.instances), key=lambda i: i.load())
            client.meta["instance"] = inst.name
            inst.scheduler.add(self._new_request(w, w.max_tokens))
        else:
            self._reserve_queue.append(client)

    def _complete(self, client: _Client, error: str | None = None) -> None:
        if client.done:
            return
        client.done = True
        client.end_time = self.now
        if error is not None:
            client.ok, client.error = False, error
        self._in_flight -= 1
        while self._backlog and (self._max_concurrency is None or self._in_flight < self._max_concurrency):
            self._send(self._backlog.popleft())

    def _new_request(self, w: WorkloadRequest, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(w.request_id, w.prompt_token_ids, params, eos_token_id=None, arrival_time=self.now)

    # ---- steps ---------------------------------------------------------------------------------
    def _start_step(self, inst: _Instance) -> None:
        output = inst.scheduler.schedule()
        if not output.chunks:
            return  # waiting for blocks; retried after the next event
        shape = StepShape.from_output(output)
        duration = max(self.cost_model.step_time(shape), 1e-9)
        inst.busy, inst.output = True, output
        self.steps.append(
            StepRecord(
                inst.name,
                self.now,
                duration,
                shape.prefill_tokens,
                shape.decode_tokens,
                shape.context_tokens,
                shape.num_seqs,
                len(output.preempted),
            )
        )
        self._push(self.now + duration, _STEP_DONE, inst)

    def _on_step_done(self, inst: _Instance) -> None:
        output = inst.output
        assert output is not None
        inst.busy, inst.output = False, None
        sched = inst.scheduler
        sched.update_after_step(output)
        for chunk in output.chunks:
            request = sched.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            client = self._clients[chunk.request_id]
            if inst.role == "prefill":
                self._after_prefill_chunk(inst, client, request, chunk.start + len(chunk.token_ids), chunk.samples)
                continue
            if not chunk.samples:
                continue
            request.all_token_ids.append(DUMMY_TOKEN)
            request.times.tokens.append(self.now)
            client.token_times.append(self.now)
            if request.num_output_tokens >= request.params.max_tokens:
                sched.finish(request, FinishReason.LENGTH)
                client.meta["num_preemptions"] = request.num_preemptions
                self._complete(client)

    # ---- disaggregation ------------------------------------------------------------------------
    def _try_reservations(self) -> None:
        while self._reserve_queue:
            client = self._reserve_queue[0]
            if not self._reserve(client):
                return  # FIFO: later requests wait behind the head
            self._reserve_queue.popleft()

    def _reserve(self, client: _Client) -> bool:
        """Decode side first (as ``LLMEngine.reserve_remote``), then hand the prompt to a prefill instance."""
        w = client.wreq
        decoders = sorted((i for i in self.instances if i.role == "decode"), key=lambda i: i.load())
        for inst in decoders:
            bm = inst.scheduler.block_manager
            req = self._new_request(w, w.max_tokens)
            hit = bm.find_prefix_hit(req)
            if not bm.can_allocate(req, req.num_prompt_tokens - hit.num_tokens, hit):
                continue
            bm.take_prefix_hit(req, hit)
            ok = bm.allocate_slots(req, req.num_prompt_tokens - hit.num_tokens)
            assert ok
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            req.times.first_scheduled = self.now
            inst.scheduler.add(req)
            client.decode, client.decode_req = inst, req
            client.sent_upto = client.arrived_upto = hit.num_tokens
            break
        else:
            return False
        prefill = min((i for i in self.instances if i.role == "prefill"), key=lambda i: i.load())
        client.prefill = prefill
        client.prefill_req = self._new_request(w, 1)
        prefill.scheduler.add(client.prefill_req)
        client.meta.update(
            prefill_instance=prefill.name,
            decode_instance=client.decode.name,  # type: ignore[union-attr]
            decode_cached_tokens=client.sent_upto,
            kv_bytes=0,
        )
        return True

    def _after_prefill_chunk(
        self, inst: _Instance, client: _Client, request: Request, computed: int, samples: bool
    ) -> None:
        nbytes = max(0, computed - client.sent_upto) * self.cost_model.kv_bytes_per_token
        if nbytes:
            start = max(self.now, inst.link_free_at)
            inst.link_free_at = start + nbytes / inst.link_bw
            self.kv_bytes_moved += nbytes
            client.meta["kv_bytes"] += nbytes
            client.sent_upto = computed
            self._push(inst.link_free_at + inst.link_latency, _KV_ARRIVED, (client, computed))
        if not samples:
            return
        # Last chunk: the first token is sampled here and streamed to the client at once.
        request.all_token_ids.append(DUMMY_TOKEN)
        client.token_times.append(self.now)
        client.first_token = True
        client.meta["prefill_done"] = self.now
        inst.scheduler.finish(request, FinishReason.LENGTH, free_blocks=False)  # held until the KV is out
        if not nbytes:  # everything was already cached on the decode side: just the notification
            self._push(self.now + inst.link_latency, _KV_ARRIVED, (client, computed))

    def _on_kv_arrived(self, client: _Client, upto: int) -> None:
        client.arrived_upto = max(client.arrived_upto, upto)
        req = client.decode_req
        assert req is not None and client.prefill is not None
        if not client.first_token or client.arrived_upto < req.num_prompt_tokens:
            return
        client.prefill.scheduler.block_manager.free(client.prefill_req)  # type: ignore[arg-type]
        client.meta["kv_done"] = self.now
        sched = client.decode.scheduler  # type: ignore[union-attr]
        # As LLMEngine.admit_remote: the prompt is computed, the first token is known, decode from here.
        req.num_computed_tokens = req.num_prompt_tokens
        sched.block_manager.cache_full_blocks(req)
        req.all_token_ids.append(DUMMY_TOKEN)
        req.times.tokens.append(client.token_times[0])
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish(req, FinishReason.LENGTH)
            self._complete(client)
            return
        sched.admit_front(req)

    # ---- results -------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        records = []
        for client in self._clients.values():
            w = client.wreq
            ok, error = client.ok, client.error
            if not client.done:
                ok = False
                error = error or (
                    "unfinished at stop time"
                    if self.config.stop_time_s is not None
                    else "stalled: no instance could make progress"
                )
            send = client.send_time if not math.isnan(client.send_time) else self.now
            records.append(
                RequestRecord(
                    request_id=w.request_id,
                    send_time=send,
                    token_times=tuple(client.token_times),
                    num_prompt_tokens=w.num_prompt_tokens,
                    num_output_tokens=len(client.token_times),
                    ok=ok,
                    error=error,
                    end_time=client.end_time,
                    label=w.label,
                    meta=dict(client.meta),
                )
            )
        n, p, d = self._counts
        instances = n if self.mode == "colocated" else p + d
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
            config.update(num_prefill=p, num_decode=d, kv_link_bw=self.link_bw, kv_link_latency_s=self.link_latency)
        return SimResult(
            self.mode,
            tuple(records),
            tuple(self.steps),
            tuple(i.name for i in self.instances),
            self.kv_bytes_moved,
            instances * self.tp,
            config,
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
) -> SimResult:
    """Replay ``requests`` on ``cost_model``: the simulator's main entry point.

    ``tp`` only labels the result (GPUs per instance, for per-GPU figures); the cost model already
    prices tensor parallelism. ``kv_link_bw``/``kv_link_latency_s`` apply unless ``config`` sets them.
    """
    sim = Simulator(
        cost_model,
        config or SimConfig(),
        mode,
        num_instances,
        num_prefill,
        num_decode,
        tp,
        kv_link_bw,
        kv_link_latency_s,
    )
    return sim.run(requests, max_concurrency)


def records_by_label(records: Iterable[RequestRecord], label: str) -> list[RequestRecord]:
    return [r for r in records if r.label == label]
