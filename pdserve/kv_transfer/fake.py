"""A test double of :class:`~pdserve.kv_transfer.base.KVTransport` that fails, hangs and delivers late.

In one process, senders and receivers find each other by ``target_id``. A push copies its blocks
into the receiver's pool and delivers its notification, either at once (the default) or as a fault
says: ``fail`` (nothing written, the handle raises), ``hang`` (never lands), ``late`` (lands after a
delay, from a timer thread, like a one-sided write the sender has lost track of), ``corrupt`` (lands
with one byte of each block flipped). A push can be
made uncancellable (``cancellable=False``), as a NIXL WRITE that UCX will not abort, or a liar
(``lands_after_cancel=True``): its cancel reports success while its data still lands, as a NIXL release did.

Writes are one-sided (``checks_pushes`` is False, like NIXL): the receiver's push filter is not
obeyed, only consulted. Every write the filter would have refused is recorded in
``stray_writes``; a correct receiver never lets that happen, so tests assert it stays empty.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer.base import (
    ChunkNotification,
    KVTransferError,
    KVTransport,
    PoolLayout,
    PushHandle,
    TransferTarget,
    pool_bytes_view,
)

FAULT_KINDS = ("fail", "hang", "late", "corrupt")


@dataclass(frozen=True)
class Fault:
    """What happens to a push.

    Attributes:
        kind: ``fail``, ``hang``, ``late`` or ``corrupt``.
        delay_s: ``late`` only: the push lands this long after it started.
        cancellable: False: ``cancel()`` refuses (returns False) until ``FakeTransport.allow_cancel``.
        lands_after_cancel: ``late`` only: ``cancel()`` reports success, and the push lands all the same.
    """

    kind: str
    delay_s: float = 0.0
    cancellable: bool = True
    lands_after_cancel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")


_RECEIVERS: dict[str, FakeTransport] = {}
_RECEIVERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class StrayWrite:
    """A write that landed in blocks the receiver did not hold for that request (a rule broken)."""

    request_id: str
    dst_block_ids: tuple[int, ...]
    at: float


class FakePushHandle(PushHandle):
    def __init__(self, notification: ChunkNotification, num_blocks: int, num_bytes: int, fault: Fault | None) -> None:
        self.notification = notification
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.fault = fault
        self._lock = threading.Lock()
        self._landed = False
        self._error: KVTransferError | None = None
        self._cancel_allowed = fault is None or fault.cancellable
        self._timer: threading.Timer | None = None
        self.cancel_calls = 0
        self.landed_at: float | None = None

    def done(self) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._landed

    def cancel(self) -> bool:
        with self._lock:
            self.cancel_calls += 1
            if self._landed or self._error is not None:
                return True
            if not self._cancel_allowed:
                return False
            if self.fault is not None and self.fault.lands_after_cancel:
                return True  # a lie: the timer still lands it
            self._error = KVTransferError(f"push {self.notification} cancelled")
            timer = self._timer
        if timer is not None:
            timer.cancel()
        return True

    def allow_cancel(self) -> None:
        with self._lock:
            self._cancel_allowed = True

    def _land(self, write: Callable[[], None]) -> None:
        with self._lock:
            if self._error is not None:  # cancelled before it landed
                return
            write()
            self._landed = True
            self.landed_at = time.monotonic()


class FakeTransport(KVTransport):
    """See the module docstring. ``faults``: request id -> the fault of that request's pushes (each push
    of it; ``fault_for`` can choose per notification instead)."""

    kind = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, Fault] = {}
        self.fault_for: Callable[[ChunkNotification], Fault | None] | None = None
        self._notifications: collections.deque[ChunkNotification] = collections.deque()
        self.stray_writes: list[StrayWrite] = []
        self.handles: list[FakePushHandle] = []  # every push started by this sender
        self.writes = 0  # pushes whose data landed in this receiver's pool

    # the KVTransport hooks
    def _register(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        pass

    def _receiver_address(self, pool: torch.Tensor) -> dict[str, Any]:
        with _RECEIVERS_LOCK:
            _RECEIVERS[self._id] = self
        return {}

    def poll_notifications(self) -> list[ChunkNotification]:
        with self._lock:
            out = list(self._notifications)
            self._notifications.clear()
        return out

    def _start_push(
        self, target: TransferTarget, src: list[int], dst: list[int], notification: ChunkNotification
    ) -> FakePushHandle:
        with _RECEIVERS_LOCK:
            receiver = _RECEIVERS.get(target.target_id)
        if receiver is None:
            raise ValueError(f"unknown target: no fake receiver {target.target_id!r} in this process")
        assert self._pool is not None and self._layout is not None
        fault = self.fault_for(notification) if self.fault_for is not None else self.faults.get(notification.request_id)
        data = pool_bytes_view(self._pool)[src].clone() if src else None  # what the sender read, now
        handle = FakePushHandle(notification, len(src), len(src) * self._layout.block_bytes, fault)
        self.handles.append(handle)

        sent = dataclasses.replace(notification, sender=self.sender_id)

        def write() -> None:
            receiver._write(sent, dst, data)

        if fault is not None and fault.kind == "corrupt" and data is not None:
            data[:, 0] ^= 0xFF
        if fault is None or fault.kind == "corrupt":
            handle._land(write)
        elif fault.kind == "fail":
            handle._error = KVTransferError(f"injected failure of push {notification}")
        elif fault.kind == "late":
            timer = threading.Timer(fault.delay_s, handle._land, args=(write,))
            timer.daemon = True
            handle._timer = timer
            timer.start()
        return handle  # "hang": never lands

    def _write(self, notification: ChunkNotification, dst: list[int], data: torch.Tensor | None) -> None:
        """Receiver side: a one-sided write lands (the filter is consulted, not obeyed), then its notification."""
        with self.write_lock:
            pool, accepts = self._pool, self._push_filter
            if self._closed or pool is None:
                return
            if dst and accepts is not None and not accepts(notification.request_id, dst, notification.sender):
                self.stray_writes.append(StrayWrite(notification.request_id, tuple(dst), time.monotonic()))
            if data is not None:
                view = pool_bytes_view(pool)
                for k, d in enumerate(dst):
                    view[d].copy_(data[k])
        with self._lock:
            self.writes += 1
            self._notifications.append(notification)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with _RECEIVERS_LOCK:
            _RECEIVERS.pop(self._id, None)
        for handle in self.handles:
            if handle._timer is not None:
                handle._timer.cancel()
