"""The prefill worker: a Ray actor that runs chunked prefill and pushes each chunk's KV to a decode worker.

Accepted prefills wait in this worker's own FIFO; one is admitted into the engine only when the
engine's waiting queue holds less than one step's token budget (the queue waits on a condition that the
engine loop notifies), and admitting it is what reserves its blocks on the decode worker
(``DecodeWorker.reserve``). So reserved blocks are always about to be written, never idle behind a long
prefill queue. Many requests share a step under the token budget. No lock is held across a call to a
decode worker and every such call is bounded: a decode worker that has no room sends its prefill back to
wait while prefills for other decode workers go ahead, and one that does not answer fails its prefills
(``DecodeUnavailable``) without holding up the others.
After every step, the blocks that the step completed (and, with the prompt's last chunk, its partly
filled last block) are pushed to the request's decode worker with a notification (request id, push
index, tokens done, is last; with ``verify_kv`` the CRC-32 of every block pushed). A push that fails, or
is still in flight after ``push_timeout_s``, fails its request: its other pushes are cancelled and the
request is torn down at once. ``abort`` confirms (True) only once no push of the request can still write
into the decode worker's pool (every push finished, failed, or cancelled as the transport confirms): that
is the confirmation the decode worker waits for before it frees the reserved blocks.
The last chunk also samples the first token, which goes back to the router at once — that is the
TTFT the client sees — while the last push is still in flight. The request's blocks stay held here
until its pushes have completed; then they are released into this worker's prefix cache. A failed or
aborted request whose cancelled pushes the transport has not confirmed over gives its blocks back at once
and is tracked until the transport confirms.

Only prompts run here (every request stops after its first token), so this engine never decodes and
therefore never preempts: a block that a push reads cannot be taken away under it.

Like the decode worker's, this module loads without torch (the router and the deployment's driver load
the class to hold handles to the actor); the engine and the KV transports load in the actor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.engine.async_engine import (
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    AsyncEngine,
    EngineStalled,
    exit_process_soon,
    worker_request_stats,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import build_in_passing_thread
from pdserve.engine.remote_kv import admission_open, waiting_prompt_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.faults import NO_FAULTS, FaultPlan
from pdserve.messages import Logprob, PromptLogprob, WorkerStats
from pdserve.placement import current_node, device_in_this_worker
from pdserve.priority import restore_normal_priority
from pdserve.transport_config import DEFAULT_PUSH_TIMEOUT_S, PUSH_MARGIN_S

if TYPE_CHECKING:  # torch's modules load in the actor only: see the module's docstring
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput
    from pdserve.kv_transfer import KVTransport, PushHandle, TransferTarget

log = logging.getLogger(__name__)


RESERVE_CALL_TIMEOUT_S = 10.0  # one reserve call to a decode worker: a hung one never answers
SLOW_RESERVE_S = 0.25  # a reserve call out this long stops holding back the admission of other prefills
RESERVE_RETRY_S = (0.005, 0.1)  # first and longest pause between reserve calls while the decode worker is full
ABORT_WAIT_S = 10.0  # abort() answers within this, confirmed or not (the caller asks again)
NOTICE_TIMEOUT_S = 10.0  # a call that tells a decode worker something is abandoned (not retried) after this


class ReservationTimeout(Exception):
    """The decode worker had no room for the prompt's KV within the allowed time (the router sheds it)."""


class DecodeUnavailable(RuntimeError):
    """The decode worker did not answer a reservation within ``RESERVE_CALL_TIMEOUT_S`` (hung or gone)."""


class PrefillResult(NamedTuple):
    worker_id: str
    first_token: int
    first_token_time: float
    queue_s: float  # accepted here -> first scheduled (the admission wait included)
    prefill_s: float
    num_cached_tokens: int  # prompt tokens found in this worker's own prefix cache
    num_pushes: int  # pushes issued so far (the last one may still be in flight)
    decode_cached_tokens: int  # prompt tokens the decode worker already had (their blocks were not pushed)
    first_logprobs: Logprob | None = None  # the first token's, when the request asked (SamplingParams.logprobs)
    prompt_logprobs: list[PromptLogprob] | None = None  # when it asked (SamplingParams.prompt_logprobs)


class _First(NamedTuple):
    """What the loop thread learns when a prompt's last chunk samples its first token."""

    token: int
    time: float
    queue_s: float
    prefill_s: float
    num_cached_tokens: int
    logprobs: Logprob | None
    prompt_logprobs: list[PromptLogprob] | None


@dataclass
class _Job:
    request_id: str
    prompt_len: int
    first_token: asyncio.Future
    aio: asyncio.AbstractEventLoop
    accepted_at: float  # unix time the prefill call arrived
    decode: Any = None  # the decode worker's actor handle
    target: TransferTarget | None = None  # set at admission, from the decode worker's reservation
    dst_block_ids: list[int] = field(default_factory=list)
    push_deadline: float = 0.0  # worker clock: no push may start after this (its timeout ends before the TTL)
    next_block: int = 0  # first block index not yet pushed (blocks cached on the decode side are skipped)
    next_block_at_start: int = 0  # blocks the decode worker already had
    push_index: int = 0
    handles: list[PushHandle] = field(default_factory=list)  # pushes in flight
    cancelling: list[PushHandle] = field(default_factory=list)  # cancelled pushes the transport has not let go yet
    cancelling_since: float = 0.0  # worker clock: when the first of them could not be cancelled
    receiver_probe: bool = False  # asking the decode worker whether its receiver still lives
    receiver_gone: bool = False  # its receiving process is dead or replaced: no write of ours can land there
    last_pushed: bool = False
    push_started: dict[int, float] = field(default_factory=dict)  # id(handle) -> worker clock at its start
    aborted: asyncio.Future | None = None  # set by the first abort: resolved once the job is torn down
    released: bool = False  # its blocks went back to the engine while a cancelled push was not confirmed over
    cancelled: bool = False  # stopped before it reached the engine (nothing in it, nothing to push)
    cancel_error: BaseException | None = None  # what its prefill call raises then
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)  # set with `cancelled`
    submitted: bool = False  # handed to the engine loop (which adds it unless it was cancelled first)
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # admission settled, whatever its outcome
    error: str | None = None

    def cancel(self, error: BaseException) -> None:
        """Event loop: stop the job before it reaches the engine; its admission returns at once."""
        if not self.cancelled:
            self.cancelled, self.cancel_error = True, error
            self.cancel_requested.set()

    def resolve(self, fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
        def apply() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        self.aio.call_soon_threadsafe(apply)


class PrefillWorker:
    """A Ray actor (async). Construct through ``ray.remote(PrefillWorker)``; await ``ready()``."""

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transport: str | KVTransport = "nixl",
        transport_config: Any = None,
        push_timeout_s: float = DEFAULT_PUSH_TIMEOUT_S,
        verify_kv: bool = False,
        *,
        engine_stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
        faults: FaultPlan = NO_FAULTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``transport``: a kind for ``make_transport``, or a transport object (tests). ``verify_kv``: send
        the CRC-32 of every pushed block with its notification (the decode worker checks them).
        ``engine_stall_timeout_s``: the engine loop stuck this long counts as hung (see ``AsyncEngine``).
        ``faults``: faults to inject (tests). ``clock``: the monotonic clock of push deadlines and timeouts."""
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.model_runner import use_device
        from pdserve.kv_transfer import KVTransport, make_transport

        restore_normal_priority()  # Ray starts workers at niceness 15
        self.worker_id = worker_id
        self.push_timeout_s = push_timeout_s
        self.verify_kv = verify_kv
        self.faults = faults
        self._clock = clock
        self.handle: Any = None  # this worker's actor handle, passed with each reservation; None: Ray's
        device = device_in_this_worker(engine_config.device)
        # the loop thread is then the only one with OpenMP threads (see build_in_passing_thread)
        engine = build_in_passing_thread(lambda: LLMEngine(replace(engine_config, device=device)))
        self.block_size = engine.config.block_size
        # Admission: accepted prefills queue here (FIFO) until the engine has room for them; the condition
        # is notified whenever that may have changed (the loop thread's count, a job leaving the queue).
        self._admission = asyncio.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._accepted: dict[str, _Job] = {}  # event loop: accepted, not yet admitted into the engine
        self._budget = engine.scheduler.config.max_num_batched_tokens
        self._waiting_tokens = 0  # prompt tokens waiting in the engine, as of the loop thread's last look
        self._adding: dict[str, int] = {}  # reserving or admitted, not yet added by the loop thread: prompt tokens
        self._aborts: dict[str, asyncio.Future] = {}  # one abort per request, however many ask for it
        use_device(engine.device)  # a CUDA context on this thread before the NIXL agent brings up UCX
        self.transport = (
            transport if isinstance(transport, KVTransport) else make_transport(transport, transport_config)
        )
        self.transport.register_pool(engine.kv_cache, engine.kv_compatibility)
        self._jobs: dict[str, _Job] = {}  # touched on the loop thread only (after creation)
        self._notices: set[asyncio.Future] = set()
        self._kv_bytes = 0
        self._num_pushes = 0
        # a stalled step may preempt a partial prefill, but never one whose blocks a push is still reading
        engine.scheduler.preemptable = lambda r: (
            not (job := self._jobs.get(r.request_id)) or not (job.handles or job.cancelling)
        )
        self.aengine = AsyncEngine(
            engine,
            on_step=self._on_step,
            on_tick=self._on_tick,
            on_crash=self._on_crash,
            stall_timeout_s=engine_stall_timeout_s,
            on_stall=self._on_stall,
        )
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        """This worker's description; raises while its engine loop is dead (the process is being replaced) or
        stalled (``EngineStalled``)."""
        return self.aengine.describe(self.worker_id, "prefill", self.transport.kind, self.node)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode: Any,
        reserve_timeout_s: float = 60.0,
        router_id: str = "",
    ) -> PrefillResult:
        """Prefill the prompt, pushing its KV into blocks reserved on ``decode`` (a DecodeWorker handle).

        The reservation is made when the prefill is admitted into this worker's engine, not before, for the
        router ``router_id`` (whose event stream gets the decode worker's news of it, a passed deadline
        included). Raises ``ReservationTimeout`` when the decode worker has no room for ``reserve_timeout_s``,
        ``DecodeUnavailable`` when it does not answer, ``EngineStalled`` while this worker's engine is hung.
        """
        if request_id in self._accepted:
            raise ValueError(f"request_id {request_id!r} is already in use on this worker")
        stalled = self.aengine.stalled()
        if stalled is not None:
            raise EngineStalled(f"prefill worker {self.worker_id} is hung: {stalled}")
        aio = asyncio.get_running_loop()
        job = _Job(request_id, len(prompt_token_ids), aio.create_future(), aio, accepted_at=time.time())
        self._accepted[request_id] = job
        try:
            await self._admit(job, prompt_token_ids, params, decode, reserve_timeout_s, router_id)
        finally:
            self._accepted.pop(request_id, None)
            job.admitted.set()
        if job.cancelled:
            raise job.cancel_error or RuntimeError(f"request {request_id!r} aborted")
        first: _First = await job.first_token
        return PrefillResult(
            self.worker_id,
            first.token,
            first.time,
            first.queue_s,
            first.prefill_s,
            first.num_cached_tokens,
            job.push_index,
            job.next_block_at_start * self.block_size,
            first.logprobs,
            first.prompt_logprobs,
        )

    # ---- admission (event loop): no lock is held across a remote call, every remote call is bounded --------
    async def _admit(
        self,
        job: _Job,
        prompt: list[int],
        params: SamplingParams,
        decode: Any,
        reserve_timeout_s: float,
        router_id: str,
    ) -> None:
        """Wait for the engine to have room (FIFO), reserve on the decode worker, hand the prompt to the engine.

        A decode worker with no room sends the job back to wait (at the queue's head) while later prefills for
        other decode workers go ahead; a cancel ends the wait at once, whatever the job waits for.
        """
        try:
            await self._reserve_and_add(job, prompt, params, decode, reserve_timeout_s, router_id)
        finally:
            self._counted_out(job)

    async def _reserve_and_add(
        self,
        job: _Job,
        prompt: list[int],
        params: SamplingParams,
        decode: Any,
        reserve_timeout_s: float,
        router_id: str,
    ) -> None:
        give_up = self._clock() + reserve_timeout_s
        pause, longest_pause = RESERVE_RETRY_S
        retrying = False
        while True:
            if not await self._take_turn(job, len(prompt), front=retrying):
                return  # cancelled while it waited: nothing was reserved
            reserved_at = self._clock()  # the TTL runs from no earlier than this, on the decode side
            reservation = await self._reserve_once(job, prompt, params, decode, router_id)
            if reservation is not None:
                break
            self._counted_out(job)
            if job.cancelled:
                return
            if self._clock() > give_up:
                raise ReservationTimeout(f"no KV blocks free on the decode worker for {reserve_timeout_s} s")
            await _unless_set(job.cancel_requested, asyncio.sleep(pause))
            pause, retrying = min(pause * 2, longest_pause), True
        job.decode, job.target, job.dst_block_ids = decode, reservation.target, list(reservation.block_ids)
        job.next_block = job.next_block_at_start = reservation.num_cached_tokens // self.block_size
        job.push_deadline = reserved_at + reservation.ttl_s - self.push_timeout_s - PUSH_MARGIN_S
        first_params = dataclasses.replace(params, max_tokens=1, ignore_eos=True, stop_token_ids=())

        def add(engine: LLMEngine) -> bool:
            if job.cancelled:
                return False  # cancelled since it was queued: never added (its reservation is given back)
            engine.add_request(prompt, first_params, job.request_id, hold_blocks=True, detokenize=False)
            self._jobs[job.request_id] = job
            self._waiting_tokens = waiting_prompt_tokens(engine.scheduler)
            return True

        # Queued, not awaited, by the loop thread: while a step runs, the next prompts are admitted behind this
        # one (counted in `_adding` until the loop thread adds them) and share the next step.
        added = self.aengine.submit(add)
        job.submitted = True
        added.add_done_callback(lambda f: self._after_add(job, f))
        await _unless_set(job.cancel_requested, added)
        if not job.cancelled and added.done() and added.exception() is not None:
            raise added.exception()  # type: ignore[misc]

    def _after_add(self, job: _Job, added: asyncio.Future) -> None:
        if added.cancelled() or added.exception() is not None or added.result() is False:
            self._give_back(job.decode, job.request_id)  # never added: nothing was pushed

    async def _take_turn(self, job: _Job, tokens: int, front: bool) -> bool:
        """Wait until the job heads the queue and the engine has room, then count its tokens as being added.
        False when it was cancelled first."""
        async with self._admission:
            if front:
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            try:
                await self._admission.wait_for(
                    lambda: job.cancelled or (self._queue[0] is job and self._admission_is_open())
                )
            finally:
                self._queue.remove(job)
                self._admission.notify_all()
            if job.cancelled:
                return False
            self._adding[job.request_id] = tokens
            return True

    def _counted_out(self, job: _Job) -> None:
        if self._adding.pop(job.request_id, None) is not None:
            self._wake_admission()

    def _wake_admission(self) -> None:
        """Event loop: re-check the admission condition (the engine's queue or the jobs being added changed)."""

        async def notify() -> None:
            async with self._admission:
                self._admission.notify_all()

        self._keep(notify())

    async def _reserve_once(
        self, job: _Job, prompt: list[int], params: SamplingParams, decode: Any, router_id: str
    ) -> Any:
        """One reservation on the decode worker: its ``ReserveResult``, or None (no room, or the job was
        cancelled). A call out for ``SLOW_RESERVE_S`` stops holding back the admission of other prefills;
        one that gets no answer within ``RESERVE_CALL_TIMEOUT_S`` raises ``DecodeUnavailable``. A reservation
        that arrives for a job that no longer wants it is given back."""
        sender = self.transport.sender_id
        # the decode worker computes no prompt position: its prefix cache may serve the whole prompt
        decode_params = replace(params, prompt_logprobs=None)
        ref = decode.reserve.remote(job.request_id, prompt, decode_params, self._own_handle(), router_id, sender)
        call = asyncio.ensure_future(_awaited(ref))
        call.add_done_callback(lambda f: _read_failure(f))
        cancelled = asyncio.ensure_future(job.cancel_requested.wait())
        try:
            done, _ = await asyncio.wait({call, cancelled}, timeout=SLOW_RESERVE_S, return_when=FIRST_COMPLETED)
            if not done:
                self._counted_out(job)  # slow: let the others in meanwhile
                done, _ = await asyncio.wait(
                    {call, cancelled}, timeout=RESERVE_CALL_TIMEOUT_S - SLOW_RESERVE_S, return_when=FIRST_COMPLETED
                )
        finally:
            cancelled.cancel()
        if call not in done:  # the decode worker may still make it: give it back if it does
            call.add_done_callback(lambda f: self._give_back(decode, job.request_id) if _reserved(f) else None)
            if job.cancelled:
                return None
            raise DecodeUnavailable(
                f"prefill worker {self.worker_id}: its decode worker did not answer a reservation within "
                f"{RESERVE_CALL_TIMEOUT_S:g} s (hung or gone)"
            )
        reservation = call.result()
        if reservation is not None and job.cancelled:
            self._give_back(decode, job.request_id)
            return None
        if reservation is not None:
            self._adding[job.request_id] = len(prompt)
        return reservation

    def _give_back(self, decode: Any, request_id: str) -> None:
        """Event loop: drop a reservation that nothing was or will be pushed into (not awaited)."""
        self._tell_decode(decode, request_id, None)

    def _own_handle(self) -> Any:
        """What the decode worker calls ``abort`` on to learn that this worker's pushes are over."""
        if self.handle is None:
            import ray

            self.handle = ray.get_runtime_context().current_actor
        return self.handle

    def _admission_is_open(self) -> bool:
        """The engine's admission rule, counting the prompts admitted but not yet added."""
        return admission_open(self._waiting_tokens + sum(self._adding.values()), self._budget)

    def _keep(self, awaitable: Any) -> None:
        """Run ``awaitable`` to its end on the event loop without awaiting it; its failure is read and dropped."""
        task = asyncio.ensure_future(awaitable)
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)
        task.add_done_callback(_read_failure)

    # ---- on the loop thread --------------------------------------------------------------------
    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        from pdserve.kv_transfer.base import ChunkNotification, block_checksums

        assert engine.last_output is not None
        if self.faults.any:
            self.faults = self.faults.after_step()
        for chunk in engine.last_output.chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.aborted is not None or job.error is not None:
                continue
            tokens_done = chunk.start + len(chunk.token_ids)
            is_last = tokens_done == job.prompt_len
            end = -(-job.prompt_len // self.block_size) if is_last else tokens_done // self.block_size
            blocks = range(job.next_block, end)
            if (not blocks and not is_last) or self.faults.stall_pushes:
                continue  # the chunk completed no block: nothing to send yet (or pushes are made to stall)
            if self._clock() > job.push_deadline:
                self._fail(engine, job, "the decode worker's reservation expires before a push could finish")
                continue
            src = [chunk.block_ids[i] for i in blocks]
            sums = block_checksums(engine.kv_cache, src) if self.verify_kv else ()
            note = ChunkNotification(job.request_id, job.push_index, tokens_done, is_last, job.next_block, sums)
            try:
                assert job.target is not None  # reserved before its prompt was added
                handle = self.transport.push(job.target, src, [job.dst_block_ids[i] for i in blocks], note)
            except Exception as e:  # one request's push failing must not stop the worker
                self._fail(engine, job, f"KV push failed: {e!r}")
                continue
            job.handles.append(handle)
            job.push_started[id(handle)] = self._clock()
            job.next_block, job.push_index, job.last_pushed = end, job.push_index + 1, is_last
            self._kv_bytes += handle.num_bytes
            self._num_pushes += 1
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is not None and out.new_token_ids and job.error is None:
                request = engine.get_request(out.request_id)
                assert request is not None
                stats = worker_request_stats(request)
                first_time = request.times.first_token or time.time()
                queue_s = max(0.0, (request.times.first_scheduled or first_time) - job.accepted_at)
                logprobs = (out.logprobs[0].logprob, out.logprobs[0].top) if out.logprobs else None
                first = _First(
                    out.new_token_ids[0],
                    first_time,
                    queue_s,
                    stats.prefill_s,
                    stats.num_cached_tokens,
                    logprobs,
                    out.prompt_logprobs,
                )
                job.resolve(job.first_token, first)

    def _on_tick(self, engine: LLMEngine) -> None:
        waiting = waiting_prompt_tokens(engine.scheduler)
        if waiting != self._waiting_tokens:
            self._waiting_tokens = waiting
            self.aengine.call_soon(self._wake_admission)
        now = self._clock()
        for job in list(self._jobs.values()):
            self._settle_pushes(engine, job, now)
            if self._jobs.get(job.request_id) is not job:
                continue  # failed and torn down just now
            if job.error is None and not job.last_pushed and now > job.push_deadline + self.push_timeout_s:
                self._fail(engine, job, "its KV was not all pushed before the decode worker's reservation expired")
            if job.handles or job.cancelling:
                continue
            if job.aborted is not None:
                self._teardown(engine, job)
                job.resolve(job.aborted, True)
            elif job.last_pushed or job.error is not None:
                self._teardown(engine, job)

    def _settle_pushes(self, engine: LLMEngine, job: _Job, now: float) -> None:
        """Drop finished pushes; a failed or overdue one fails the job (which cancels the others)."""
        if job.cancelling:
            job.cancelling = [] if job.receiver_gone else [h for h in job.cancelling if not h.cancel()]
            if job.cancelling and not job.receiver_probe and now - job.cancelling_since > self.push_timeout_s:
                job.receiver_probe = True  # a write that will not cancel, for a while: is its target still there?
                job.aio.call_soon_threadsafe(self._start_receiver_probe, job)
        in_flight: list[PushHandle] = []
        failure: str | None = None
        for handle in job.handles:
            try:
                if handle.done():
                    job.push_started.pop(id(handle), None)
                    continue
            except Exception as e:  # a failed push raises on every poll: drop it, fail the request
                job.push_started.pop(id(handle), None)
                failure = failure or f"KV push failed: {e}"
                continue
            if now - job.push_started.get(id(handle), now) > self.push_timeout_s:
                failure = failure or f"a KV push took longer than {self.push_timeout_s} s"
            in_flight.append(handle)
        job.handles = in_flight
        if failure is not None:
            if job.error is None:
                self._fail(engine, job, failure)
            else:
                self._cancel_pushes(job)
                if job.cancelling:
                    self._release_blocks(engine, job)

    def _cancel_pushes(self, job: _Job) -> None:
        """Cancel every push of the job still in flight; those the transport cannot stop yet are retried."""
        for handle in job.handles:
            job.push_started.pop(id(handle), None)
            if not handle.cancel():
                if not job.cancelling:
                    job.cancelling_since = self._clock()
                job.cancelling.append(handle)
        job.handles = []

    def _start_receiver_probe(self, job: _Job) -> None:
        probe = asyncio.ensure_future(self._probe_receiver(job))
        self._notices.add(probe)
        probe.add_done_callback(self._notices.discard)

    async def _probe_receiver(self, job: _Job) -> None:
        """Event loop: a push that the transport cannot cancel ends when the process it writes into is gone."""
        from ray.exceptions import ActorDiedError

        assert job.target is not None
        try:
            current = await asyncio.wait_for(job.decode.receiver_id.remote(), 10.0)
        except ActorDiedError:
            current = None
        except Exception as e:  # unavailable or slow: ask again later
            log.warning("%s: request %s: cannot reach its decode worker (%r)", self.worker_id, job.request_id, e)
            current = job.target.target_id
        if current != job.target.target_id:
            log.warning("%s: request %s: its decode worker's process is gone", self.worker_id, job.request_id)
            job.receiver_gone = True  # read by the loop thread on its next tick
        job.cancelling_since = self._clock()
        job.receiver_probe = False

    def _on_crash(self, error: BaseException) -> None:
        """The engine loop died: fail every prefill (the router prefills them locally), then exit."""
        for job in list(self._jobs.values()):
            job.resolve(job.first_token, error=RuntimeError(f"prefill worker {self.worker_id} failed: {error!r}"))
        exit_process_soon(self.worker_id)

    def _fail(self, engine: LLMEngine, job: _Job, error: str) -> None:
        """Fail the request once: cancel its pushes, tear it down as soon as none can still land."""
        log.warning("%s: request %s: %s", self.worker_id, job.request_id, error)
        job.error = error
        job.resolve(job.first_token, error=RuntimeError(f"prefill worker {self.worker_id}: {error}"))
        self._cancel_pushes(job)
        if not job.cancelling:
            self._teardown(engine, job)
            if job.aborted is not None:
                job.resolve(job.aborted, True)
        else:
            self._release_blocks(engine, job)

    def _release_blocks(self, engine: LLMEngine, job: _Job) -> None:
        """A failed or aborted job whose cancelled pushes the transport has not confirmed over: its blocks go back
        to this worker's pool now, so a decode worker that hangs does not hold them. A push still reading them
        may carry other bytes from then on, into blocks its decode worker keeps in quarantine until this worker
        confirms the push over (``abort``), which only the transport's word allows; the job stays until then."""
        if not job.released:
            job.released = True
            if not engine.release(job.request_id):
                engine.abort(job.request_id)

    def _teardown(self, engine: LLMEngine, job: _Job) -> None:
        """Release the job's blocks (its pushes are all over). A failed job also tells its decode worker,
        which then gives up on the reservation at once instead of at its deadline."""
        self._jobs.pop(job.request_id, None)
        self._release_blocks(engine, job)
        if job.error is not None and job.aborted is None and job.decode is not None:
            error = f"prefill worker {self.worker_id}: {job.error}"
            job.aio.call_soon_threadsafe(self._tell_decode, job.decode, job.request_id, error)

    def _tell_decode(self, decode: Any, request_id: str, error: str | None) -> None:
        """Event loop: none of the request's pushes can land any more (it failed here, with ``error``, or was
        never pushed): the decode worker may free its reservation. Not awaited; abandoned after a while."""
        self._keep(asyncio.wait_for(_awaited(decode.abort.remote(request_id, True, error)), NOTICE_TIMEOUT_S))

    def _on_stall(self, why: str) -> None:
        """Event loop: the engine loop is stuck. Every prefill here fails with ``EngineStalled`` (the router
        answers UNAVAILABLE naming this worker); the engine tears the admitted ones down once it turns again,
        when their aborts reach it."""
        error = EngineStalled(f"prefill worker {self.worker_id} is hung: {why}")
        for job in list(self._accepted.values()):
            job.cancel(error)
        for job in list(self._jobs.values()):  # the loop thread, which owns the dict, is stuck
            job.resolve(job.first_token, error=error)
        self._wake_admission()

    # ---- control -------------------------------------------------------------------------------
    async def abort(self, request_id: str, wait_s: float = ABORT_WAIT_S) -> bool:
        """Stop a request. True once no push of it can still write into the decode worker's pool (also when
        this worker never had it, or no longer has it); False when that is not confirmed within ``wait_s``: a
        push that the transport has not let go yet, or an engine that does not step. Ask again then.

        Every call for the request shares one abort: each returns when it is over (or at its own ``wait_s``),
        and calls that time out leave nothing behind. A prefill not admitted yet stops at once; a reservation
        made for it meanwhile is given back.
        """
        over = self._aborts.get(request_id)
        if over is None:
            over = self._aborts[request_id] = asyncio.ensure_future(self._abort(request_id))
            over.add_done_callback(lambda f: self._aborts.get(request_id) is f and self._aborts.pop(request_id))
        try:
            return await asyncio.wait_for(asyncio.shield(over), wait_s)
        except TimeoutError:
            return False

    async def _abort(self, request_id: str) -> bool:
        accepted = self._accepted.get(request_id)
        if accepted is not None:
            accepted.cancel(RuntimeError(f"request {request_id!r} aborted"))
            await accepted.admitted.wait()  # its admission returns as soon as it sees the cancel
            if not accepted.submitted:
                return True  # it never reached the engine: nothing was or will be pushed
        torn_down = asyncio.get_running_loop().create_future()

        def do(engine: LLMEngine) -> asyncio.Future | bool:
            job = self._jobs.get(request_id)
            if job is None:
                engine.abort(request_id)
                return True
            if job.aborted is not None:
                return job.aborted
            job.aborted = torn_down
            job.resolve(job.first_token, error=RuntimeError(f"request {request_id!r} aborted"))
            self._cancel_pushes(job)
            if not job.cancelling:
                self._teardown(engine, job)
                return True
            self._release_blocks(engine, job)
            return torn_down

        result = await self.aengine.run(do)
        if isinstance(result, bool):
            return result
        return await result

    async def set_fault_plan(self, faults: FaultPlan) -> None:
        """Fault tests: inject ``faults`` from the next step on (``NO_FAULTS`` clears them)."""
        self.faults = faults

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        in_flight = sum(len(j.handles) + len(j.cancelling) for j in list(self._jobs.values()))
        stats = await self.aengine.stats(self.worker_id, "prefill", in_flight, self._kv_bytes, steps_since)
        return stats._replace(node=self.node, device=str(self.aengine.engine.device))

    async def check_integrity(self) -> None:
        await self.aengine.run(lambda e: e.block_manager.check_integrity())

    async def shutdown(self) -> None:
        self.aengine.close()
        self.transport.close()


async def _awaited(ref: Any) -> Any:
    """An actor call's result (an ``ObjectRef``, or a future from an in-process stand-in) as a coroutine."""
    return await ref


async def _unless_set(event: asyncio.Event, awaitable: Any) -> None:
    """Wait for ``awaitable`` or ``event``, whichever comes first; the other is left as it is (an unfinished
    ``awaitable`` keeps running when it is a future or task, and is cancelled when it is a bare coroutine)."""
    work = asyncio.ensure_future(awaitable)
    flag = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({work, flag}, return_when=FIRST_COMPLETED)
    finally:
        flag.cancel()
        if not work.done() and asyncio.iscoroutine(awaitable):
            work.cancel()


def _reserved(call: asyncio.Future) -> bool:
    """Whether a finished reserve call made a reservation."""
    return not call.cancelled() and call.exception() is None and call.result() is not None


def _read_failure(future: asyncio.Future) -> None:
    """Read a dropped future's failure, so that it is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()
