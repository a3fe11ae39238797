"""Faults a worker injects into itself, for the fault tests and ``benchmarks/fault_timings.py``.

What ``kv_transfer.fake.Fault`` is to one push, a ``FaultPlan`` is to a worker: a typed value handed to the
worker (``PrefillWorker``/``DecodeWorker(faults=...)``, or ``set_fault_plan`` on a running one), read at fixed
points of its engine loop. The default plan injects nothing, and a worker without faults never looks further
than one attribute. Standard library only: the process that drives a deployment builds plans without torch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FaultPlan:
    """What goes wrong in a worker, from the step after it is set.

    Attributes:
        crash_step: the next step raises inside the engine loop (a bug, a device error): the loop stops.
        step_delay_s: every step takes this much longer (a slow device, a long chunk).
        engine_hang_s: once, after the next step, the engine thread blocks this long (a GPU or collective
            hang): it neither steps nor takes commands, while the process and its event loop run on.
        stall_pushes: prefill workers: push no more KV (a transfer that stops without failing).
    """

    crash_step: bool = False
    step_delay_s: float = 0.0
    engine_hang_s: float = 0.0
    stall_pushes: bool = False

    def __post_init__(self) -> None:
        for name in ("step_delay_s", "engine_hang_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def any(self) -> bool:
        return self != NO_FAULTS

    def after_step(self) -> FaultPlan:
        """Apply the plan's step faults on the calling (engine) thread; returns the plan for the next step
        (a one-shot hang is used up). Raises ``RuntimeError`` for ``crash_step``."""
        if self.crash_step:
            raise RuntimeError("injected engine fault")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.engine_hang_s:
            time.sleep(self.engine_hang_s)
            return replace(self, engine_hang_s=0.0)
        return self


NO_FAULTS = FaultPlan()
