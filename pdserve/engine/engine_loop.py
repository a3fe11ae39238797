"""Runs an LLMEngine continuously in its own thread; other threads talk to it through commands.

The engine is not thread-safe and a step can take seconds (a long prefill chunk), so nothing else
touches it: callers submit a function, the loop runs it between steps and resolves a future. This
is the same shape as vLLM's engine core: inputs are applied between steps, never during one.

On a CPU the loop thread should be the only thread of its process that runs torch's parallel kernels: build
the engine with ``build_in_passing_thread`` (see there).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine, RequestOutput

T = TypeVar("T")
log = logging.getLogger(__name__)
TRIM_AFTER_IDLE_S = 1.0  # an engine idle this long after work hands its heap's free pages back to the OS


def build_in_passing_thread(build: Callable[[], T]) -> T:
    """``build()`` on a thread that ends when it returns; its result, or its exception raised here.

    An engine's construction (loading and packing weights, zeroing the KV pool) runs torch's parallel
    kernels, and every thread that does so keeps a team of OpenMP threads for as long as it lives. libgomp
    counts those threads, and once there are more of them than cores it stops letting threads spin while
    they wait for the next parallel region (``GOMP_SPINCOUNT`` then no longer applies), so every region of
    a decode step pays a wake-up. Built by the actor's own thread and stepped by the loop thread, the engine
    would leave two teams behind; built here, the team goes with the thread and the loop thread's is the
    process's only one."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-build") as pool:  # its exit joins the thread
        return pool.submit(build).result()


class EngineLoop:
    """``call(fn)`` runs ``fn(engine)`` on the loop thread; ``on_step`` sees every step's outputs.

    ``on_step(engine, outputs)`` and ``on_tick(engine)`` run on the loop thread, after each step and
    on every turn of the loop (also when idle, every ``idle_wait_s``), so they may use the engine.
    If a step or a hook raises, the loop stops for good: pending calls fail, ``error`` holds the cause
    and ``on_crash(error)`` runs (on the loop thread, once) so the node can fail its requests.

    The loop thread stamps ``last_turn`` on every turn (an idle loop turns every ``idle_wait_s``), so
    ``stalled_for()`` is how long it has been stuck in one step, hook or command: its liveness, read by
    other threads, which nothing but the loop thread itself can keep fresh.

    Once the engine has had no work for ``trim_after_idle_s`` after some, the loop trims the heap once
    (``release_freed_memory``): a burst's freed activations and masks otherwise stay resident (tens of MB
    after a long prompt), and an idle engine has the time for the trim. None never trims.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        on_tick: Callable[[LLMEngine], None] | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.002,
        name: str = "engine-loop",
        trim_after_idle_s: float | None = TRIM_AFTER_IDLE_S,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_tick = on_tick
        self._on_crash = on_crash
        self._idle_wait_s = idle_wait_s
        self._trim_after_idle_s = trim_after_idle_s
        self.num_trims = 0
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.num_steps = 0
        self.last_turn = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between steps; the future holds its result or error."""
        future: Future[T] = Future()
        if self._stop.is_set():
            future.set_exception(RuntimeError(f"engine loop stopped: {self.error!r}"))
            return future
        self._commands.put((fn, future))
        if self._stop.is_set():  # stopped meanwhile: its last drain may have run before this put
            self._fail_pending()
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stalled_for(self) -> float:
        """Seconds since the loop thread last began a turn (0 once it stopped: a dead loop is not stuck)."""
        return max(0.0, time.monotonic() - self.last_turn) if self.alive else 0.0

    def _run(self) -> None:
        engine = self.engine
        stalled = False  # the last step scheduled nothing (e.g. waiting for blocks): don't spin
        last_work: float | None = None  # when the engine last had work, until the heap is trimmed after it
        try:
            self._use_engine_device()
            while not self._stop.is_set():
                self.last_turn = time.monotonic()
                self._drain_commands(block=stalled or not engine.has_work())
                if self._on_tick is not None:
                    self._on_tick(engine)
                if not engine.has_work():
                    if last_work is not None and self._idle_long_enough(last_work):
                        self._trim()
                        last_work = None
                    continue
                last_work = time.monotonic()
                outputs = engine.step()
                stalled = engine.last_output is None or not engine.last_output.chunks
                if stalled:
                    continue
                self.num_steps += 1
                if self._on_step is not None:
                    self._on_step(engine, outputs)
        except BaseException as e:  # the loop must not die silently: fail every waiter, tell the node
            log.exception("engine loop crashed")
            self.error = e
            self._stop.set()
            if self._on_crash is not None:
                self._on_crash(e)
        finally:
            self._fail_pending()

    def _use_engine_device(self) -> None:
        """Make the engine's GPU this thread's current CUDA device (``model_runner.use_device``)."""
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":
            from pdserve.engine.model_runner import use_device  # torch: not for the loop's importers

            use_device(device)

    def _idle_long_enough(self, last_work: float) -> bool:
        return self._trim_after_idle_s is not None and time.monotonic() - last_work >= self._trim_after_idle_s

    def _trim(self) -> None:
        from pdserve.engine.quantization import release_freed_memory  # torch: not for the loop's importers

        release_freed_memory()
        self.num_trims += 1

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.done():
                try:
                    future.set_exception(RuntimeError(f"engine loop stopped: {self.error!r}"))
                except InvalidStateError:
                    pass  # resolved meanwhile
