"""The KV-transfer interface and the small typed values that cross process boundaries.

Model
-----
Every worker owns ONE contiguous KV pool tensor whose first dimension is the block id
(block-major layout): block ``i`` is ``pool[i]``, a single contiguous region of
``pool[0].numel() * pool.element_size()`` bytes. The transport treats the pool generically:
any dtype, any trailing shape, CPU or accelerator memory.

A *receiver* (decode worker) registers its pool and publishes a :class:`TransferTarget`
(``describe()``); the target is a small picklable value that travels to senders through Ray.
A *sender* (prefill worker) registers its own pool and ``push``-es ``(source block, destination
block)`` pairs into the receiver's pool, each push carrying one :class:`ChunkNotification`.
The receiver learns that a push has landed from ``poll_notifications()``.

One :class:`KVTransport` object may play both roles (it has one pool); a typical worker
uses one role only.
"""

from __future__ import annotations

import abc
import operator
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

TRANSPORT_KINDS: tuple[str, ...] = ("nixl", "grpc")
DEFAULT_WAIT_S = 30.0

_NOTIF_MAGIC = b"PDKV1"
_NOTIF_MAGIC_CHECKED = b"PDKV2"  # with block checksums: first_block, count, then one u32 per block
_NOTIF_HEADER = struct.Struct("<IQB")  # chunk_index, tokens_done, is_last
_CHECKSUM_HEADER = struct.Struct("<II")  # first_block, number of checksums
_U32_MAX = 2**32 - 1
_U63_MAX = 2**63 - 1


class KVTransferError(RuntimeError):
    """A push was accepted but failed while in flight (peer gone, network error, rejected)."""


def block_checksum(data: Any) -> int:
    """CRC-32 of one block's bytes (a buffer, or a uint8 tensor on the CPU)."""
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    return zlib.crc32(memoryview(data).cast("B"))


class HostStaging:
    """A persistent host buffer for device memory on its way to the host (KV blocks leaving the GPU).

    ``with staging.copy(source) as host:`` gives ``source``'s values on the host. A CUDA tensor is
    copied into page-locked (pinned) memory, allocated once and grown when a copy needs more, so the
    device-to-host copy is one DMA at full speed instead of passing through a driver bounce buffer; a
    CPU tensor is given as it is (no copy). ``host`` is a view of the buffer, valid inside the block
    only; the buffer is held (a lock) until the block ends, so one staging may serve several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now (0 before the first copy from an accelerator)."""
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.is_pinned()

    @contextmanager
    def copy(self, source: torch.Tensor) -> Iterator[torch.Tensor]:
        if source.device.type == "cpu":
            yield source
            return
        with self._lock:
            nbytes = source.numel() * source.element_size()
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = None  # free the old one first
                self._buffer = _host_buffer(nbytes, source.device)
            host = self._buffer[:nbytes].view(source.dtype).view(source.shape)
            host.copy_(source)  # blocking: the values are on the host when it returns
            yield host


def _host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of host memory for copies from ``device``: pinned through that GPU's own context on CUDA
    (a thread with no current device would pin through GPU 0's, making a context there)."""
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8)
    with torch.cuda.device(device):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_checksum_staging = HostStaging()


def block_checksums(pool: torch.Tensor, block_ids: Sequence[int]) -> tuple[int, ...]:
    """CRC-32 of each of ``pool``'s blocks ``block_ids``, in that order (copies them to the host first,
    through a pinned buffer when the pool is on CUDA)."""
    if not block_ids:
        return ()
    view = pool_bytes_view(pool)
    blocks = view.index_select(0, torch.tensor(list(block_ids), dtype=torch.long, device=view.device))
    with _checksum_staging.copy(blocks) as host:
        return tuple(block_checksum(host[k]) for k in range(host.shape[0]))


@dataclass(frozen=True)
class ChunkNotification:
    """What the receiver learns when one push has fully landed in its pool.

    Attributes:
        request_id: the request whose KV this is (non-empty).
        chunk_index: 0-based index of the prefill chunk that produced the KV (< 2**32).
        tokens_done: prompt tokens whose KV is complete on the receiver after this push.
        is_last: True on the request's final push.
        first_block: with ``block_checksums``: the index, in the request's reserved block list, of the
            first block this push carries (the push carries consecutive blocks of that list).
        block_checksums: empty, or the CRC-32 (:func:`block_checksum`) of every block of the push, in
            order, as the sender read them; the receiver may verify its copy against them.
        sender: who sent it, as the receiving transport authenticated it (the sender's
            :attr:`KVTransport.sender_id`); set by ``poll_notifications``, not carried in the bytes.
    """

    request_id: str
    chunk_index: int
    tokens_done: int
    is_last: bool
    first_block: int = 0
    block_checksums: tuple[int, ...] = ()
    sender: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        for name in ("chunk_index", "first_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if not 0 <= value <= _U32_MAX:
                raise ValueError(f"{name} must be in [0, 2**32), got {value}")
        if isinstance(self.tokens_done, bool) or not isinstance(self.tokens_done, int):
            raise ValueError(f"tokens_done must be an int, got {self.tokens_done!r}")
        if not 0 <= self.tokens_done <= _U63_MAX:
            raise ValueError(f"tokens_done must be in [0, 2**63), got {self.tokens_done}")
        if not isinstance(self.is_last, bool):
            raise ValueError(f"is_last must be a bool, got {self.is_last!r}")
        if not isinstance(self.block_checksums, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= _U32_MAX for c in self.block_checksums
        ):
            raise ValueError(f"block_checksums must be a tuple of u32 ints, got {self.block_checksums!r}")
        if len(self.block_checksums) > _U32_MAX:
            raise ValueError("too many block_checksums")
        if not isinstance(self.sender, str):
            raise ValueError(f"sender must be a str, got {self.sender!r}")

    def to_bytes(self) -> bytes:
        """Compact binary form: magic, fixed header, [checksums,] UTF-8 request id."""
        header = _NOTIF_HEADER.pack(self.chunk_index, self.tokens_done, int(self.is_last))
        if not self.block_checksums:
            return _NOTIF_MAGIC + header + self.request_id.encode("utf-8")
        sums = _CHECKSUM_HEADER.pack(self.first_block, len(self.block_checksums))
        sums += struct.pack(f"<{len(self.block_checksums)}I", *self.block_checksums)
        return _NOTIF_MAGIC_CHECKED + header + sums + self.request_id.encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkNotification:
        """Inverse of :meth:`to_bytes`. Raises ``ValueError`` on anything else."""
        data = bytes(data)
        fixed = len(_NOTIF_MAGIC) + _NOTIF_HEADER.size
        checked = data.startswith(_NOTIF_MAGIC_CHECKED)
        if len(data) <= fixed or not (checked or data.startswith(_NOTIF_MAGIC)):
            raise ValueError(f"not a ChunkNotification ({len(data)} bytes: {data[:16]!r}...)")
        chunk_index, tokens_done, is_last = _NOTIF_HEADER.unpack_from(data, len(_NOTIF_MAGIC))
        if is_last not in (0, 1):
            raise ValueError(f"corrupt ChunkNotification: is_last byte {is_last}")
        first_block, sums = 0, ()
        if checked:
            if len(data) < fixed + _CHECKSUM_HEADER.size:
                raise ValueError("corrupt ChunkNotification: truncated checksums")
            first_block, count = _CHECKSUM_HEADER.unpack_from(data, fixed)
            fixed += _CHECKSUM_HEADER.size
            if len(data) <= fixed + 4 * count:
                raise ValueError("corrupt ChunkNotification: truncated checksums")
            sums = struct.unpack_from(f"<{count}I", data, fixed)
            fixed += 4 * count
        try:
            request_id = data[fixed:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"corrupt ChunkNotification: request id is not UTF-8 ({e})") from None
        return cls(request_id, chunk_index, tokens_done, bool(is_last), first_block, tuple(sums))


@dataclass(frozen=True)
class TransferTarget:
    """Everything a sender needs to push into one receiver's pool. Picklable; travels through Ray.

    Attributes:
        kind: transport kind, ``"nixl"`` or ``"grpc"``; a transport rejects other kinds.
        target_id: unique id of the receiving transport instance (senders cache per id).
        num_blocks: blocks in the receiver's pool (destination ids must be below this).
        block_bytes: bytes per block; the sender's pool must have the same block size.
        device: the receiver pool's torch device, e.g. ``"cpu"`` or ``"cuda:0"``.
        agent_name: NIXL only: the receiver's NIXL agent name.
        agent_metadata: NIXL only: ``get_agent_metadata()`` of the receiver, taken after its
            pool was registered.
        base_address: NIXL only: address of block 0 of the receiver's pool.
        address: gRPC only: ``host:port`` of the receiver's KVTransfer service.
        kv_compatibility: the key the receiver registered its pool with (``register_pool``); a sender
            pushes only into a pool registered with its own key.
    """

    kind: str
    target_id: str
    num_blocks: int
    block_bytes: int
    device: str = "cpu"
    agent_name: str = ""
    agent_metadata: bytes = b""
    base_address: int = 0
    address: str = ""
    kv_compatibility: str = ""

    def __repr__(self) -> str:  # keep the metadata blob out of logs
        extra = (
            f"agent_name={self.agent_name!r}, metadata={len(self.agent_metadata)}B, "
            f"base_address=0x{self.base_address:x}"
            if self.kind == "nixl"
            else f"address={self.address!r}"
        )
        return (
            f"TransferTarget(kind={self.kind!r}, target_id={self.target_id!r}, "
            f"num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, "
            f"device={self.device!r}, kv_compatibility={self.kv_compatibility!r}, {extra})"
        )


@dataclass(frozen=True)
class PoolLayout:
    """Block geometry of a registered pool, and the key of what its blocks hold (``register_pool``)."""

    num_blocks: int
    block_bytes: int
    device: torch.device
    compatibility: str = ""


def pool_layout(pool: Any) -> PoolLayout:
    """Validate a block-major KV pool and return its geometry. Raises ``ValueError``."""
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() < 1 or pool.shape[0] < 1:
        raise ValueError(f"pool must have at least one block (dim 0), got shape {tuple(pool.shape)}")
    if pool.numel() == 0:
        raise ValueError(f"pool blocks are empty: shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous (block-major: block i is pool[i], one region)")
    block_bytes = (pool.numel() // pool.shape[0]) * pool.element_size()
    return PoolLayout(num_blocks=int(pool.shape[0]), block_bytes=block_bytes, device=pool.device)


def pool_bytes_view(pool: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 view of a contiguous pool (shares its memory)."""
    return pool.reshape(pool.shape[0], -1).view(torch.uint8)


def _normalize_ids(ids: Any, what: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, (str, bytes, dict, set, frozenset)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{what} must be a sequence of ints, got {type(ids).__name__}")
    out: list[int] = []
    for x in ids:
        if isinstance(x, bool):
            raise ValueError(f"{what} must contain ints, got a bool")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise ValueError(f"{what} must contain ints, got {x!r}") from None
    return out


def _check_range(ids: list[int], num_blocks: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{what} out of range [0, {num_blocks}): {bad[:8]}{' ...' if len(bad) > 8 else ''}")


def validate_push(
    kind: str,
    local: PoolLayout | None,
    target: Any,
    src_block_ids: Any,
    dst_block_ids: Any,
    notification: Any,
) -> tuple[list[int], list[int]]:
    """Common checks for ``KVTransport.push``; returns the ids as lists of ints.

    Raises ``ValueError`` for: no local pool, a target that is not a ``TransferTarget`` of this
    kind, mismatched block sizes or compatibility keys, lists of different lengths, ids out of range on either side,
    duplicate destination ids, or a notification that is not a ``ChunkNotification``.
    """
    if local is None:
        raise ValueError("push() before register_pool(): register the local KV pool first")
    if not isinstance(target, TransferTarget):
        raise ValueError(f"target must be a TransferTarget, got {type(target).__name__}")
    if target.kind != kind:
        raise ValueError(f"unknown target for a {kind} transport: target kind is {target.kind!r}")
    if not target.target_id:
        raise ValueError("unknown target: empty target_id")
    if not isinstance(notification, ChunkNotification):
        raise ValueError(f"notification must be a ChunkNotification, got {type(notification).__name__}")
    if target.block_bytes != local.block_bytes:
        raise ValueError(
            f"block size mismatch: local blocks are {local.block_bytes} bytes, "
            f"target {target.target_id} blocks are {target.block_bytes} bytes"
        )
    if target.kv_compatibility != local.compatibility:
        raise ValueError(
            f"KV compatibility mismatch: this pool's key is {local.compatibility or '(none)'!r}, target "
            f"{target.target_id}'s is {target.kv_compatibility or '(none)'!r}: the two engines differ in model, "
            "dtype, quantization or KV block layout, so these blocks would mean something else there"
        )
    src = _normalize_ids(src_block_ids, "src_block_ids")
    dst = _normalize_ids(dst_block_ids, "dst_block_ids")
    if len(src) != len(dst):
        raise ValueError(f"src_block_ids has {len(src)} ids but dst_block_ids has {len(dst)}")
    _check_range(src, local.num_blocks, "src_block_ids (local pool)")
    _check_range(dst, target.num_blocks, f"dst_block_ids (target {target.target_id})")
    if len(set(dst)) != len(dst):
        raise ValueError("dst_block_ids contains duplicates: each destination block may be written once")
    return src, dst


class PushHandle(abc.ABC):
    """An in-flight push. Obtained from :meth:`KVTransport.push`.

    Attributes:
        notification: the notification this push delivers.
        num_blocks: number of blocks carried.
        num_bytes: payload bytes carried.
    """

    notification: ChunkNotification
    num_blocks: int
    num_bytes: int

    @abc.abstractmethod
    def done(self) -> bool:
        """Non-blocking. True once the data is in the receiver's pool and the notification has
        been sent; False while in flight. Raises :class:`KVTransferError` if the push failed
        (every later call raises again). Polling may drive the transfer's progress (NIXL
        without a progress thread), so waiting code should call this or :meth:`wait`.
        """

    @abc.abstractmethod
    def cancel(self) -> bool:
        """Non-blocking. Stop the push where the transport can; True only once the transport confirms
        that none of its data can still be written into the receiver's pool (it finished, failed, or
        was stopped), False while it cannot say so (it may still land: call again later; each call
        drives its progress). A release or abort call returning is no such confirmation: NIXL's
        release of a posted WRITE returns while its bytes still land. After a True, :meth:`done`
        raises :class:`KVTransferError` unless the push had completed. Idempotent.
        """

    def wait(self, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Block until :meth:`done` is True. Raises ``TimeoutError`` after ``timeout_s``
        seconds (the push stays in flight and may still complete), or :class:`KVTransferError`.
        """
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not self.done():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"push {self.notification} not done after {timeout_s:.3g} s")
            spins += 1
            if spins > 1000:  # long transfer: stop burning a core on the poll itself
                time.sleep(50e-6)


class KVTransport(abc.ABC):
    """Moves KV blocks from a sender's pool into a receiver's pool, one notification per push.

    Contract (both transports):

    - ``register_pool`` once, before ``describe`` or ``push``; the pool must stay alive and must
      not be reallocated until ``close``.
    - ``push`` is asynchronous: it validates its input (``ValueError`` on bad input, before
      anything is sent), starts the transfer and returns a :class:`PushHandle`. The source blocks
      must not be modified until the handle reports done.
    - A notification is delivered to the receiver (``poll_notifications``) only after every
      block of its push is in the receiver's pool. A failed push delivers no notification (its
      destination blocks may hold partial data). No ordering between different pushes is promised:
      use ``chunk_index`` / ``tokens_done`` / ``is_last``.
    - Nothing blocks without a deadline; ``close`` is idempotent and releases every resource.

    This class holds the pool, the lock and the checks every transport shares; a transport adds
    ``_register``, ``_receiver_address``, ``_start_push``, ``poll_notifications`` and ``close``.
    """

    kind: str = ""

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex
        self._lock = threading.RLock()  # guards the pool, the transport's own state and starting pushes
        self._pool: torch.Tensor | None = None
        self._layout: PoolLayout | None = None
        self._closed = False
        self._push_filter: Callable[[str, list[int], str], bool] | None = None
        self.num_pushes_refused = 0  # incoming pushes this receiver turned away (see set_push_filter)
        self.write_lock = threading.Lock()  # see set_push_filter

    @property
    def target_id(self) -> str:
        """The id that this transport's :class:`TransferTarget` carries."""
        return self._id

    @property
    def sender_id(self) -> str:
        """Who this transport is as a sender: what a receiver's ``poll_notifications`` puts in the
        :attr:`ChunkNotification.sender` of its pushes (NIXL: its agent name; gRPC: its id, authenticated
        with the deployment's secret). A receiver accepts a reservation's notifications from this id only."""
        return self._id

    @property
    def checks_pushes(self) -> bool:
        """True when this receiver sees every push arrive and applies the push filter (gRPC); False for
        one-sided writes (NIXL), where only the sender can say that its writes are over."""
        return False

    @property
    def layout(self) -> PoolLayout | None:
        """Geometry of the registered pool, or None before ``register_pool``."""
        return self._layout

    def set_push_filter(self, accepts: Callable[[str, list[int], str], bool] | None) -> None:
        """Receiver side: ``accepts(request_id, dst_block_ids, sender)`` must be True for a push to be written
        (``sender``: the pushing transport's ``sender_id``, as this receiver authenticated it).

        Transports that see each push arrive (gRPC) refuse any other push and count it in
        ``num_pushes_refused``; a one-sided transport (NIXL WRITE) cannot check, and ignores it.
        A checking transport holds ``write_lock`` from the check through the copy of the blocks, so a
        receiver that withdraws a reservation while holding ``write_lock`` knows that no write of it
        is in progress and none can start after.
        """
        self._push_filter = accepts

    def register_pool(self, pool: torch.Tensor, compatibility: str = "") -> None:
        """Register this worker's KV pool (contiguous, block-major; see module docstring).

        ``compatibility``: a key of what the blocks hold (an engine's ``kv_compatibility``: model, dtypes,
        quantization, block layout). It travels in this receiver's ``TransferTarget``, and a sender refuses
        to push into a pool registered with another key.

        Raises ``ValueError`` if the tensor is not a valid pool, a pool is already registered or the
        transport is closed.
        """
        if not isinstance(compatibility, str):
            raise ValueError(f"compatibility must be a str, got {type(compatibility).__name__}")
        layout = replace(pool_layout(pool), compatibility=compatibility)
        with self._lock:
            self._check_open()
            if self._pool is not None:
                raise ValueError("a pool is already registered with this transport")
            self._register(pool, layout)
            self._pool, self._layout = pool, layout

    def describe(self) -> TransferTarget:
        """Receiver side: a :class:`TransferTarget` through which senders push into this pool.

        Makes the transport ready to receive (the gRPC transport starts its server here).
        Raises ``ValueError`` before ``register_pool`` or once closed.
        """
        with self._lock:
            self._check_open()
            if self._pool is None or self._layout is None:
                raise ValueError("describe() before register_pool(): register the KV pool first")
            return TransferTarget(
                kind=self.kind,
                target_id=self._id,
                num_blocks=self._layout.num_blocks,
                block_bytes=self._layout.block_bytes,
                device=str(self._pool.device),
                kv_compatibility=self._layout.compatibility,
                **self._receiver_address(self._pool),
            )

    @abc.abstractmethod
    def poll_notifications(self) -> list[ChunkNotification]:
        """Receiver side, non-blocking: notifications of pushes that fully landed since the last
        call, each returned exactly once, with the ``sender`` the transport saw. Also drives receive
        progress where the transport needs it, so a receiver waiting for KV should call it regularly.
        """

    def push(
        self,
        target: TransferTarget,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: ChunkNotification,
    ) -> PushHandle:
        """Sender side: copy ``pool[src_block_ids[k]]`` into the target's block
        ``dst_block_ids[k]`` for every k, then deliver ``notification`` to the target.

        Empty id lists are allowed (a notification-only push). Raises ``ValueError`` (nothing
        sent) for: no registered pool, a target of another kind or unusable, block-size
        mismatch, lists of different lengths, ids out of range on either side, duplicate
        destination ids, a notification that is not a :class:`ChunkNotification`, a closed
        transport. Raises :class:`KVTransferError` if the transfer cannot even be started;
        later failures are reported by the handle.
        """
        with self._lock:
            self._check_open()
            src, dst = validate_push(self.kind, self._layout, target, src_block_ids, dst_block_ids, notification)
            return self._start_push(target, src, dst, notification)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("transport is closed")

    @abc.abstractmethod
    def _register(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        """Make a valid ``pool`` usable by this transport (under the lock, before it is recorded).
        Raises ``ValueError`` if this transport cannot carry its blocks, ``RuntimeError`` if the
        registration fails; then nothing is registered."""

    @abc.abstractmethod
    def _receiver_address(self, pool: torch.Tensor) -> dict[str, Any]:
        """The :class:`TransferTarget` fields by which senders reach this receiver (under the lock,
        after ``register_pool``); may start receiving."""

    @abc.abstractmethod
    def _start_push(
        self, target: TransferTarget, src: list[int], dst: list[int], notification: ChunkNotification
    ) -> PushHandle:
        """Start one push whose input ``push`` has validated (under the lock, with a pool registered).
        Raises ``ValueError`` for a target this transport cannot reach, :class:`KVTransferError` if
        the transfer cannot be started."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (connections, servers, registrations). Idempotent. Pushes still in
        flight are cancelled where possible; their handles then report failure.
        """

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
