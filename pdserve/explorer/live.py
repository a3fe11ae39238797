"""The live view: what a running deployment's workers and requests are doing, and bursts to watch.

``LiveView.snapshot`` asks the router for every worker's stats with its newest steps (the workers'
own step timings, ``StepStats``), keeps the last ``window_s`` seconds of them, and adds the router's
percentiles of recent requests per mode (``RouterMetrics.recent``). ``Bursts`` sends a short
interference workload through the same ``Router.generate`` the gRPC and HTTP front doors use: a few
streams decoding, then long prompts landing on them, so that prefill chunks and decode steps
interleave on the timeline.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.explorer.timeline import step_row
from pdserve.messages import Mode, StepStats, WorkerStats
from pdserve.router.router import GenerateInput, Router

MAX_STEPS_PER_WORKER = 1000  # the newest; a busy worker here makes up to ~100 steps a second


class LiveView:
    """The live view's state: each worker's steps of the last ``window_s`` seconds, fetched incrementally.

    ``snapshot()`` asks the workers (through ``Router.stats``) only for steps newer than the newest it
    holds, so a page refreshing every second moves each step once, not ten times."""

    def __init__(self, router: Router, window_s: float = 10.0) -> None:
        self.router = router
        self.window_s = window_s
        self._steps: dict[str, deque[StepStats]] = {}

    async def snapshot(self) -> dict[str, Any]:
        """Workers (KV blocks, queues, recent steps) and recent latencies per mode, as JSON-ready data.

        Step times are seconds before ``now`` (negative), each step ``[start, duration ms, prefill ms,
        decode ms, prefill tokens, decode tokens]`` with the time split by token share (a live step has
        no cost model to price its parts)."""
        now = time.time()
        cutoff = now - self.window_s
        newest = [q[-1].started for q in self._steps.values() if q]
        since = min(newest) if newest and len(newest) == len(self._steps) else cutoff
        workers = await self.router.stats(steps_since=max(since, cutoff))
        for w in workers:
            held = self._steps.setdefault(w.worker_id, deque(maxlen=MAX_STEPS_PER_WORKER))
            last = held[-1].started if held else -1.0
            held.extend(sorted((s for s in w.steps if s.started > last), key=lambda s: s.started))
            while held and held[0].started < cutoff:
                held.popleft()
        workers = sorted(workers, key=lambda w: (w.role != "prefill", w.worker_id))
        return {
            "now": now,
            "window_s": self.window_s,
            "router": self.router.router_id,
            "default_mode": self.router.config.default_mode,
            "workers": [_worker_json(w, self._steps[w.worker_id], now) for w in workers],
            "latency": self.router.metrics.recent.percentiles(),
            "latency_window_s": self.router.metrics.recent.window_s,
            "active_requests": len(self.router.active),
        }


def _worker_json(w: WorkerStats, steps: deque[StepStats], now: float) -> dict[str, Any]:
    return {
        "id": w.worker_id,
        "role": w.role,
        "node": w.node,
        "state": w.state,
        "blocks": {"total": w.blocks_total, "used": w.blocks_used, "cached": w.blocks_cached, "free": w.blocks_free},
        "running": w.num_running,
        "waiting": w.num_waiting,
        "remote_pending": w.num_remote_pending,
        "num_steps": w.num_steps,
        "steps": [_step_json(s, now) for s in steps],
    }


def _step_json(s: StepStats, now: float) -> list[float]:
    tokens = s.num_prefill_tokens + s.num_decode_tokens
    return step_row(s, s.started - now, s.num_prefill_tokens / tokens if tokens else 0.0)


@dataclass(frozen=True)
class BurstSpec:
    """A short interference workload: ``streams`` requests decode, then ``long_prompts`` land on them."""

    mode: str | None = None  # None = the deployment's default
    streams: int = 8
    stream_prompt_tokens: int = 32
    stream_output_tokens: int = 64
    long_prompts: int = 2
    long_prompt_tokens: int = 1536
    long_prompt_delay_s: float = 0.3  # after the streams start

    def check(self, max_model_len: int) -> None:
        """Raise ValueError (naming the field) for a burst the model or the page should not send."""
        if self.mode is not None and self.mode not in list(Mode):
            raise ValueError(f"mode: must be colocated, disaggregated or auto, got {self.mode!r}")
        for name, low, high in (
            ("streams", 0, 64),
            ("long_prompts", 0, 8),
            ("stream_prompt_tokens", 1, max_model_len - 1),
            ("stream_output_tokens", 1, 1024),
            ("long_prompt_tokens", 1, max_model_len - 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}: must be a whole number between {low} and {high}, got {value!r}")
        delay = self.long_prompt_delay_s
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 10:
            raise ValueError(f"long_prompt_delay_s: must be a number of seconds between 0 and 10, got {delay!r}")
        if self.streams + self.long_prompts == 0:
            raise ValueError("streams: a burst needs at least one request")
        if self.stream_prompt_tokens + self.stream_output_tokens > max_model_len:
            raise ValueError(f"stream_output_tokens: a stream must fit the model's {max_model_len} tokens")


class BurstBusy(RuntimeError):
    """A burst is still running: one at a time per deployment."""


@dataclass
class BurstStatus:
    id: str
    mode: str
    requests: int
    started: float
    done: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ended: float | None = None


class Bursts:
    """Sends bursts through ``router`` in the background, one at a time, and remembers the last few."""

    KEEP = 8

    def __init__(self, router: Router) -> None:
        self.router = router
        self.recent: list[BurstStatus] = []
        self._serial = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, spec: BurstSpec) -> BurstStatus:
        """Start one burst; returns its status, updated as it runs.

        Raises ValueError for a bad spec, BurstBusy while the previous burst still runs."""
        limits = self.router.limits
        spec.check(limits.max_model_len)
        running = [b.id for b in self.recent if b.ended is None]
        if running:
            raise BurstBusy(f"{running[-1]} is still running: one burst at a time, send the next once it has ended")
        status = BurstStatus(
            f"burst-{next(self._serial)}",
            spec.mode or self.router.config.default_mode,
            spec.streams + spec.long_prompts,
            time.time(),
        )
        self.recent = [*self.recent[-(self.KEEP - 1) :], status]
        task = asyncio.get_running_loop().create_task(self._run(spec, status))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return status

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(b) for b in self.recent]

    async def _run(self, spec: BurstSpec, status: BurstStatus) -> None:
        rng = random.Random(status.id)
        vocab = self.router.limits.vocab_size

        def prompt(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        stream = SamplingParams(max_tokens=spec.stream_output_tokens, temperature=0.0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        jobs = [
            (f"{status.id}-stream-{i}", prompt(spec.stream_prompt_tokens), stream, 0.0) for i in range(spec.streams)
        ]
        jobs += [
            (f"{status.id}-long-{i}", prompt(spec.long_prompt_tokens), one, spec.long_prompt_delay_s)
            for i in range(spec.long_prompts)
        ]
        try:
            await asyncio.gather(*(self._one(status, spec.mode, *job) for job in jobs))
        finally:
            status.ended = time.time()

    async def _one(
        self,
        status: BurstStatus,
        mode: str | None,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        delay: float,
    ) -> None:
        await asyncio.sleep(delay)
        try:
            async for _ in self.router.generate(GenerateInput(request_id, prompt, params, mode)):
                pass
            status.done += 1
        except Exception as e:  # a refused or failed request is part of what the burst shows
            status.failed += 1
            if len(status.errors) < 4:
                status.errors.append(f"{request_id}: {getattr(e, 'code', type(e).__name__)}: {e}")
