"""The machine's pace, measured apart from the work: a fixed kernel timed every so often between steps.

A step's CPU time moves with its shape and with the machine: on a shared VM the same step can cost
noticeably more CPU time a few minutes later (another guest on the core's sibling thread, the host's caches
and memory bandwidth). A kernel that never changes, timed on the stepping thread between steps, moves only
with the machine, so a benchmark can tell a step that cost more because of its shape from one that ran
on a slower machine. Each step records the latest timing (``StepStats.pace_s``); the probe is off (0.0)
unless ``EngineConfig.pace_probe_interval_s`` turns it on.
"""

from __future__ import annotations

import time

import torch

# Two float32 products of an MLP's shape (8 rows: a small batch), repeated: short enough to take every half
# second for a small share of the engine's time, long enough that the thread's CPU clock resolves it finely.
PROBE_ROWS, PROBE_HIDDEN, PROBE_INTERMEDIATE, PROBE_REPEATS = 8, 512, 1536, 2


class PaceProbe:
    """``maybe_probe()`` times the fixed kernel once ``interval_s`` of wall time has passed since the last
    timing, on the calling thread's CPU clock (``time.thread_time``), and keeps it in ``last_s``; the first
    timing is taken when the probe is made, so ``last_s`` holds one from the start. With ``interval_s`` 0
    it does nothing and ``last_s`` stays 0.0. Host tensors on every device: it measures the host's pace,
    which is what runs the loop, and the whole step on a CPU."""

    def __init__(self, interval_s: float) -> None:
        if not interval_s >= 0:
            raise ValueError(f"pace probe interval must be >= 0 seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self.last_s = 0.0
        self.num_probes = 0
        self._next = 0.0
        if interval_s > 0:
            gen = torch.Generator().manual_seed(0)
            self._x = torch.randn(PROBE_ROWS, PROBE_HIDDEN, generator=gen)
            self._up = torch.randn(PROBE_HIDDEN, PROBE_INTERMEDIATE, generator=gen) / PROBE_HIDDEN**0.5
            self._down = torch.randn(PROBE_INTERMEDIATE, PROBE_HIDDEN, generator=gen) / PROBE_INTERMEDIATE**0.5
            self.maybe_probe()

    def maybe_probe(self) -> None:
        if self.interval_s <= 0:
            return
        now = time.perf_counter()
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.last_s = self.time_kernel()
        self.num_probes += 1

    def time_kernel(self) -> float:
        """The kernel's CPU time on this thread, in seconds."""
        with torch.inference_mode():
            start = time.thread_time()
            for _ in range(PROBE_REPEATS):
                torch.mm(torch.mm(self._x, self._up), self._down)
            return time.thread_time() - start
