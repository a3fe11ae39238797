"""gRPC KV transport: a client-streaming ``PushBlocks`` RPC per push.

Receiver: ``describe()`` starts a synchronous ``grpc.server`` (thread pool) on the configured
host (by default this node's address as Ray knows it, so that senders on other nodes reach it)
and port (0 = any free port; the bound port is reported in the target's ``address``). Each
incoming stream is validated message by message and its blocks are copied into ``pool[dst]`` on
the pool's device; after the stream's last message the notification is queued for
``poll_notifications``. The push filter's check and the copy of each message happen under the
transport's ``write_lock``, so a receiver that withdraws a reservation under that lock knows that no
later byte of it is written.

Access: with a ``secret`` every push carries an HMAC of its target, request and sender ids under it (the
secret itself never travels) and the receiver refuses any other (UNAUTHENTICATED). A stream names its
request and sender in its metadata; the push filter must accept the request before the first message and
every message's blocks, and the notification must be the stream's request (PERMISSION_DENIED otherwise).
With ``tls_cert_chain`` and ``tls_private_key`` the receiver serves TLS only and senders trust that chain.

Sender: one cached channel and a single-thread executor per target (pushes to one target run in
order, each in the background). A push streams ``BlockPayload`` messages of whole blocks, packed
up to ``message_bytes`` (2 MiB by default) each, with the notification on the last message. Payloads are raw
``bytes``; both sides raise gRPC's 4 MiB message limit to ``max_message_bytes``.

Wire format: every message is a valid ``pdserve.kv.BlockPayload`` (the generated stub and
servicer in ``pdserve_proto/kv_transfer_pb2_grpc.py`` interoperate with this code), but the payload never
goes through protobuf objects, which would copy it three more times: the sender serializes the
small fields with protobuf and appends field 4 (``data``) by hand, gathering the blocks straight
from the pool into the wire bytes; the receiver splits field 4 off as a zero-copy memoryview and
parses only the rest with protobuf. On this kind of machine every fresh multi-MiB buffer costs
page faults, so each avoided copy is visible in the bandwidth.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import hmac
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from pdserve.kv_transfer.base import (
    DEFAULT_WAIT_S,
    ChunkNotification,
    HostStaging,
    KVTransferError,
    KVTransport,
    PoolLayout,
    PushHandle,
    TransferTarget,
    pool_bytes_view,
)
from pdserve.proto import kv_transfer_pb2 as pb
from pdserve.transport_config import GRPC_MESSAGE_HEADROOM, GrpcConfig

logger = logging.getLogger(__name__)

# torch.frombuffer over received (immutable) bytes warns once; we only ever read from it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


_SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"]
_METHOD = f"/{_SERVICE.full_name}/PushBlocks"
_AUTH_KEY = "x-pdserve-kv-auth"  # gRPC metadata of every push: proof that the sender holds the deployment's secret
_REQUEST_KEY = "x-pdserve-request-id"  # ... the request whose reservation it writes into
_SENDER_KEY = "x-pdserve-kv-sender"  # ... and the sender's id (what its notifications are attributed to)


def push_proof(secret: str, target_id: str, request_id: str, sender_id: str) -> str:
    """HMAC-SHA256 of one push's ids under the deployment's secret: what a sender presents instead of it."""
    message = "\0".join((target_id, request_id, sender_id)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


_DATA_FIELD = pb.BlockPayload.DESCRIPTOR.fields_by_name["data"].number
_DATA_TAG = bytes([(_DATA_FIELD << 3) | 2])  # field 4, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint in BlockPayload")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


@dataclass
class _Payload:
    """A parsed BlockPayload whose ``data`` is a view into the received bytes."""

    header: pb.BlockPayload  # every field except data
    data: memoryview


def _parse_payload(raw: bytes) -> _Payload:
    """Deserialize a BlockPayload without copying its ``data`` field (gRPC request deserializer)."""
    mv = memoryview(raw)
    pos, end = 0, len(raw)
    rest: list[memoryview] = []
    data = mv[0:0]
    while pos < end:
        start = pos
        key, pos = _read_varint(raw, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos)
            if field == _DATA_FIELD:
                if pos + length > end:
                    raise ValueError("truncated data field in BlockPayload")
                data = mv[pos : pos + length]  # last occurrence wins, as in protobuf
                pos += length
                continue
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} in BlockPayload")
        if pos > end:
            raise ValueError("truncated BlockPayload")
        rest.append(mv[start:pos])
    return _Payload(pb.BlockPayload.FromString(b"".join(rest)), data)


def _serialize_payload(header: pb.BlockPayload, chunks: Sequence[Any], nbytes: int) -> bytes:
    """``header`` (without data) plus a data field made of ``chunks`` (buffers), in one copy."""
    return b"".join([header.SerializeToString(), _DATA_TAG, _varint(nbytes), *chunks])


class _Cancel:
    """Shared by a push's handle and its sender thread: set once, stops the stream."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.call: Any = None  # the running RPC (a grpc.Future), once started


class GrpcPushHandle(PushHandle):
    """Handle of one push stream running on the sender's per-target thread."""

    def __init__(
        self,
        future: cf.Future[Any],
        notification: ChunkNotification,
        num_blocks: int,
        num_bytes: int,
        cancel: _Cancel | None = None,
    ):
        self._future = future
        self._cancel = cancel or _Cancel()
        self.notification = notification
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes

    def cancel(self) -> bool:
        """Stops the stream; the receiver checks and writes every message under its ``write_lock``, so
        once it has withdrawn the reservation nothing of this push is written there."""
        with self._cancel.lock:
            self._cancel.cancelled = True
            call = self._cancel.call
        self._future.cancel()
        if call is not None:
            call.cancel()
        return True

    def done(self) -> bool:
        if not self._future.done():
            return False
        self._raise_if_failed()
        return True

    def wait(self, timeout_s: float = DEFAULT_WAIT_S) -> None:
        cf.wait([self._future], timeout=timeout_s)
        if not self._future.done():
            raise TimeoutError(f"push {self.notification} not done after {timeout_s:.3g} s")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._future.cancelled():
            raise KVTransferError(f"push {self.notification} was cancelled")
        exc = self._future.exception()
        if exc is None:
            return
        if isinstance(exc, KVTransferError):
            raise exc
        raise KVTransferError(f"push {self.notification} failed: {exc}") from exc


class _Servicer:
    def __init__(self, transport: GrpcTransport) -> None:
        self._t = transport

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, why: str) -> None:
        with self._t._lock:
            self._t.num_pushes_refused += 1
        logger.warning("refused a KV push from %s: %s", context.peer(), why)
        context.abort(code, why)

    def PushBlocks(self, request_iterator: Iterator[_Payload], context: grpc.ServicerContext) -> pb.PushAck:
        t = self._t
        metadata = dict(context.invocation_metadata())
        request_id, sender = metadata.get(_REQUEST_KEY, ""), metadata.get(_SENDER_KEY, "")
        secret = t.config.secret
        if secret:
            proof = push_proof(secret, t._id, request_id, sender)
            if not hmac.compare_digest(metadata.get(_AUTH_KEY, "").encode(), proof.encode()):
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "push without this deployment's KV secret")
        accepts = t._push_filter
        pool, layout = t._pool, t._layout
        if pool is None or layout is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "receiver has no registered pool")
        assert pool is not None and layout is not None
        if accepts is not None:
            with t.write_lock:  # a stream, blocks or not, is for a live reservation
                live = accepts(request_id, [], sender)
            if not live:
                self._refuse(
                    context, grpc.StatusCode.PERMISSION_DENIED, f"no live reservation of {request_id!r} for {sender!r}"
                )
        view = pool_bytes_view(pool)
        host = view.numpy() if view.device.type == "cpu" else None  # [num_blocks, block_bytes] uint8
        notice: pb.ChunkNotice | None = None
        blocks = 0
        for payload in request_iterator:
            msg = payload.header
            if msg.target_id != t._id:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"unknown target id {msg.target_id!r} (this is {t._id!r})",
                )
            if msg.block_bytes != layout.block_bytes:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block size mismatch: sender {msg.block_bytes} bytes, receiver {layout.block_bytes} bytes",
                )
            n = len(msg.dst_block_ids)
            data = payload.data
            if len(data) != n * layout.block_bytes:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"payload has {len(data)} bytes for {n} blocks of {layout.block_bytes} bytes",
                )
            if n:
                ids = list(msg.dst_block_ids)
                if max(ids) >= layout.num_blocks:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"dst block id {max(ids)} out of range [0, {layout.num_blocks})",
                    )
                bb = layout.block_bytes
                src = None if host is not None else torch.frombuffer(data, dtype=torch.uint8).view(n, bb)
                with t.write_lock:  # the check and the copy are one step for a receiver withdrawing blocks
                    accepted = accepts is None or accepts(request_id, ids, sender)
                    if accepted:
                        if host is not None:  # CPU pool: one memcpy per block, no torch dispatch
                            for k, d in enumerate(ids):
                                host[d] = data[k * bb : (k + 1) * bb]
                        else:
                            assert src is not None
                            src = src.to(view.device)
                            # one copy_ per block (index_copy_ would work too on accelerators; on CPU
                            # it runs an element-wise kernel, far slower than memcpy)
                            for k, d in enumerate(ids):
                                view[d].copy_(src[k])
                            torch.accelerator.synchronize(view.device)  # written before the lock is let go
                if not accepted:
                    self._refuse(
                        context,
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"no reservation of {request_id!r} holds these blocks",
                    )
                blocks += n
            if msg.HasField("notification"):
                notice = msg.notification
        if notice is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push stream ended without a notification")
        assert notice is not None
        if notice.request_id != request_id:
            self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"a push for {request_id!r} carries a notification for {notice.request_id!r}",
            )
        try:
            notification = ChunkNotification(
                notice.request_id,
                notice.chunk_index,
                notice.tokens_done,
                notice.is_last,
                notice.first_block,
                tuple(notice.block_checksums),
                sender,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad notification: {e}")
        t._deliver(notification)
        return pb.PushAck(blocks_written=blocks, bytes_written=blocks * layout.block_bytes)


@dataclass(frozen=True)
class _Push:
    """One push on its way: validated block ids into ``target``, from ``pool``."""

    target: TransferTarget
    pool: torch.Tensor
    block_bytes: int
    src: list[int]
    dst: list[int]
    notification: ChunkNotification
    cancel: _Cancel = field(default_factory=_Cancel)


@dataclass
class _Peer:
    channel: grpc.Channel
    push_blocks: grpc.StreamUnaryMultiCallable
    executor: cf.ThreadPoolExecutor
    staging: HostStaging = field(default_factory=HostStaging)  # blocks of a pool on an accelerator


class GrpcTransport(KVTransport):
    """KV transport over a gRPC client stream. See the module docstring."""

    kind = "grpc"

    def __init__(self, config: GrpcConfig | None = None) -> None:
        super().__init__()
        self.config = config or GrpcConfig()
        self._server: grpc.Server | None = None
        self._port: int | None = None
        self._host = ""
        self._notifications: collections.deque[ChunkNotification] = collections.deque()
        self._peers: dict[str, _Peer] = {}

    @property
    def checks_pushes(self) -> bool:
        return True

    @property
    def port(self) -> int | None:
        """Bound server port, or None before ``describe()``."""
        return self._port

    def _register(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        if layout.block_bytes > self.config.max_message_bytes - GRPC_MESSAGE_HEADROOM:
            raise ValueError(
                f"blocks of {layout.block_bytes} bytes do not fit in one gRPC message of at most "
                f"{self.config.max_message_bytes} bytes; raise GrpcConfig.max_message_bytes"
            )

    # -------------------------------------------------------------- receiver
    def _receiver_address(self, pool: torch.Tensor) -> dict[str, Any]:
        if self._server is None:
            self._start_server()
        return {"address": f"{self._host}:{self._port}"}

    def _start_server(self) -> None:
        server = grpc.server(
            cf.ThreadPoolExecutor(max_workers=self.config.server_threads, thread_name_prefix="kv-grpc-recv"),
            options=self.config.channel_options(),
        )
        handler = grpc.stream_unary_rpc_method_handler(
            _Servicer(self).PushBlocks,
            request_deserializer=_parse_payload,
            response_serializer=pb.PushAck.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE.full_name, {"PushBlocks": handler}),)
        )
        host = self.config.bind_host()
        address = f"{host}:{self.config.port}"
        try:
            if self.config.tls_cert_chain is not None and self.config.tls_private_key is not None:
                credentials = grpc.ssl_server_credentials([(self.config.tls_private_key, self.config.tls_cert_chain)])
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind the KV gRPC server to {host}:{self.config.port}: {e}") from e
        if port == 0:
            raise RuntimeError(f"cannot bind the KV gRPC server to {host}:{self.config.port}")
        server.start()
        self._server, self._port, self._host = server, port, host

    def _deliver(self, notification: ChunkNotification) -> None:
        with self._lock:
            self._notifications.append(notification)

    def poll_notifications(self) -> list[ChunkNotification]:
        with self._lock:
            out = list(self._notifications)
            self._notifications.clear()
        return out

    # ---------------------------------------------------------------- sender
    def _start_push(
        self, target: TransferTarget, src: list[int], dst: list[int], notification: ChunkNotification
    ) -> GrpcPushHandle:
        if not target.address:
            raise ValueError(f"unknown target: {target!r} has no gRPC address")
        peer = self._peer(target)
        assert self._pool is not None and self._layout is not None
        cancel = _Cancel()
        push = _Push(target, self._pool, self._layout.block_bytes, src, dst, notification, cancel)
        future = peer.executor.submit(self._run_push, peer, push)
        return GrpcPushHandle(future, notification, len(src), len(src) * push.block_bytes, cancel)

    def _peer(self, target: TransferTarget) -> _Peer:
        peer = self._peers.get(target.target_id)
        if peer is None:
            options = self.config.channel_options()
            if self.config.tls_cert_chain is not None:  # the deployment's own certificate is the only one trusted
                credentials = grpc.ssl_channel_credentials(root_certificates=self.config.tls_cert_chain)
                channel = grpc.secure_channel(target.address, credentials, options=options)
            else:
                channel = grpc.insecure_channel(target.address, options=options)
            peer = _Peer(
                channel=channel,
                push_blocks=channel.stream_unary(
                    _METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString
                ),
                executor=cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-grpc-send"),
            )
            self._peers[target.target_id] = peer
        return peer

    def _messages(self, push: _Push, staging: HostStaging) -> Iterator[bytes]:
        """Serialized BlockPayload messages of whole blocks; the last one carries the notice. Blocks of a
        pool off the CPU reach the host through ``staging`` (pinned on CUDA)."""
        src, dst, block_bytes, notification = push.src, push.dst, push.block_bytes, push.notification
        view = pool_bytes_view(push.pool)
        flat = view.reshape(-1).numpy().data if view.device.type == "cpu" else None
        per_msg = max(1, self.config.message_bytes // block_bytes)
        notice = pb.ChunkNotice(
            request_id=notification.request_id,
            chunk_index=notification.chunk_index,
            tokens_done=notification.tokens_done,
            is_last=notification.is_last,
            first_block=notification.first_block,
            block_checksums=notification.block_checksums,
        )
        starts = range(0, len(src), per_msg) if src else range(1)
        for start in starts:
            if push.cancel.cancelled:
                return  # the stream is being cancelled: read nothing more of the pool
            s_ids, d_ids = src[start : start + per_msg], dst[start : start + per_msg]
            header = pb.BlockPayload(target_id=push.target.target_id, block_bytes=block_bytes, dst_block_ids=d_ids)
            if start + per_msg >= len(src):
                header.notification.CopyFrom(notice)
            nbytes = len(s_ids) * block_bytes
            if flat is not None:
                yield _serialize_payload(header, [flat[i * block_bytes : (i + 1) * block_bytes] for i in s_ids], nbytes)
            elif s_ids:
                idx = torch.tensor(s_ids, dtype=torch.long, device=view.device)
                with staging.copy(view.index_select(0, idx)) as host:  # serialized (copied) before it is let go
                    message = _serialize_payload(header, [host.numpy().data.cast("B")], nbytes)
                yield message
            else:
                yield _serialize_payload(header, [], nbytes)

    def _run_push(self, peer: _Peer, push: _Push) -> pb.PushAck:
        try:
            request_id = push.notification.request_id
            metadata = [(_REQUEST_KEY, request_id), (_SENDER_KEY, self.sender_id)]
            if self.config.secret:
                proof = push_proof(self.config.secret, push.target.target_id, request_id, self.sender_id)
                metadata.append((_AUTH_KEY, proof))
            with push.cancel.lock:
                if push.cancel.cancelled:
                    raise KVTransferError(f"push {push.notification} was cancelled")
                call = push.cancel.call = peer.push_blocks.future(
                    self._messages(push, peer.staging), timeout=self.config.push_timeout_s, metadata=metadata
                )
            ack = call.result()
        except grpc.FutureCancelledError:
            raise KVTransferError(f"push {push.notification} was cancelled") from None
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            raise KVTransferError(
                f"gRPC push of {push.notification} to {push.target.address} failed: "
                f"{getattr(code, 'name', code)}: {details}"
            ) from None
        if ack.blocks_written != len(push.src):
            raise KVTransferError(
                f"receiver wrote {ack.blocks_written} of {len(push.src)} blocks for {push.notification}"
            )
        return ack

    # --------------------------------------------------------------- helpers
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            server, self._server = self._server, None
        for peer in peers:
            peer.executor.shutdown(wait=False, cancel_futures=True)
            peer.channel.close()  # cancels a stream in flight: its handle reports failure
        for peer in peers:
            peer.executor.shutdown(wait=True)
        if server is not None:
            server.stop(grace=1.0).wait(timeout=5.0)
        self._pool = None
