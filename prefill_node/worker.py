"""The prefill worker: a Ray actor that runs chunked prefill and pushes each chunk's KV to a decode worker.

Many requests share a step under this worker's own token budget. After every step, the blocks that
the step completed (and, with the prompt's last chunk, its partially filled last block) are pushed
to the request's decode worker with a notification (request id, push index, tokens done, is last).
The last chunk also samples the first token, which goes back to the router at once — that is the
TTFT the client sees — while the last push is still in flight. The request's blocks stay held here
until its pushes have completed; then they are released into this worker's prefix cache.

Only prompts run here (every request stops after its first token), so this engine never decodes and
therefore never preempts: a block that a push reads cannot be taken away under it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, WorkerStats, request_timings
from pdserve.engine.llm_engine import RequestOutput
from pdserve.kv_transfer import ChunkNotification, KVTransferError, PushHandle, TransferTarget, make_transport

from pdserve.placement import current_node

log = logging.getLogger(__name__)

PUSH_DEADLINE_MARGIN_S = 5.0  # stop pushing this long before the decode side drops the reservation


class PrefillResult(NamedTuple):
    worker_id: str
    first_token: int
    first_token_time: float
    queue_s: float
    prefill_s: float
    num_cached_tokens: int  # prompt tokens found in this worker's own prefix cache
    num_pushes: int  # pushes issued so far (the last one may still be in flight)


@dataclass
class _Job:
    request_id: str
    target: TransferTarget
    dst_block_ids: list[int]
    prompt_len: int
    deadline: float
    first_token: asyncio.Future
    aio: asyncio.AbstractEventLoop
    next_block: int  # first block index not yet pushed (blocks cached on the decode side are skipped)
    push_index: int = 0
    handles: list[PushHandle] = field(default_factory=list)
    last_pushed: bool = False
    aborted: asyncio.Future | None = None  # set by abort(): resolved once the job is torn down
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
        self, worker_id: str, engine_config: EngineConfig, transport: str = "nixl", transport_config: Any = None
    ) -> None:
        self.worker_id = worker_id
        engine = LLMEngine(engine_config)
        self.block_size = engine.config.block_size
        self.transport = make_transport(transport, transport_config)
        self.transport.register_pool(engine.kv_cache)
        self._jobs: dict[str, _Job] = {}  # touched on the loop thread only (after creation)
        self._kv_bytes = 0
        self._num_pushes = 0
        self.aengine = AsyncEngine(engine, on_step=self._on_step, on_tick=self._on_tick)
        self.node = current_node()  # where Ray placed this worker, for ready() and stats()

    async def ready(self) -> dict[str, Any]:
        engine = self.aengine.engine
        return {
            "worker_id": self.worker_id,
            "role": "prefill",
            "node": self.node,
            "num_blocks": engine.block_manager.num_blocks,
            "block_size": self.block_size,
            "device": str(engine.device),
            "transport": self.transport.kind,
        }

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        target: TransferTarget,
        dst_block_ids: list[int],
        num_cached_tokens: int,
        deadline: float,
    ) -> PrefillResult:
        """Prefill the prompt, pushing its KV into ``dst_block_ids`` on ``target``; return the first token.

        ``num_cached_tokens`` leading tokens are already on the decode side: their blocks are not pushed.
        """
        num_blocks = -(-len(prompt_token_ids) // self.block_size)
        if len(dst_block_ids) != num_blocks:
            raise ValueError(
                f"dst_block_ids has {len(dst_block_ids)} ids for a {len(prompt_token_ids)}-token "
                f"prompt ({num_blocks} blocks of {self.block_size})"
            )
        if num_cached_tokens % self.block_size or not 0 <= num_cached_tokens < len(prompt_token_ids):
            raise ValueError(f"num_cached_tokens must be whole blocks below the prompt length, got {num_cached_tokens}")
        aio = asyncio.get_running_loop()
        job = _Job(
            request_id,
            target,
            list(dst_block_ids),
            len(prompt_token_ids),
            deadline,
            aio.create_future(),
            aio,
            next_block=num_cached_tokens // self.block_size,
        )
        first_params = dataclasses.replace(params, max_tokens=1, ignore_eos=True, stop_token_ids=())

        def add(engine: LLMEngine) -> None:
            engine.add_request(prompt_token_ids, first_params, request_id, hold_blocks=True, detokenize=False)
            self._jobs[request_id] = job

        await self.aengine.run(add)
        first_token, first_time, timings = await job.first_token
        return PrefillResult(
            self.worker_id,
            first_token,
            first_time,
            timings["queue_s"],
            timings["prefill_s"],
            timings["num_cached_tokens"],
            job.push_index,
        )

    # ---- on the loop thread --------------------------------------------------------------------
    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        assert engine.last_output is not None
        for chunk in engine.last_output.chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.aborted is not None or job.error is not None:
                continue
            tokens_done = chunk.start + len(chunk.token_ids)
            is_last = tokens_done == job.prompt_len
            end = -(-job.prompt_len // self.block_size) if is_last else tokens_done // self.block_size
            blocks = range(job.next_block, end)
            if not blocks and not is_last:
                continue  # the chunk completed no block: nothing to send yet
            if time.time() > job.deadline - PUSH_DEADLINE_MARGIN_S:
                self._fail(engine, job, "the decode worker's reservation deadline is too close")
                continue
            note = ChunkNotification(job.request_id, job.push_index, tokens_done, is_last)
            try:
                handle = self.transport.push(
                    job.target, [chunk.block_ids[i] for i in blocks], [job.dst_block_ids[i] for i in blocks], note
                )
            except (ValueError, KVTransferError) as e:
                self._fail(engine, job, f"KV push failed: {e}")
                continue
            job.handles.append(handle)
            job.next_block, job.push_index, job.last_pushed = end, job.push_index + 1, is_last
            self._kv_bytes += handle.num_bytes
            self._num_pushes += 1
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is not None and out.new_token_ids and job.error is None:
                request = engine.get_request(out.request_id)
                timings = request_timings(request)  # type: ignore[arg-type]
                job.resolve(job.first_token, (out.new_token_ids[0], timings["first_token_time"], timings))

    def _on_tick(self, engine: LLMEngine) -> None:
        for job in list(self._jobs.values()):
            try:
                job.handles = [h for h in job.handles if not h.done()]
            except KVTransferError as e:
                self._fail(engine, job, f"KV push failed: {e}")
                continue
            if job.handles:
                continue
            if job.aborted is not None:
                self._teardown(engine, job)
                job.resolve(job.aborted, True)
            elif job.last_pushed:
                self._teardown(engine, job)

    def _fail(self, engine: LLMEngine, job: _Job, error: str) -> None:
        log.warning("%s: request %s: %s", self.worker_id, job.request_id, error)
        job.error = error
        job.resolve(job.first_token, error=RuntimeError(f"prefill worker {self.worker_id}: {error}"))
        if not job.handles:  # else the tick tears it down once in-flight pushes have drained
            self._teardown(engine, job)
        else:
            job.last_pushed = True

    def _teardown(self, engine: LLMEngine, job: _Job) -> None:
        self._jobs.pop(job.request_id, None)
        if not engine.release(job.request_id):
            engine.abort(job.request_id)

    # ---- control -------------------------------------------------------------------------------
    async def abort(self, request_id: str, timeout_s: float = 30.0) -> bool:
        """Stop a request; returns once no push of it can still write into the decode worker's pool."""
        torn_down = asyncio.get_running_loop().create_future()

        def do(engine: LLMEngine) -> asyncio.Future | bool:
            job = self._jobs.get(request_id)
            if job is None:
                return engine.abort(request_id)
            job.aborted = torn_down
            job.resolve(job.first_token, error=RuntimeError(f"request {request_id!r} aborted"))
            return torn_down

        result = await self.aengine.run(do)
        if isinstance(result, bool):
            return result
        return await asyncio.wait_for(result, timeout_s)

    async def stats(self, steps_since: float | None = None) -> WorkerStats:
        in_flight = sum(len(j.handles) for j in list(self._jobs.values()))
        stats = await self.aengine.stats(self.worker_id, "prefill", in_flight, self._kv_bytes, steps_since)
        return stats._replace(node=self.node, device=str(self.aengine.engine.device))

    async def check_integrity(self) -> None:
        await self.aengine.run(lambda e: e.block_manager.check_integrity())

    async def shutdown(self) -> None:
        self.aengine.close()
        self.transport.close()
