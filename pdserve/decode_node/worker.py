"""The decode worker: a Ray actor that decodes, prefills locally, and accepts KV pushed by prefill workers.

Colocated requests (``generate``) run chunked prefill and decode in this worker's continuous batch.
Disaggregated requests go ``reserve`` → (a prefill worker pushes KV into the reserved blocks, one
notification per push) → ``decode(first_token)``; the request joins the running batch once every
push has landed and the first token is known.

Starting, reserving and aborting are actor calls that return at once. Tokens travel on one event
stream per router (``events(router_id)``): after each step, one item with every new token of that
router's requests on this worker, and on a request's last update how it ended and its statistics.

Blocks reserved for remote KV belong to this worker until the request ends, and return to the pool
only when no write to them can still land: after the final push has landed; or, once the reservation
is withdrawn (aborted, its router gone, or its deadline passed), after the prefill worker confirmed
that its pushes for the request are over (its ``abort`` answered True: the transport reported every
push done or failed) or Ray reported its process dead (``ActorDiedError``) and this worker's receiver
drained for ``RECEIVER_DRAIN_S``. Meanwhile they wait in a quarantine that ``stats`` counts. A deadline
only starts that: the stream ends with an error at once, the blocks follow the confirmation. A transport
that checks every push on arrival (gRPC) needs no confirmation: a withdrawn reservation refuses all later
writes (the check and the copy hold the transport's ``write_lock``), so its blocks are freed at once.
A reservation is claimed for its router's event stream when it is made, and takes pushes and
notifications from the sender it was made for, into its own blocks only (never its shared cached prefix).
Nothing waits forever; no block leaks.

This module loads without torch: every process that holds a handle to the actor loads its class (Ray
does, to deserialise the handle), the router and the process that built the deployment among them, and
torch would add about 0.2 GB to each. The engine and the KV transports load in the actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ray.exceptions import ActorDiedError

from pdserve.engine.async_engine import (
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    AsyncEngine,
    exit_process_soon,
    second_token_time,
    worker_request_stats,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import build_in_passing_thread
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.faults import NO_FAULTS, FaultPlan
from pdserve.messages import StepEvents, TokenUpdate, WorkerRequestStats, WorkerStats
from pdserve.placement import current_node, device_in_this_worker
from pdserve.priority import restore_normal_priority
from pdserve.transport_config import DEFAULT_RESERVATION_TTL_S

if TYPE_CHECKING:  # torch's modules load in the actor only: see the module's docstring
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput
    from pdserve.kv_transfer import KVTransport, TransferTarget

log = logging.getLogger(__name__)

FENCE_WAIT_S = 10.0  # each abort call asks the prefill worker to answer within this, confirmed or not
FENCE_CALL_SLACK_S = 5.0  # ... and an answer later than that counts as none (the same call is awaited on)
FENCE_RETRY_MAX_S = 1.0  # the longest pause between two calls
# After Ray reports the pushing process dead, bytes of its one-sided writes already on their way (queued in
# sockets) still land while this worker's receiver makes progress: its blocks wait this long more.
RECEIVER_DRAIN_S = 1.0
ROUTER_PROBE_S = 1.0  # how often a subscribed router is asked whether it lives
ROUTER_PROBE_TIMEOUT_S = 10.0


class ReserveResult(NamedTuple):
    """Where a prefill worker must write a request's KV."""

    worker_id: str
    target: TransferTarget
    block_ids: list[int]  # one per prompt block, in order (cached ones included: they need no push)
    num_cached_tokens: int  # leading prompt tokens already here (their blocks need no transfer)
    ttl_s: float  # the reservation is dropped this long after it was made, unless all its KV arrived


class ReservationGone(LookupError):
    """``decode`` found no reservation: it expired (its KV did not arrive in time) or was aborted."""


class KVIntegrityError(RuntimeError):
    """With ``verify_kv``: a block's checksum on arrival differs from what the prefill worker sent."""


@dataclass
class _Pending:
    """A reservation waiting for its KV and its first token."""

    deadline: float  # the worker's clock
    reserved_at: float
    block_ids: frozenset[int]  # the blocks a push may write: the reservation's own (never its cached prefix)
    prefill: Any = None  # the prefill worker's actor handle (None: nobody pushes, e.g. a test)
    block_list: tuple[int, ...] = ()  # the reserved blocks in prompt order (the cached prefix included)
    sender: str = ""  # the pushing transport's sender id: notifications from anyone else are refused
    written: set[int] = field(default_factory=set)  # blocks written so far (transports that see every write)
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)  # first block index -> CRC-32s
    first_token: int | None = None
    first_token_time: float | None = None
    pushes_seen: set[int] = field(default_factory=set)
    last_push: int | None = None  # chunk_index of the push marked is_last
    kv_done_at: float | None = None
    decode_called_at: float = 0.0  # unix time the decode call arrived


class _Served(NamedTuple):
    """A request this worker streams: the engine's record, and what it measured of a remote KV."""

    request: Request
    remote_kv: WorkerRequestStats | None  # None for a request this worker prefilled itself
    call_time: float = 0.0  # unix time its call arrived (generate, or decode after a remote prefill)


class DecodeWorker:
    """A Ray actor (async). Construct through ``ray.remote(DecodeWorker)``; await ``ready()``."""

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transport: str | KVTransport = "nixl",
        transport_config: Any = None,
        reservation_ttl_s: float = DEFAULT_RESERVATION_TTL_S,
        verify_kv: bool = False,
        *,
        engine_stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
        faults: FaultPlan = NO_FAULTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``transport``: a kind for ``make_transport``, or a transport object (tests). ``verify_kv``: check
        the CRC-32 of every pushed block against the one sent with it before a request is admitted, and of
        every block freed after a withdrawn reservation before it is reused. ``engine_stall_timeout_s``: the
        engine loop stuck this long counts as hung (see ``AsyncEngine``). ``faults``: faults to inject (tests).
        ``clock``: the monotonic clock of reservation deadlines."""
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.model_runner import use_device
        from pdserve.kv_transfer import KVTransport, make_transport

        restore_normal_priority()  # Ray starts workers at niceness 15
        self.worker_id = worker_id
        self.reservation_ttl_s = reservation_ttl_s
        self.verify_kv = verify_kv
        self.faults = faults
        self._clock = clock
        device = device_in_this_worker(engine_config.device)
        # the loop thread is then the only one with OpenMP threads (see build_in_passing_thread)
        engine = build_in_passing_thread(lambda: LLMEngine(replace(engine_config, device=device)))
        use_device(engine.device)  # a CUDA context on this thread before the NIXL agent brings up UCX
        self.transport = (
            transport if isinstance(transport, KVTransport) else make_transport(transport, transport_config)
        )
        self.transport.register_pool(engine.kv_cache, engine.kv_compatibility)
        self.target = self.transport.describe()
        # written on the loop thread only; the transport's receiver threads read it: pushes outside a
        # live reservation are refused (gRPC; NIXL's one-sided writes cannot be checked on arrival)
        self._pending: dict[str, _Pending] = {}
        # Quarantine: withdrawn reservations whose blocks a one-sided write may still reach; they stay out of
        # the pool until the prefill worker confirms that its pushes are over (or is dead and drained).
        self._quarantine: dict[str, _Pending] = {}
        self._fences: set[asyncio.Task] = set()
        self._streams: dict[str, object] = {}  # router id -> its current event stream (event loop)
        self.transport.set_push_filter(self._accepts_push)
        self._served: dict[str, _Served] = {}  # loop thread only
        self._kv_bytes = 0
        # with verify_kv: blocks freed out of quarantine -> their CRC-32 then, checked when they are reused
        self._freed_checksums: dict[int, int] = {}
        self.num_late_writes = 0  # freed blocks found changed before their reuse (a write landed after the free)
        self.num_notifications_refused = 0  # from a sender other than the reservation's
        if verify_kv:
            engine.block_manager.on_reuse = self._check_freed_block
        self.aengine = AsyncEngine(
            engine,
            on_step=self._on_step,
            on_tick=self._on_tick,
            on_orphans=self._on_orphans,
            on_crash=self._on_crash,
            stall_timeout_s=engine_stall_timeout_s,
            on_stall=self._on_stall,
        )
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        """This worker's description; raises while its engine loop is dead (the process is being replaced) or
        stalled (``EngineStalled``)."""
        return self.aengine.describe(self.worker_id, "decode", self.target.kind, self.node)

    async def events(self, router_id: str, router: Any = None) -> AsyncIterator[StepEvents]:
        """The router's event stream: an empty item once subscribed, then one item per step with news, and a
        heartbeat while idle. Every item says whether the engine loop is stalled (the router then counts this
        worker as hung).

        ``router``: the router's actor handle. Ray does not end a stream whose reader's process died, so this
        worker asks the router ``alive()`` every ``ROUTER_PROBE_S``; once Ray reports it dead, the stream ends
        and the router's requests (its reservations included) are stopped.
        """
        stream = self._streams[router_id] = object()  # a later subscription under the same id replaces this one
        watch = asyncio.ensure_future(self._watch_router(router_id, router, stream)) if router is not None else None
        try:
            async for updates in self.aengine.events(router_id):
                yield StepEvents(self.worker_id, updates, self.aengine.stalled() or "")
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch_router(self, router_id: str, router: Any, stream: object) -> None:
        while True:
            await asyncio.sleep(ROUTER_PROBE_S)
            try:
                await asyncio.wait_for(_awaited(router.alive.remote()), ROUTER_PROBE_TIMEOUT_S)
            except ActorDiedError:
                if self._streams.get(router_id) is stream:  # not replaced by a new router under the same id
                    log.warning("%s: router %s is dead; ending its event stream", self.worker_id, router_id)
                    self.aengine.unsubscribe(router_id)
                return
            except Exception:  # slow, or unreachable for now: only Ray's word that it died ends the stream
                continue

    # ---- colocated: prefill and decode here ----------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, router_id: str
    ) -> None:
        """Start a request that this worker prefills and decodes; its tokens go to ``router_id``'s stream."""
        received = time.time()
        self.aengine.claim(request_id, router_id)
        try:
            await self.aengine.run(lambda e: self._add_local(e, request_id, prompt_token_ids, params, received))
        except Exception:
            self.aengine.unclaim(request_id)
            raise

    def _add_local(
        self, engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, received: float
    ) -> None:
        engine.add_request(prompt, params, request_id, detokenize=False)  # the router detokenizes
        self._served[request_id] = _Served(engine.get_request(request_id), None, received)  # type: ignore[arg-type]

    # ---- disaggregated: KV comes from a prefill worker -----------------------------------------
    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: Any = None,
        router_id: str = "",
        sender: str = "",
    ) -> ReserveResult | None:
        """Set aside blocks for the prompt's KV. None when this worker has no room now.

        ``prefill``: the actor handle of the worker that will push (its ``abort`` confirms that its pushes
        are over); None when nobody pushes into these blocks. ``router_id``: the router serving the request:
        the reservation is claimed for its event stream at once, so that what becomes of it (a passed
        deadline) reaches the router before the first token does, and the router's going away withdraws it.
        ``sender``: the pushing transport's ``sender_id``; notifications of the request from any other sender
        are refused. Raises ``NotSubscribed`` when that router is not subscribed here (gone: nobody would read
        the request).
        """
        if router_id:
            self.aengine.claim(request_id, router_id)

        def do(engine: LLMEngine) -> ReserveResult | None:
            reservation = engine.reserve_remote(prompt_token_ids, params, request_id)
            if reservation is None:
                return None
            now = self._clock()
            blocks = tuple(reservation.block_ids)
            own = frozenset(blocks[reservation.num_cached_tokens // engine.config.block_size :])
            self._pending[request_id] = _Pending(now + self.reservation_ttl_s, now, own, prefill, blocks, sender)
            return ReserveResult(
                self.worker_id,
                self.target,
                reservation.block_ids,
                reservation.num_cached_tokens,
                self.reservation_ttl_s,
            )

        try:
            result = await self.aengine.run(do)
        except BaseException:
            self.aengine.unclaim(request_id)
            raise
        if result is None:
            self.aengine.unclaim(request_id)
        return result

    async def decode(self, request_id: str, first_token: int, first_token_time: float, router_id: str) -> None:
        """Decode after ``first_token`` (the router already sent it) once the KV is here; tokens go to the stream."""
        received = time.time()
        if self.aengine.owner(request_id) != router_id:  # claimed already when its reservation was made
            self.aengine.claim(request_id, router_id)

        def do(engine: LLMEngine) -> None:
            pending = self._pending.get(request_id)
            if pending is None:
                raise ReservationGone(
                    f"request {request_id!r} has no live reservation on {self.worker_id} "
                    "(never reserved, aborted, or its KV deadline passed)"
                )
            pending.first_token, pending.first_token_time = first_token, first_token_time
            pending.decode_called_at = received
            self._admit_if_ready(engine, request_id, pending)

        try:
            await self.aengine.run(do)
        except Exception:
            self.aengine.unclaim(request_id)
            raise

    def _accepts_push(self, request_id: str, block_ids: list[int], sender: str) -> bool:
        """The transport's receiver threads ask (under its ``write_lock``, which it holds on through the write):
        are these blocks the request's own reserved blocks (not its shared cached prefix, which other requests
        read), and is ``sender`` the one its reservation was made for? An empty list asks whether the request
        has a reservation here at all."""
        pending = self._pending.get(request_id) or self._quarantine.get(request_id)
        if pending is None or not pending.block_ids.issuperset(block_ids):
            return False
        if pending.sender and sender != pending.sender:
            return False
        pending.written.update(block_ids)
        return True

    def _on_tick(self, engine: LLMEngine) -> None:
        for note in self.transport.poll_notifications():
            pending = self._pending.get(note.request_id)
            if pending is None:
                continue  # a late push for a request that is gone
            if pending.sender and note.sender != pending.sender:
                self.num_notifications_refused += 1
                log.warning(
                    "%s: refused a notification of %s from %r: its reservation was made for %r",
                    self.worker_id,
                    note.request_id,
                    note.sender,
                    pending.sender,
                )
                continue
            pending.pushes_seen.add(note.chunk_index)
            if note.block_checksums:
                pending.checksums[note.first_block] = note.block_checksums
            if note.is_last:
                pending.last_push = note.chunk_index
            self._admit_if_ready(engine, note.request_id, pending)
        if self._pending:
            now = self._clock()
            for request_id, pending in list(self._pending.items()):
                if now > pending.deadline:
                    log.warning("%s: KV for %s did not arrive in time; withdrawing it", self.worker_id, request_id)
                    self._withdraw(engine, request_id, error="KV transfer deadline passed")

    def _withdraw(
        self,
        engine: LLMEngine,
        request_id: str,
        error: str | None = None,
        pushes_over: bool = False,
        tell_router: bool = True,
    ) -> None:
        """Give up on a reservation: end its stream now; free its blocks once no push can still land.

        ``pushes_over``: the caller knows that nothing was or will be pushed (the prefill worker itself).
        Otherwise, with one-sided writes, the blocks go into quarantine until the prefill worker confirms.
        ``tell_router``: end the request's stream (with ``error``); else only let go of its claim.
        """
        with self.transport.write_lock:  # after this, a checking transport writes nothing more of it
            pending = self._pending.pop(request_id)
            fence = not pushes_over and pending.prefill is not None and not self.transport.checks_pushes
            if fence:
                self._quarantine[request_id] = pending
        if tell_router:
            self._end(request_id, error=error)
        else:
            self.aengine.call_soon(lambda: self.aengine.unclaim(request_id))
        if not fence:
            engine.abort(request_id)
            return
        self.aengine.call_soon(lambda: self._start_fence(request_id, pending))

    def _start_fence(self, request_id: str, pending: _Pending) -> None:
        task = asyncio.ensure_future(self._fence(request_id, pending))
        self._fences.add(task)
        task.add_done_callback(self._fences.discard)

    async def _fence(self, request_id: str, pending: _Pending) -> None:
        """Free a quarantined reservation's blocks once no push of it can still land: the prefill worker
        confirms that its pushes are over, or Ray reports its process dead and this worker's receiver has
        drained what was already on its way (``RECEIVER_DRAIN_S``). Nothing else frees them: a prefill worker
        that is unreachable, hung, or cannot get a transfer cancelled keeps them in quarantine.

        One abort call is out at a time: a call that gets no answer is awaited on, not repeated, so a
        stopped process does not collect a queue of them.
        """
        delay = 0.05
        call: asyncio.Future | None = None
        warned = False
        while True:
            if call is None:
                call = asyncio.ensure_future(_awaited(pending.prefill.abort.remote(request_id, FENCE_WAIT_S)))
                call.add_done_callback(_read_failure)
            done, _ = await asyncio.wait({call}, timeout=FENCE_WAIT_S + FENCE_CALL_SLACK_S)
            if not done:
                if not warned:
                    log.warning(
                        "%s: %s: its prefill worker does not answer; blocks stay in quarantine",
                        self.worker_id,
                        request_id,
                    )
                    warned = True
                continue
            answered, call = call, None
            try:
                if answered.result():
                    break
            except ActorDiedError:
                await asyncio.sleep(RECEIVER_DRAIN_S)  # the engine loop's ticks keep the receiver progressing
                break
            except Exception as e:  # unavailable or restarting: maybe alive, maybe still pushing
                if not warned:
                    log.warning(
                        "%s: %s: no confirmation from its prefill worker yet (%r)", self.worker_id, request_id, e
                    )
                    warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, FENCE_RETRY_MAX_S)
        await self.aengine.run(lambda engine: self._free_quarantined(engine, request_id, pending))

    def _free_quarantined(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        with self.transport.write_lock:
            if self._quarantine.get(request_id) is not pending:
                return  # freed already
            del self._quarantine[request_id]
        if self.verify_kv:  # a write that still lands before a block's reuse is caught then
            from pdserve.kv_transfer.base import block_checksums

            own = sorted(pending.block_ids)
            self._freed_checksums.update(zip(own, block_checksums(engine.kv_cache, own), strict=True))
        engine.abort(request_id)

    def _check_freed_block(self, block_id: int) -> None:
        """Loop thread, with ``verify_kv``: the block manager hands out ``block_id``; if it left quarantine, its
        bytes must be those it was freed with."""
        freed = self._freed_checksums.pop(block_id, None)
        if freed is None:
            return
        from pdserve.kv_transfer.base import block_checksums

        (now,) = block_checksums(self.aengine.engine.kv_cache, [block_id])
        if now != freed:
            self.num_late_writes += 1
            log.error(
                "%s: KV integrity check failed: block %d changed after it was freed (CRC-32 %08x, freed with %08x): "
                "a write landed after its reservation was released",
                self.worker_id,
                block_id,
                now,
                freed,
            )

    def _admit_if_ready(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        if pending.last_push is None or len(pending.pushes_seen) < pending.last_push + 1:
            return
        if pending.kv_done_at is None:
            pending.kv_done_at = time.time()
        if pending.first_token is None:
            return
        if self.transport.checks_pushes and pending.written != pending.block_ids:
            missing = len(pending.block_ids - pending.written)
            error = f"KV incomplete: its last push arrived with {missing} of {len(pending.block_ids)} blocks unwritten"
            log.error("%s: %s: %s", self.worker_id, request_id, error)
            self._withdraw(engine, request_id, error=error, pushes_over=True)
            return
        if self.verify_kv:
            mismatch = self._verify(engine, request_id, pending)
            if mismatch is not None:  # every push has landed: nothing can write these blocks any more
                log.error("%s: %s: %s", self.worker_id, request_id, mismatch)
                self._withdraw(engine, request_id, error=f"KV integrity check failed: {mismatch}", pushes_over=True)
                return
        del self._pending[request_id]
        request = engine.get_request(request_id)
        assert request is not None
        pushed_blocks = len(request.block_ids) - request.num_cached_tokens // engine.config.block_size
        kv_bytes = pushed_blocks * self.target.block_bytes
        self._kv_bytes += kv_bytes
        exposed = max(0.0, pending.kv_done_at - (pending.first_token_time or pending.kv_done_at))
        remote_kv = WorkerRequestStats(kv_transfer_s=exposed, kv_transfer_bytes=kv_bytes)
        self._served[request_id] = _Served(request, remote_kv, pending.decode_called_at)
        final = engine.admit_remote(request_id, pending.first_token)
        if final is not None:  # the first token already ended it (EOS, stop token, max_tokens=1)
            self.aengine.publish([self._update(final)])

    def _verify(self, engine: LLMEngine, request_id: str, pending: _Pending) -> str | None:
        """None when every pushed block matches its checksum, else what does not."""
        from pdserve.kv_transfer.base import block_checksums

        request = engine.get_request(request_id)
        assert request is not None
        pushed = len(pending.block_list) - request.num_cached_tokens // engine.config.block_size
        summed = sum(len(sums) for sums in pending.checksums.values())
        if summed != pushed:
            return f"{summed} block checksums arrived for {pushed} pushed blocks (is the prefill side verifying?)"
        for first, sums in sorted(pending.checksums.items()):
            ids = pending.block_list[first : first + len(sums)]
            if len(ids) != len(sums):
                return f"checksums for blocks {first}..{first + len(sums) - 1} but {len(pending.block_list)} reserved"
            got = block_checksums(engine.kv_cache, ids)
            for k, (want, have) in enumerate(zip(sums, got, strict=True)):
                if want != have:
                    return f"block {first + k} (pool block {ids[k]}): CRC-32 {have:08x} on arrival, {want:08x} sent"
        return None

    # ---- streaming (loop thread) -----------------------------------------------------------------
    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        if self.faults.any:
            self.faults = self.faults.after_step()
        self.aengine.publish([self._update(out) for out in outputs])

    def _on_stall(self, why: str) -> None:
        """Event loop: the engine loop is stuck. Every request streaming from here fails now (UNAVAILABLE, naming
        this worker); its heartbeats say so, so the router routes nothing here until the loop turns again."""
        self.aengine.fail_all(f"decode worker {self.worker_id} is hung: {why}")

    def _on_crash(self, error: BaseException) -> None:
        """The engine loop died: fail every request now, then exit so that Ray starts a fresh worker."""
        self.aengine.fail_all(f"decode worker {self.worker_id} failed: {error!r}")
        exit_process_soon(self.worker_id)

    def _update(self, out: RequestOutput) -> TokenUpdate:
        logprobs = [(lp.logprob, lp.top) for lp in out.logprobs] if out.logprobs is not None else None
        prompt_logprobs = out.prompt_logprobs
        if not out.finished:
            return TokenUpdate(out.request_id, out.new_token_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        reason = out.finish_reason.value if out.finish_reason else "abort"
        stats = self._final_stats(out.request_id)
        return TokenUpdate(out.request_id, out.new_token_ids, reason, None, stats, logprobs, prompt_logprobs)

    def _final_stats(self, request_id: str) -> WorkerRequestStats | None:
        served = self._served.pop(request_id, None)
        if served is None:
            return None
        request, remote_kv, call_time = served
        if remote_kv is None:
            return worker_request_stats(request, call_time=call_time)
        return remote_kv._replace(
            num_cached_tokens=request.num_cached_tokens,
            second_token_time=second_token_time(request),
            call_time=call_time,
        )

    def _end(self, request_id: str, error: str | None = None) -> None:
        self._served.pop(request_id, None)
        self.aengine.publish([TokenUpdate(request_id, [], "abort", error=error)])

    # ---- control -------------------------------------------------------------------------------
    async def abort(self, request_id: str, pushes_over: bool = False, error: str | None = None) -> bool:
        """Stop a request (running, waiting, or reserved) and free its blocks; its stream ends (with ``error``).

        A reservation's blocks are freed once no push can still land (see the module docstring);
        ``pushes_over``: the caller (the prefill worker) knows that none was made or can still land.
        """
        found = await self.aengine.run(lambda e: self._abort_on_loop(e, request_id, pushes_over, error))
        if not found:
            self.aengine.unclaim(request_id)
        return found

    def _abort_on_loop(
        self, engine: LLMEngine, request_id: str, pushes_over: bool = False, error: str | None = None
    ) -> bool:
        pending = self._pending.get(request_id)
        if pending is not None:
            # The prefill worker giving up on it before the first token: its own answer to the router says why
            # (and the router may prefill locally instead); after it, only this stream can tell the router.
            tell_router = not pushes_over or pending.first_token is not None
            self._withdraw(engine, request_id, error=error, pushes_over=pushes_over, tell_router=tell_router)
            return True
        quarantined = self._quarantine.get(request_id)
        if quarantined is not None:
            if pushes_over:  # the prefill worker itself says its pushes are over: no need to wait for the fence
                self._free_quarantined(engine, request_id, quarantined)
            return True
        found = engine.abort(request_id)
        if found:
            self._end(request_id, error=error)
        return found

    def _on_orphans(self, request_ids: list[str]) -> None:
        log.warning("%s: the router went away; stopping its %d requests", self.worker_id, len(request_ids))
        self.aengine.loop.call(lambda e: [self._abort_on_loop(e, rid) for rid in request_ids])

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        remote = len(self._pending) + len(self._quarantine)
        stats = await self.aengine.stats(self.worker_id, "decode", remote, self._kv_bytes, steps_since)
        return stats._replace(
            node=self.node,
            device=str(self.aengine.engine.device),
            kv_pushes_refused=self.transport.num_pushes_refused + self.num_notifications_refused,
            kv_blocks_quarantined=sum(len(q.block_ids) for q in list(self._quarantine.values())),
            kv_late_writes=self.num_late_writes,
        )

    async def transfer_target(self) -> TransferTarget:
        """Where prefill workers push this worker's KV: the target every reservation of it carries (for gRPC,
        the ``host:port`` its KV server listens on)."""
        return self.target

    async def receiver_id(self) -> str:
        """The id of this process's KV receiver: a prefill worker whose pushes went to another id knows that
        the process they were written into is gone."""
        return self.target.target_id

    async def set_fault_plan(self, faults: FaultPlan) -> None:
        """Fault tests: inject ``faults`` from the next step on (``NO_FAULTS`` clears them)."""
        self.faults = faults

    async def check_integrity(self) -> None:
        await self.aengine.run(lambda e: e.block_manager.check_integrity())

    async def cached_prompt_kv(self, prompt_token_ids: list[int]) -> Any:
        """Test hook: K/V of the prompt's leading full blocks found in this worker's prefix cache."""
        from pdserve.engine.model_runner import gather_kv

        def do(engine: LLMEngine):
            probe = Request("probe", prompt_token_ids, SamplingParams())
            hit = engine.block_manager.find_prefix_hit(probe)
            return gather_kv(engine.kv_cache, hit.block_ids, hit.num_tokens) if hit.block_ids else None

        return await self.aengine.run(do)

    async def shutdown(self) -> None:
        self.aengine.close()
        self.transport.close()


async def _awaited(ref: Any) -> Any:
    """An actor call's result (an ``ObjectRef``, or a future from an in-process stand-in) as a coroutine."""
    return await ref


def _read_failure(future: asyncio.Future) -> None:
    """Read a dropped future's failure, so that it is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()
