"""Trace replay's alignment of admission events with the steps a run recorded them at (``sim.replay``).

A real worker took each request in (queued its prompt or its remote KV, reserved its decode blocks) between two
of its steps; the run's records give, per request and event (``ADMISSION_EVENTS``), that worker's step count at
that moment. The replayed timeline can put an event a hair on the other side of that step boundary (two calls
within microseconds); ``ReplayAlignment`` moves an event that lands within ``tie_window_s`` of the boundary the
run put it behind across it (held back to the recorded step, or the step waits for it), and leaves one further
off where the timeline puts it; ``AlignmentTally`` counts both. Only replay uses it: a plain simulation passes
no recorded step counts and every event applies at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.sim.instance import Client, Instance

# a request's admission events on a worker, named as its record's meta names their step counts (``<event>_step``)
ADMISSION_EVENTS = ("decode_queued", "decode_reserved", "prefill_queued")


@dataclass
class Deferred:
    """Replay: an admission event that reached its instance before the step the run recorded for it."""

    step: int  # the recorded step count: it joins that step
    since: float  # when the replayed timeline brought it
    request_id: str
    event: str
    action: Callable[[], None]
    prompt_tokens: int = 0
    moved: float = 0.0  # since it came, to the start of the last step before the recorded one


@dataclass
class AlignmentTally:
    """Replay: how the admission events compared with the step counts the run recorded for them."""

    on_time: int = 0  # the replayed timeline put it before the recorded step, as the run did
    moved: list[float] = field(default_factory=list)  # within the tie window: moved by this much (s) to match
    off: int = 0  # further off than the window: left where the timeline put it

    @property
    def num_events(self) -> int:
        return self.on_time + len(self.moved) + self.off

    def to_dict(self) -> dict[str, float]:
        return {
            "events": self.num_events,
            "on_time": self.on_time,
            "moved": len(self.moved),
            "moved_max_ms": 1e3 * max(self.moved, default=0.0),
            "off": self.off,
        }


class ReplayAlignment:
    """The simulator's admission events, applied at the recorded step counts (a mixin of ``Simulator``)."""

    if TYPE_CHECKING:  # the simulator's state and event loop that this part uses
        now: float
        _ready: dict[Instance, None]

        def _at(self, t: float, handler: Callable[..., None], *args: Any) -> None: ...

    def _init_alignment(
        self, admission_steps: Mapping[tuple[str, str], tuple[str, int]] | None, tie_window_s: float
    ) -> None:
        # (request id, admission event) -> (worker, its step count then), as the run recorded them
        self.admission_steps = admission_steps or {}
        self.tie_window_s = tie_window_s
        self.alignment = AlignmentTally()
        self._admitted: set[tuple[str, str]] = set()  # admission events applied (or given up waiting for)

    def _expect_admissions(self, instances: Mapping[str, Instance]) -> None:
        """Give every instance the events the run recorded on it, in step order."""
        if self.tie_window_s <= 0:
            return
        for (request_id, event), (worker, step) in sorted(self.admission_steps.items(), key=lambda kv: kv[1][1]):
            if worker in instances:
                instances[worker].expected.append((step, request_id, event))

    def _recorded_order(self, client: Client) -> tuple[int, int] | None:
        request_id = client.wreq.request_id
        queued = self.admission_steps.get((request_id, "prefill_queued"))
        reserved = self.admission_steps.get((request_id, "decode_reserved"))
        return None if queued is None or reserved is None else (queued[1], reserved[1])

    def _take_in(
        self, inst: Instance, client: Client, event: str, action: Callable[[], None], prompt_tokens: int = 0
    ) -> None:
        """Apply ``action``, the request's admission ``event`` on ``inst``: now, unless the run recorded a later
        step count for it and ``inst`` has a step to run first (then the step count's boundary applies it)."""
        request_id = client.wreq.request_id
        recorded = self.admission_steps.get((request_id, event))
        if recorded is None or recorded[0] != inst.name:
            action()
            return
        step, now_step = recorded[1], inst.num_steps_started
        busy = inst.busy or inst.scheduler.waiting or inst.scheduler.running
        if step > now_step and busy and self.tie_window_s > 0:
            inst.deferred.append(Deferred(step, self.now, request_id, event, action, prompt_tokens))
            return
        if (request_id, event) not in self._admitted:
            self._admitted.add((request_id, event))
            if step == now_step and inst.hold_since is not None:  # the step it belongs to waits for it
                self.alignment.moved.append(self.now - inst.hold_since)
            elif step == now_step:
                self.alignment.on_time += 1
            else:
                self.alignment.off += 1
        action()

    def _aligning(self, inst: Instance) -> bool:
        """Before ``inst``'s next step: apply the held-back events that belong to it (or that came more than the
        tie window before it), and wait up to the window for events the run recorded for it that have not come.
        True while the step waits."""
        step, window = inst.num_steps_started, self.tie_window_s
        due = [d for d in inst.deferred if d.step <= step or self.now - d.since > window]
        if due:
            inst.deferred = [d for d in inst.deferred if not (d.step <= step or self.now - d.since > window)]
            for d in due:
                self._admitted.add((d.request_id, d.event))
                if d.step <= step:
                    self.alignment.moved.append(d.moved)
                else:
                    self.alignment.off += 1
                d.action()
        expected = inst.expected
        while expected and (expected[0][1], expected[0][2]) in self._admitted:
            expected.popleft()
        due_here = itertools.takewhile(lambda e: e[0] <= step, expected)
        missing = [e for e in due_here if (e[1], e[2]) not in self._admitted]
        if missing:
            if inst.hold_since is None:
                inst.hold_since = self.now
                self._at(self.now + window, self._on_hold_over, inst, step)
            return True
        inst.hold_since = None
        if not (inst.scheduler.waiting or inst.scheduler.running) and inst.deferred:
            for d in inst.deferred:  # nothing else to step on: the recorded step cannot come first
                self._admitted.add((d.request_id, d.event))
                self.alignment.off += 1
                d.action()
            inst.deferred = []
        for d in inst.deferred:
            d.moved = self.now - d.since
        return False

    def _on_hold_over(self, inst: Instance, step: int) -> None:
        """The tie window passed with the step still waiting: it starts without the events that did not come."""
        if inst.hold_since is None or inst.num_steps_started != step:
            return
        for recorded_step, request_id, event in inst.expected:
            if recorded_step > step:
                break
            if (request_id, event) not in self._admitted:
                self._admitted.add((request_id, event))
                self.alignment.off += 1
        inst.hold_since = None
        self._ready[inst] = None
