"""The prefill worker: a Ray actor that runs chunked prefill and pushes each chunk's KV to a decode worker.

Accepted prefills wait in this worker's own FIFO; one is admitted into the engine only when the
engine's waiting queue holds less than one step's token budget, and admitting it is what reserves its
blocks on the decode worker (``DecodeWorker.reserve``). So reserved blocks are always about to be
written, never idle behind a long prefill queue. Many requests share a step under the token budget.
After every step, the blocks that the step completed (and, with the prompt's last chunk, its partly
filled last block) are pushed to the request's decode worker with a notification (request id, push
index, tokens done, is last; with ``verify_kv`` the CRC-32 of every block pushed). A push that fails, or
is still in flight after ``push_timeout_s``, fails its request: its other pushes are cancelled and the
request is torn down at once. ``abort`` returns only once no push of the request can still write into
the decode worker's pool (every push finished or cancelled): that is the confirmation the decode worker
waits for before it frees the reserved blocks.
The last chunk also samples the first token, which goes back to the router at once — that is the
TTFT the client sees — while the last push is still in flight. The request's blocks stay held here
until its pushes have completed; then they are released into this worker's prefix cache.

Only prompts run here (every request stops after its first token), so this engine never decodes and
therefore never preempts: a block that a push reads cannot be taken away under it.

Like the decode worker's, this module loads without torch (the router and the deployment's driver load
the class to hold handles to the actor); the engine and the KV transports load in the actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.engine.async_engine import AsyncEngine, exit_process_soon, worker_request_stats
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import build_in_passing_thread
from pdserve.engine.remote_kv import admission_open, waiting_prompt_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import Logprob, PromptLogprob, WorkerStats
from pdserve.placement import current_node, device_in_this_worker
from pdserve.priority import restore_normal_priority
from pdserve.transport_config import DEFAULT_PUSH_TIMEOUT_S, PUSH_MARGIN_S

if TYPE_CHECKING:  # torch's modules load in the actor only: see the module's docstring
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput
    from pdserve.kv_transfer import KVTransport, PushHandle, TransferTarget

log = logging.getLogger(__name__)


class ReservationTimeout(Exception):
    """The decode worker had no room for the prompt's KV within the allowed time (the router sheds it)."""


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
    push_deadline: float = 0.0  # monotonic: no push may start after this (its timeout ends before the TTL)
    next_block: int = 0  # first block index not yet pushed (blocks cached on the decode side are skipped)
    next_block_at_start: int = 0  # blocks the decode worker already had
    push_index: int = 0
    handles: list[PushHandle] = field(default_factory=list)  # pushes in flight
    cancelling: list[PushHandle] = field(default_factory=list)  # cancelled pushes the transport has not let go yet
    cancelling_since: float = 0.0  # monotonic: when the first of them could not be cancelled
    receiver_probe: bool = False  # asking the decode worker whether its receiver still lives
    receiver_gone: bool = False  # its receiving process is dead or replaced: no write of ours can land there
    last_pushed: bool = False
    push_started: dict[int, float] = field(default_factory=dict)  # id(handle) -> monotonic start
    aborted: asyncio.Future | None = None  # set by abort(): resolved once the job is torn down
    cancelled: bool = False  # aborted before admission (nothing in the engine, nothing to push)
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)  # set with `cancelled`
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # admission settled, whatever its outcome
    error: str | None = None

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
    ) -> None:
        """``transport``: a kind for ``make_transport``, or a transport object (tests). ``verify_kv``: send
        the CRC-32 of every pushed block with its notification (the decode worker checks them)."""
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.model_runner import use_device
        from pdserve.kv_transfer import KVTransport, make_transport

        restore_normal_priority()  # Ray starts workers at niceness 15
        self.worker_id = worker_id
        self.push_timeout_s = push_timeout_s
        self.verify_kv = verify_kv
        self.handle: Any = None  # this worker's actor handle, passed with each reservation; None: Ray's
        device = device_in_this_worker(engine_config.device)
        # the loop thread is then the only one with OpenMP threads (see build_in_passing_thread)
        engine = build_in_passing_thread(lambda: LLMEngine(replace(engine_config, device=device)))
        self.block_size = engine.config.block_size
        self._admission = asyncio.Lock()  # FIFO: prefills are admitted in the order they were accepted
        self._accepted: dict[str, _Job] = {}  # event loop: accepted, not yet admitted into the engine
        self._budget = engine.scheduler.config.max_num_batched_tokens
        self._waiting_tokens = 0  # prompt tokens waiting in the engine, as of the loop thread's last look
        self._adding: dict[str, int] = {}  # admitted, not yet added by the loop thread: prompt tokens
        self._fault: str | None = None
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
        self.aengine = AsyncEngine(engine, on_step=self._on_step, on_tick=self._on_tick, on_crash=self._on_crash)
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        """This worker's description; raises while its engine loop is dead (the process is being replaced)."""
        return self.aengine.describe(self.worker_id, "prefill", self.transport.kind, self.node)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode: Any,
        reserve_timeout_s: float = 60.0,
    ) -> PrefillResult:
        """Prefill the prompt, pushing its KV into blocks reserved on ``decode`` (a DecodeWorker handle).

        The reservation is made when the prefill is admitted into this worker's engine, not before.
        Raises ``ReservationTimeout`` when the decode worker has no room for ``reserve_timeout_s``.
        """
        aio = asyncio.get_running_loop()
        job = _Job(request_id, len(prompt_token_ids), aio.create_future(), aio, accepted_at=time.time())
        if request_id in self._accepted:
            raise ValueError(f"request_id {request_id!r} is already in use on this worker")
        self._accepted[request_id] = job
        try:
            await self._admit(job, prompt_token_ids, params, decode, reserve_timeout_s)
        finally:
            self._accepted.pop(request_id, None)
            job.admitted.set()
        if job.cancelled:
            raise RuntimeError(f"request {request_id!r} aborted")
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

    async def _admit(
        self, job: _Job, prompt: list[int], params: SamplingParams, decode: Any, reserve_timeout_s: float
    ) -> None:
        if not await self._acquire_admission(job):
            return  # aborted while it queued behind earlier prompts: nothing was reserved
        try:
            while not job.cancelled and not self._admission_is_open():
                await asyncio.sleep(0.002)
            reservation, reserved_at = await self._reserve(job, prompt, params, decode, reserve_timeout_s)
            if reservation is None:
                return
            if job.cancelled:  # aborted while the reservation was made: give it back (nothing was pushed)
                await decode.abort.remote(job.request_id, True)
                return
            job.decode, job.target, job.dst_block_ids = decode, reservation.target, list(reservation.block_ids)
            job.next_block = job.next_block_at_start = reservation.num_cached_tokens // self.block_size
            job.push_deadline = reserved_at + reservation.ttl_s - self.push_timeout_s - PUSH_MARGIN_S
            first_params = dataclasses.replace(params, max_tokens=1, ignore_eos=True, stop_token_ids=())

            def add(engine: LLMEngine) -> None:
                engine.add_request(prompt, first_params, job.request_id, hold_blocks=True, detokenize=False)
                self._jobs[job.request_id] = job
                self._waiting_tokens = waiting_prompt_tokens(engine.scheduler)

            # Queued, not awaited, under the lock: while a step runs, the next prompts are admitted behind
            # this one (counted in `_adding` until the loop thread adds them) and share the next step.
            self._adding[job.request_id] = len(prompt)
            added = self.aengine.submit(add)
        finally:
            self._admission.release()
        try:
            await added
        except Exception:
            await decode.abort.remote(job.request_id, True)  # never added: nothing was pushed
            raise
        finally:
            self._adding.pop(job.request_id, None)

    async def _acquire_admission(self, job: _Job) -> bool:
        """Wait for the admission lock (FIFO) or for the job's abort, whichever comes first."""
        if job.cancelled:
            return False
        acquire = asyncio.ensure_future(self._admission.acquire())
        cancelled = asyncio.ensure_future(job.cancel_requested.wait())
        try:
            await asyncio.wait({acquire, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if acquire.done() and not acquire.cancelled():
            if not job.cancelled:
                return True
            self._admission.release()
            return False
        acquire.cancel()  # asyncio.Lock drops a cancelled waiter (and passes the lock on if it had it)
        try:
            await acquire
        except asyncio.CancelledError:
            return False
        self._admission.release()  # it was acquired before the cancel took effect
        return False

    def _own_handle(self) -> Any:
        """What the decode worker calls ``abort`` on to learn that this worker's pushes are over."""
        if self.handle is None:
            import ray

            self.handle = ray.get_runtime_context().current_actor
        return self.handle

    def _admission_is_open(self) -> bool:
        """The engine's admission rule, counting the prompts admitted but not yet added."""
        return admission_open(self._waiting_tokens + sum(self._adding.values()), self._budget)

    async def _reserve(
        self, job: _Job, prompt: list[int], params: SamplingParams, decode: Any, timeout_s: float
    ) -> tuple[Any, float]:
        """Reserve on the decode worker, retrying while it is full; (None, 0) if the job was aborted."""
        give_up = time.monotonic() + timeout_s
        delay = 0.005
        while not job.cancelled:
            reserved_at = time.monotonic()  # the TTL runs from no earlier than this, on the decode side
            # the decode worker computes no prompt position: its prefix cache may serve the whole prompt
            decode_params = replace(params, prompt_logprobs=None)
            reservation = await decode.reserve.remote(job.request_id, prompt, decode_params, self._own_handle())
            if reservation is not None:
                return reservation, reserved_at
            if time.monotonic() > give_up:
                raise ReservationTimeout(f"no KV blocks free on the decode worker for {timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return None, 0.0

    # ---- on the loop thread --------------------------------------------------------------------
    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        from pdserve.kv_transfer.base import ChunkNotification, block_checksums

        assert engine.last_output is not None
        if self._fault == "step":
            raise RuntimeError("injected engine fault")
        if self._fault == "slow_steps":
            time.sleep(0.2)
        for chunk in engine.last_output.chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.aborted is not None or job.error is not None:
                continue
            tokens_done = chunk.start + len(chunk.token_ids)
            is_last = tokens_done == job.prompt_len
            end = -(-job.prompt_len // self.block_size) if is_last else tokens_done // self.block_size
            blocks = range(job.next_block, end)
            if (not blocks and not is_last) or self._fault == "stall_pushes":
                continue  # the chunk completed no block: nothing to send yet (or pushes are made to stall)
            if time.monotonic() > job.push_deadline:
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
            job.push_started[id(handle)] = time.monotonic()
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
        self._waiting_tokens = waiting_prompt_tokens(engine.scheduler)
        now = time.monotonic()
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

    def _cancel_pushes(self, job: _Job) -> None:
        """Cancel every push of the job still in flight; those the transport cannot stop yet are retried."""
        for handle in job.handles:
            job.push_started.pop(id(handle), None)
            if not handle.cancel():
                if not job.cancelling:
                    job.cancelling_since = time.monotonic()
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
        job.cancelling_since = time.monotonic()
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

    def _teardown(self, engine: LLMEngine, job: _Job) -> None:
        """Release the job's blocks (its pushes are all over). A failed job also tells its decode worker,
        which then gives up on the reservation at once instead of at its deadline."""
        self._jobs.pop(job.request_id, None)
        if not engine.release(job.request_id):
            engine.abort(job.request_id)
        if job.error is not None and job.aborted is None and job.decode is not None:
            error = f"prefill worker {self.worker_id}: {job.error}"
            job.aio.call_soon_threadsafe(self._tell_decode, job.decode, job.request_id, error)

    def _tell_decode(self, decode: Any, request_id: str, error: str) -> None:
        """On the event loop: the request failed here and none of its pushes can land any more."""
        ref = decode.abort.remote(request_id, True, error)
        if isinstance(ref, asyncio.Future):  # an in-process stand-in for an actor handle
            self._notices.add(ref)
            ref.add_done_callback(self._notices.discard)

    # ---- control -------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Stop a request; returns once no push of it can still write into the decode worker's pool.

        Its pushes in flight are cancelled: with a transport that can cancel them that is at once. A prefill
        that was not admitted yet holds no reservation once this returns. True when the request was found.
        """
        accepted = self._accepted.get(request_id)
        if accepted is not None:
            accepted.cancelled = True
            accepted.cancel_requested.set()
            await accepted.admitted.wait()  # its reservation (if one was made meanwhile) is given back
            if request_id not in self._jobs:
                return True
        torn_down = asyncio.get_running_loop().create_future()

        def do(engine: LLMEngine) -> asyncio.Future | bool:
            job = self._jobs.get(request_id)
            if job is None:
                return engine.abort(request_id)
            job.aborted = torn_down
            job.resolve(job.first_token, error=RuntimeError(f"request {request_id!r} aborted"))
            self._cancel_pushes(job)
            if not job.cancelling:
                self._teardown(engine, job)
                return True
            return torn_down

        result = await self.aengine.run(do)
        if isinstance(result, bool):
            return result
        return await result

    async def inject_fault(self, where: str | None) -> None:
        """Fault tests: ``"step"`` makes the next step raise, ``"stall_pushes"`` stops pushing KV,
        ``"slow_steps"`` adds 200 ms to every step; None clears it."""
        self._fault = where

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        in_flight = sum(len(j.handles) + len(j.cancelling) for j in list(self._jobs.values()))
        stats = await self.aengine.stats(self.worker_id, "prefill", in_flight, self._kv_bytes, steps_since)
        return stats._replace(node=self.node, device=str(self.aengine.engine.device))

    async def check_integrity(self) -> None:
        await self.aengine.run(lambda e: e.block_manager.check_integrity())

    async def shutdown(self) -> None:
        self.aengine.close()
        self.transport.close()
