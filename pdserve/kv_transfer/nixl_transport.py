"""NIXL (UCX backend) KV transport: one-sided WRITEs of whole blocks, one notification per push.

Receiver: registers its pool with its NIXL agent; ``describe()`` returns the agent's metadata
(taken after registration) in the :class:`~kv_transfer.base.TransferTarget`.

Sender: registers its own pool, prepares its local descriptor list once (one descriptor per
block), and on the first push to a target loads the target's metadata (``add_remote_agent``) and
prepares the remote descriptor list once (cached per ``target_id``). Each push is then
``make_prepped_xfer("WRITE", local ids, remote ids, notif_msg=...)`` + ``transfer()``; the handle
polls ``check_xfer_state()`` and releases the request when done. The receiver sees the
notification through ``get_new_notifs()`` once the data is in place.

Settings that matter on a small CPU-only machine: with the progress thread OFF the transfer advances
inside ``transfer()``/``check_xfer_state()`` (so the sender must poll its handles, and a receiver must call
``poll_notifications`` regularly); a progress thread competing with busy polling for few cores costs
bandwidth. The UCX backend is
created with ``ucx_error_handling_mode="none"`` by default (faster between Ray actors, and
required for ``UCX_TLS=sm,self``). An empty ``UCX_TLS`` breaks UCX.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.base import (
    ChunkNotification,
    KVTransferError,
    KVTransport,
    PoolLayout,
    PushHandle,
    TransferTarget,
)

logger = logging.getLogger(__name__)

_ERROR_MODES = ("none", "peer")


@dataclass(frozen=True)
class NixlConfig:
    """Knobs of the NIXL transport.

    Attributes:
        enable_prog_thread: run NIXL's progress thread. Off by default: on 2 cores a progress
            thread plus busy polling halves bandwidth; with it off, progress happens when the
            sender polls its handles and the receiver polls notifications.
        ucx_error_handling_mode: UCX backend ``ucx_error_handling_mode``: ``"none"`` (default,
            fastest; needed for ``UCX_TLS=sm,self``) or ``"peer"`` (UCX's default: detects dead
            peers, slower).
        ucx_tls: if not None, set ``UCX_TLS`` to this (process-wide, before the backend is
            created), e.g. ``"sm,self"`` or ``"tcp"``. Must not be empty. None leaves the
            environment alone, except that an empty ``UCX_TLS`` (which breaks UCX) is removed.
        agent_name: NIXL agent name; None picks a unique one. Names must be unique among peers.
    """

    enable_prog_thread: bool = False
    ucx_error_handling_mode: str = "none"
    ucx_tls: str | None = None
    agent_name: str | None = None

    def __post_init__(self) -> None:
        if self.ucx_error_handling_mode not in _ERROR_MODES:
            raise ValueError(
                f"ucx_error_handling_mode must be one of {_ERROR_MODES}, got {self.ucx_error_handling_mode!r}"
            )
        if self.ucx_tls is not None and not self.ucx_tls.strip():
            raise ValueError("ucx_tls must be None or a non-empty transport list: an empty UCX_TLS breaks UCX")
        if self.agent_name is not None and not self.agent_name:
            raise ValueError("agent_name must be None or non-empty")


def _prepare_ucx_env(config: NixlConfig) -> None:
    if config.ucx_tls is not None:
        os.environ["UCX_TLS"] = config.ucx_tls
    elif "UCX_TLS" in os.environ and not os.environ["UCX_TLS"].strip():
        logger.warning("UCX_TLS is set but empty, which breaks UCX; unsetting it in this process")
        del os.environ["UCX_TLS"]


def _mem_type(device: torch.device) -> str:
    return "DRAM" if device.type == "cpu" else "VRAM"


def _device_id(device: torch.device) -> int:
    return 0 if device.type == "cpu" or device.index is None else int(device.index)


def _block_descs(base_address: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """Nx3 uint64 array (address, length, device id): one descriptor per block."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_address) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


@dataclass
class _Remote:
    agent_name: str
    dlist: Any  # nixl_prepped_dlist_handle
    loaded: bool  # True if we called add_remote_agent (and so must remove it)


class NixlPushHandle(PushHandle):
    """Handle of one NIXL WRITE; polling it drives the transfer when there is no progress thread."""

    def __init__(
        self,
        transport: NixlTransport,
        xfer: Any,
        notification: ChunkNotification,
        num_blocks: int,
        num_bytes: int,
    ) -> None:
        self._transport = transport
        self._xfer = xfer  # None once finished (or for a notification-only push)
        self._error: KVTransferError | None = None
        self.notification = notification
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._xfer is None:
            return True
        state = self._transport._check(self)
        if state == "DONE":
            return True
        if state == "PROC":
            return False
        raise self._error or KVTransferError(f"NIXL transfer failed: {self.notification}")

    def cancel(self) -> bool:
        return self._transport._cancel(self)

    def _fail(self, msg: str) -> None:
        self._error = KVTransferError(msg)


class NixlTransport(KVTransport):
    """KV transport over NIXL with the UCX backend. See the module docstring."""

    kind = "nixl"

    def __init__(self, config: NixlConfig | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__()
        self.config = config or NixlConfig()
        self.agent_name = self.config.agent_name or f"pdserve-kv-{self._id[:16]}"
        _prepare_ucx_env(self.config)
        self._agent: Any = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=self.config.enable_prog_thread, backends=[])
        )
        try:
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": self.config.ucx_error_handling_mode})
        except Exception as e:
            raise RuntimeError(
                f"could not create the NIXL UCX backend (UCX_TLS={os.environ.get('UCX_TLS')!r}, "
                f"ucx_error_handling_mode={self.config.ucx_error_handling_mode!r}): {e}. "
                "Note: UCX_TLS=sm,self needs ucx_error_handling_mode='none'; an empty UCX_TLS breaks UCX."
            ) from e
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        self._metadata: bytes = b""
        self._remotes: dict[str, _Remote] = {}
        self._inflight: dict[int, NixlPushHandle] = {}

    # ---------------------------------------------------------------- common
    def _register(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        try:
            self._reg_descs = self._agent.register_memory(pool)
            descs = _block_descs(pool.data_ptr(), layout.num_blocks, layout.block_bytes, _device_id(pool.device))
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, _mem_type(pool.device))
            self._metadata = self._agent.get_agent_metadata()
        except Exception as e:
            self._release_registration()
            raise RuntimeError(f"NIXL could not register the KV pool ({layout}): {e}") from e

    def _release_registration(self) -> None:
        if self._local_dlist is not None:
            _quiet(self._local_dlist.release)
        if self._reg_descs is not None:
            _quiet(self._agent.deregister_memory, self._reg_descs)
        self._local_dlist = self._reg_descs = None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._inflight.values()):
                self._release(handle, "transport closed while the push was in flight")
            for remote in self._remotes.values():
                _quiet(remote.dlist.release)
                if remote.loaded:
                    _quiet(self._agent.remove_remote_agent, remote.agent_name)
            self._remotes.clear()
            self._release_registration()
            self._pool = None
            self._agent = None

    @property
    def sender_id(self) -> str:
        return self.agent_name

    # -------------------------------------------------------------- receiver
    def _receiver_address(self, pool: torch.Tensor) -> dict[str, Any]:
        return {"agent_name": self.agent_name, "agent_metadata": self._metadata, "base_address": pool.data_ptr()}

    def poll_notifications(self) -> list[ChunkNotification]:
        with self._lock:
            self._check_open()
            notifs = self._agent.get_new_notifs()
        out: list[ChunkNotification] = []
        for agent, messages in notifs.items():
            sender = agent.decode() if isinstance(agent, bytes) else str(agent)
            for msg in messages:
                try:
                    out.append(dataclasses.replace(ChunkNotification.from_bytes(msg), sender=sender))
                except ValueError as e:
                    logger.warning("ignoring a NIXL notification from %s that is not ours: %s", agent, e)
        return out

    # ---------------------------------------------------------------- sender
    def _start_push(
        self, target: TransferTarget, src: list[int], dst: list[int], notification: ChunkNotification
    ) -> NixlPushHandle:
        assert self._layout is not None
        remote = self._remote(target)
        msg = notification.to_bytes()
        nbytes = len(src) * self._layout.block_bytes
        if not src:
            try:
                self._agent.send_notif(remote.agent_name, msg)
            except Exception as e:
                raise KVTransferError(f"NIXL could not notify {target.agent_name}: {e}") from e
            return NixlPushHandle(self, None, notification, 0, 0)
        try:
            xfer = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_dlist,
                np.asarray(src, dtype=np.int32),
                remote.dlist,
                np.asarray(dst, dtype=np.int32),
                notif_msg=msg,
            )
        except Exception as e:
            raise KVTransferError(f"NIXL could not create a WRITE to {target.agent_name}: {e}") from e
        handle = NixlPushHandle(self, xfer, notification, len(src), nbytes)
        state = self._agent.transfer(xfer)
        if state == "ERR":
            self._release(handle, f"NIXL transfer to {target.agent_name} failed to start")
            raise handle._error or KVTransferError("NIXL transfer failed to start")
        if state == "DONE":
            self._release(handle, None)
        else:
            self._inflight[id(handle)] = handle
        return handle

    # --------------------------------------------------------------- helpers
    def _remote(self, target: TransferTarget) -> _Remote:
        remote = self._remotes.get(target.target_id)
        if remote is not None:
            return remote
        if target.agent_name == self.agent_name and target.target_id == self._id:
            remote_name, loaded = self.agent_name, False  # loopback into our own pool
        else:
            if not target.agent_metadata or not target.agent_name:
                raise ValueError(f"unknown target: {target!r} carries no NIXL agent metadata")
            try:
                remote_name = self._agent.add_remote_agent(target.agent_metadata)
            except Exception as e:
                raise ValueError(
                    f"unknown target: cannot load the NIXL metadata of {target!r}: {e} (corrupt or foreign "
                    f"metadata, or no UCX transport reaches it; UCX_TLS={os.environ.get('UCX_TLS')!r})"
                ) from e
            loaded = True
            if isinstance(remote_name, bytes):
                remote_name = remote_name.decode()
            if remote_name != target.agent_name:
                _quiet(self._agent.remove_remote_agent, remote_name)
                raise ValueError(
                    f"unknown target: metadata belongs to agent {remote_name!r}, target says {target.agent_name!r}"
                )
        device = torch.device(target.device)
        descs = _block_descs(target.base_address, target.num_blocks, target.block_bytes, _device_id(device))
        try:
            dlist = self._agent.prep_xfer_dlist(remote_name, descs, _mem_type(device))
        except Exception as e:
            if loaded:
                _quiet(self._agent.remove_remote_agent, remote_name)
            raise ValueError(f"unknown target: NIXL cannot address the pool of {target!r}: {e}") from e
        remote = _Remote(remote_name, dlist, loaded)
        self._remotes[target.target_id] = remote
        return remote

    def _check(self, handle: NixlPushHandle) -> str:
        """Poll one handle's state; releases it when finished. Returns DONE, PROC or ERR."""
        with self._lock:
            if handle._xfer is None:
                return "ERR" if handle._error is not None else "DONE"
            if self._closed:
                handle._fail("transport closed while the push was in flight")
                return "ERR"
            state = self._agent.check_xfer_state(handle._xfer)
            if state == "DONE":
                self._release(handle, None)
            elif state != "PROC":
                self._release(handle, f"NIXL transfer failed (state {state}): {handle.notification}")
                return "ERR"
            return state

    def _cancel(self, handle: NixlPushHandle) -> bool:
        """A WRITE that NIXL has posted cannot be stopped: releasing an active request returns at once, but
        the bytes UCX has queued still land on the receiver's next progress calls (over TCP, 15 of 63 MiB
        after a release that reported success). So a cancel only stops waiting: the push is over once NIXL
        reports it ``DONE`` or failed, and until then this returns False (each call drives its progress)."""
        with self._lock:
            if handle._xfer is None:
                return True
            if self._closed or self._agent is None:
                handle._fail("transport closed while the push was in flight")
                return True
            state = self._agent.check_xfer_state(handle._xfer)
            if state == "PROC":
                return False
            if state == "DONE":
                self._release(handle, None)
            else:
                self._release(handle, f"NIXL transfer failed (state {state}) after its cancel: {handle.notification}")
            return True

    def _release(self, handle: NixlPushHandle, error: str | None) -> None:
        self._inflight.pop(id(handle), None)
        xfer, handle._xfer = handle._xfer, None
        if error is not None:
            handle._fail(error)
        if xfer is not None:
            _quiet(xfer.release)


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # cleanup must not mask the real outcome
        logger.warning("NIXL cleanup step %s failed: %s", getattr(fn, "__name__", fn), e)
