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
that its pushes for the request are over (its ``abort`` returned) or Ray reported its process dead
(``ActorDiedError``). A deadline only starts that: the stream ends with an error at once, the blocks
follow the confirmation. A transport that checks every push on arrival (gRPC) needs no confirmation:
a withdrawn reservation refuses all later writes (the check and the copy hold the transport's
``write_lock``), so its blocks are freed at once. Nothing waits forever; no block leaks.

This module loads without torch: every process that holds a handle to the actor loads its class (Ray
does, to deserialise the handle), the router and the process that built the deployment among them, and
torch would add about 0.2 GB to each. The engine and the KV transports load in the actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ray.exceptions import ActorDiedError

from pdserve.engine.async_engine import AsyncEngine, exit_process_soon, second_token_time, worker_request_stats
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import build_in_passing_thread
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import StepEvents, TokenUpdate, WorkerRequestStats, WorkerStats
from pdserve.placement import current_node, device_in_this_worker
from pdserve.priority import restore_normal_priority
from pdserve.transport_config import DEFAULT_RESERVATION_TTL_S

if TYPE_CHECKING:  # torch's modules load in the actor only: see the module's docstring
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput
    from pdserve.kv_transfer import KVTransport, TransferTarget

log = logging.getLogger(__name__)

FENCE_CALL_TIMEOUT_S = 10.0  # one attempt to hear from the prefill worker that its pushes are over
FENCE_RETRY_MAX_S = 1.0  # the longest pause between two attempts


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

    deadline: float  # time.monotonic() on this host
    reserved_at: float
    block_ids: frozenset[int]  # the blocks a push may write
    prefill: Any = None  # the prefill worker's actor handle (None: nobody pushes, e.g. a test)
    block_list: tuple[int, ...] = ()  # the reserved blocks in prompt order
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
    ) -> None:
        """``transport``: a kind for ``make_transport``, or a transport object (tests). ``verify_kv``: check
        the CRC-32 of every pushed block against the one sent with it before a request is admitted."""
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.model_runner import use_device
        from pdserve.kv_transfer import KVTransport, make_transport

        restore_normal_priority()  # Ray starts workers at niceness 15
        self.worker_id = worker_id
        self.reservation_ttl_s = reservation_ttl_s
        self.verify_kv = verify_kv
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
        # withdrawn reservations whose blocks wait for the prefill worker's confirmation (one-sided writes)
        self._releasing: dict[str, _Pending] = {}
        self._fences: set[asyncio.Task] = set()
        self.transport.set_push_filter(self._accepts_push)
        self._served: dict[str, _Served] = {}  # loop thread only
        self._kv_bytes = 0
        self._fault: str | None = None
        self.aengine = AsyncEngine(
            engine, on_step=self._on_step, on_tick=self._on_tick, on_orphans=self._on_orphans, on_crash=self._on_crash
        )
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        """This worker's description; raises while its engine loop is dead (the process is being replaced)."""
        return self.aengine.describe(self.worker_id, "decode", self.target.kind, self.node)

    async def events(self, router_id: str) -> AsyncIterator[StepEvents]:
        """The router's event stream: an empty item once subscribed, then one item per step with news."""
        async for updates in self.aengine.events(router_id):
            yield StepEvents(self.worker_id, updates)

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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill: Any = None
    ) -> ReserveResult | None:
        """Set aside blocks for the prompt's KV. None when this worker has no room now.

        ``prefill``: the actor handle of the worker that will push (its ``abort`` confirms that its pushes
        are over); None when nobody pushes into these blocks.
        """

        def do(engine: LLMEngine) -> ReserveResult | None:
            reservation = engine.reserve_remote(prompt_token_ids, params, request_id)
            if reservation is None:
                return None
            now = time.monotonic()
            blocks = tuple(reservation.block_ids)
            self._pending[request_id] = _Pending(now + self.reservation_ttl_s, now, frozenset(blocks), prefill, blocks)
            return ReserveResult(
                self.worker_id,
                self.target,
                reservation.block_ids,
                reservation.num_cached_tokens,
                self.reservation_ttl_s,
            )

        return await self.aengine.run(do)

    async def decode(self, request_id: str, first_token: int, first_token_time: float, router_id: str) -> None:
        """Decode after ``first_token`` (the router already sent it) once the KV is here; tokens go to the stream."""
        received = time.time()
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

    def _accepts_push(self, request_id: str, block_ids: list[int]) -> bool:
        """The transport's receiver threads ask (under its ``write_lock``): does the request hold these blocks?"""
        pending = self._pending.get(request_id) or self._releasing.get(request_id)
        return pending is not None and pending.block_ids.issuperset(block_ids)

    def _on_tick(self, engine: LLMEngine) -> None:
        for note in self.transport.poll_notifications():
            pending = self._pending.get(note.request_id)
            if pending is None:
                continue  # a late push for a request that is gone
            pending.pushes_seen.add(note.chunk_index)
            if note.block_checksums:
                pending.checksums[note.first_block] = note.block_checksums
            if note.is_last:
                pending.last_push = note.chunk_index
            self._admit_if_ready(engine, note.request_id, pending)
        if self._pending:
            now = time.monotonic()
            for request_id, pending in list(self._pending.items()):
                if now > pending.deadline:
                    log.warning("%s: KV for %s did not arrive in time; withdrawing it", self.worker_id, request_id)
                    self._withdraw(engine, request_id, error="KV transfer deadline passed")

    def _withdraw(
        self, engine: LLMEngine, request_id: str, error: str | None = None, pushes_over: bool = False
    ) -> None:
        """Give up on a reservation: end its stream now; free its blocks once no push can still land.

        ``pushes_over``: the caller knows that nothing was or will be pushed (the prefill worker itself).
        """
        with self.transport.write_lock:  # after this, a checking transport writes nothing more of it
            pending = self._pending.pop(request_id)
            fence = not pushes_over and pending.prefill is not None and not self.transport.checks_pushes
            if fence:
                self._releasing[request_id] = pending
        self._end(request_id, error=error)
        if not fence:
            engine.abort(request_id)
            return
        self.aengine.call_soon(lambda: self._start_fence(request_id, pending))

    def _start_fence(self, request_id: str, pending: _Pending) -> None:
        task = asyncio.ensure_future(self._fence(request_id, pending))
        self._fences.add(task)
        task.add_done_callback(self._fences.discard)

    async def _fence(self, request_id: str, pending: _Pending) -> None:
        """Wait until the prefill worker confirms its pushes of the request are over, or is dead; then free."""
        delay = 0.05
        while True:
            try:
                await asyncio.wait_for(pending.prefill.abort.remote(request_id), FENCE_CALL_TIMEOUT_S)
                break
            except ActorDiedError:
                break  # a dead process writes nothing more
            except Exception as e:  # unavailable, slow or restarting: maybe alive, maybe still pushing
                log.warning("%s: %s: no confirmation from its prefill worker yet (%r)", self.worker_id, request_id, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, FENCE_RETRY_MAX_S)
        await self.aengine.run(lambda engine: self._free_released(engine, request_id, pending))

    def _free_released(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        with self.transport.write_lock:
            if self._releasing.get(request_id) is not pending:
                return  # freed already
            del self._releasing[request_id]
        engine.abort(request_id)

    def _admit_if_ready(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        if pending.last_push is None or len(pending.pushes_seen) < pending.last_push + 1:
            return
        if pending.kv_done_at is None:
            pending.kv_done_at = time.time()
        if pending.first_token is None:
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
        if self._fault == "step":
            raise RuntimeError("injected engine fault")
        self.aengine.publish([self._update(out) for out in outputs])

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
        if request_id in self._pending:
            self._withdraw(engine, request_id, error=error, pushes_over=pushes_over)
            return True
        releasing = self._releasing.get(request_id)
        if releasing is not None:
            if pushes_over:  # the prefill worker itself says its pushes are over: no need to wait for the fence
                self._free_released(engine, request_id, releasing)
            return True
        found = engine.abort(request_id)
        if found:
            self._end(request_id, error=error)
        return found

    def _on_orphans(self, request_ids: list[str]) -> None:
        log.warning("%s: the router went away; stopping its %d requests", self.worker_id, len(request_ids))
        self.aengine.loop.call(lambda e: [self._abort_on_loop(e, rid) for rid in request_ids])

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        remote = len(self._pending) + len(self._releasing)
        stats = await self.aengine.stats(self.worker_id, "decode", remote, self._kv_bytes, steps_since)
        return stats._replace(
            node=self.node, device=str(self.aengine.engine.device), kv_pushes_refused=self.transport.num_pushes_refused
        )

    async def transfer_target(self) -> TransferTarget:
        """Where prefill workers push this worker's KV: the target every reservation of it carries (for gRPC,
        the ``host:port`` its KV server listens on)."""
        return self.target

    async def receiver_id(self) -> str:
        """The id of this process's KV receiver: a prefill worker whose pushes went to another id knows that
        the process they were written into is gone."""
        return self.target.target_id

    async def inject_fault(self, where: str = "step") -> None:
        """Fault tests: the next step raises inside the engine loop (as a bug or a device error would)."""
        self._fault = where

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
