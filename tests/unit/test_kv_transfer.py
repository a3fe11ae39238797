"""KV transfer: both transports between two real processes (Ray actors), plus input validation.

The cross-process tests start one local Ray cluster for the module and stop it afterwards;
every wait in them is bounded.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pdserve.kv_transfer import (
    ChunkNotification,
    KVTransferError,
    KVTransport,
    TransferTarget,
    make_transport,
)
from pdserve.kv_transfer.base import HostStaging, block_checksums, pool_bytes_view
from pdserve.kv_transfer.grpc_transport import _parse_payload, _serialize_payload
from pdserve.kv_transfer.nixl_transport import NixlConfig
from pdserve.proto import kv_transfer_pb2 as pb
from pdserve.proto import kv_transfer_pb2_grpc as pb_grpc
from pdserve.transport_config import GrpcConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ["nixl", "grpc"]
# [num_blocks, layers, K/V, block_size, kv_heads, head_dim]: block-major like the engine's pool.
BLOCK_SHAPE = (2, 2, 4, 2, 8)
NUM_BLOCKS = 32


def _pool(num_blocks: int = NUM_BLOCKS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros((num_blocks, *BLOCK_SHAPE), dtype=dtype)


def _notif(chunk: int = 0, last: bool = False, rid: str = "req-1") -> ChunkNotification:
    return ChunkNotification(rid, chunk, 16 * (chunk + 1), last)


@dataclass
class Pair:
    sender: KVTransport
    receiver: KVTransport
    target: TransferTarget
    src_pool: torch.Tensor
    dst_pool: torch.Tensor


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """An in-process sender and receiver of the parametrized kind, pools registered."""
    kind = request.param
    sender, receiver = make_transport(kind), make_transport(kind)
    src_pool, dst_pool = torch.randn((NUM_BLOCKS, *BLOCK_SHAPE)), _pool()
    try:
        sender.register_pool(src_pool)
        receiver.register_pool(dst_pool)
        yield Pair(sender, receiver, receiver.describe(), src_pool, dst_pool)
    finally:
        sender.close()
        receiver.close()


def _poll_until(transport: KVTransport, count: int, timeout_s: float = 10.0) -> list[ChunkNotification]:
    out: list[ChunkNotification] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < deadline:
        out += transport.poll_notifications()
        time.sleep(0.001)
    return out


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "notif",
    [
        ChunkNotification("req-1", 0, 0, False),
        ChunkNotification("r", 7, 4096, True),
        ChunkNotification("リクエスト/ünïcode:42", 2**32 - 1, 2**63 - 1, True),
        ChunkNotification("checked", 3, 64, False, first_block=5, block_checksums=(0, 1, 2**32 - 1)),
    ],
)
def test_chunk_notification_round_trip(notif: ChunkNotification) -> None:
    data = notif.to_bytes()
    assert isinstance(data, bytes)
    back = ChunkNotification.from_bytes(data)
    assert back == notif
    assert type(back.is_last) is bool


@pytest.mark.parametrize("data", [b"", b"PDKV1", b"garbage that is long enough to parse", b"PDKV1" + bytes(13)])
def test_chunk_notification_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkNotification.from_bytes(data)


def test_chunk_notification_rejects_bad_corrupt_flag() -> None:
    data = bytearray(ChunkNotification("r", 1, 2, True).to_bytes())
    data[len(b"PDKV1") + 12] = 7  # the is_last byte
    with pytest.raises(ValueError, match="is_last"):
        ChunkNotification.from_bytes(bytes(data))


@pytest.mark.parametrize(
    "args",
    [("", 0, 0, False), ("r", -1, 0, False), ("r", 0, -5, False), ("r", 0, 0, 1), ("r", 2**32, 0, False)],
)
def test_chunk_notification_validates_fields(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        ChunkNotification(*args)


def test_transfer_target_is_frozen_and_picklable() -> None:
    t = TransferTarget("nixl", "abc", 8, 1024, "cpu", "agent", b"\x00SECRET", 0x1000, "")
    assert pickle.loads(pickle.dumps(t)) == t
    with pytest.raises(AttributeError):
        t.num_blocks = 9  # type: ignore[misc]
    assert "SECRET" not in repr(t) and "metadata=7B" in repr(t)  # blob stays out of logs


def test_make_transport_rejects_unknown_kind_and_wrong_config() -> None:
    with pytest.raises(ValueError, match="unknown KV transport kind 'rdma'"):
        make_transport("rdma")
    with pytest.raises(ValueError, match="NixlConfig"):
        make_transport("nixl", GrpcConfig())
    with pytest.raises(ValueError, match="GrpcConfig"):
        make_transport("grpc", NixlConfig())


def test_nixl_config_rejects_empty_ucx_tls_and_unknown_error_mode() -> None:
    assert NixlConfig() == NixlConfig(False, "none", None, None)
    with pytest.raises(ValueError, match="empty UCX_TLS"):
        NixlConfig(ucx_tls="")
    with pytest.raises(ValueError, match="ucx_error_handling_mode"):
        NixlConfig(ucx_error_handling_mode="loud")


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kind", KINDS)
def test_bad_pools_and_order_of_calls(kind: str) -> None:
    t = make_transport(kind)
    other = make_transport(kind)
    try:
        with pytest.raises(ValueError, match="describe\\(\\) before register_pool"):
            t.describe()
        other.register_pool(_pool())
        with pytest.raises(ValueError, match="push\\(\\) before register_pool"):
            t.push(other.describe(), [0], [0], _notif())
        with pytest.raises(ValueError, match=r"torch\.Tensor"):
            t.register_pool([1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="contiguous"):
            t.register_pool(_pool().transpose(0, 1))
        with pytest.raises(ValueError, match="at least one block"):
            t.register_pool(torch.zeros(0, 4))
        t.register_pool(_pool())
        with pytest.raises(ValueError, match="already registered"):
            t.register_pool(_pool())
    finally:
        t.close()
        other.close()
    t.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        t.describe()


@pytest.mark.parametrize("pair", KINDS, indirect=True)
@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 1], [2], "src_block_ids has 2 ids but dst_block_ids has 1"),
        ([NUM_BLOCKS], [0], "src_block_ids \\(local pool\\) out of range"),
        ([-1], [0], "src_block_ids \\(local pool\\) out of range"),
        ([0], [NUM_BLOCKS + 3], "dst_block_ids \\(target .*\\) out of range"),
        ([0, 1], [5, 5], "duplicates"),
        ([0.5], [1], "must contain ints"),
        ("ab", [1, 2], "sequence of ints"),
    ],
)
def test_push_rejects_bad_ids(pair: Pair, src: Any, dst: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pair.sender.push(pair.target, src, dst, _notif())
    assert _poll_until(pair.receiver, 1, timeout_s=0.2) == []


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_push_rejects_unknown_targets(pair: Pair) -> None:
    sender, target = pair.sender, pair.target
    other_kind = "grpc" if target.kind == "nixl" else "nixl"
    cases = [
        (TransferTarget(other_kind, "x", NUM_BLOCKS, target.block_bytes), "unknown target"),
        (
            TransferTarget(target.kind, "x", NUM_BLOCKS, target.block_bytes, agent_name="a", agent_metadata=b""),
            "unknown target",
        ),
        (TransferTarget(target.kind, "", NUM_BLOCKS, target.block_bytes), "unknown target"),
        ("not a target", "TransferTarget"),
    ]
    if target.kind == "nixl":
        cases.append(
            (
                TransferTarget("nixl", "y", NUM_BLOCKS, target.block_bytes, agent_name="a", agent_metadata=b"junk"),
                "unknown target",
            )
        )
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            sender.push(bad, [0], [0], _notif())  # type: ignore[arg-type]
    mismatch = TransferTarget(**{**target.__dict__, "block_bytes": target.block_bytes * 2})
    with pytest.raises(ValueError, match="block size mismatch"):
        sender.push(mismatch, [0], [0], _notif())
    with pytest.raises(ValueError, match="ChunkNotification"):
        sender.push(target, [0], [0], ("req", 0, 1, True))  # type: ignore[arg-type]


# ------------------------------------------------------------- in-process paths


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_in_process_push_and_notification_only_push(pair: Pair) -> None:
    sender, receiver, target = pair.sender, pair.receiver, pair.target
    src_pool, dst_pool = pair.src_pool, pair.dst_pool
    h = sender.push(target, torch.tensor([4, 2]), (7, 30), _notif(0))
    h.wait(10.0)
    assert h.done() and h.num_blocks == 2 and h.num_bytes == 2 * target.block_bytes
    h2 = sender.push(target, [], [], _notif(1, last=True))
    h2.wait(10.0)
    got = _poll_until(receiver, 2)
    assert sorted(got, key=lambda n: n.chunk_index) == [_notif(0), _notif(1, last=True)]
    assert torch.equal(dst_pool[7], src_pool[4]) and torch.equal(dst_pool[30], src_pool[2])
    untouched = [i for i in range(NUM_BLOCKS) if i not in (7, 30)]
    assert not dst_pool[untouched].any()
    assert receiver.poll_notifications() == []  # each notification is returned once


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)  # NIXL: between processes, in the serving tests
def test_block_checksums_travel_with_the_notification_and_match_the_copy(pair: Pair) -> None:
    sums = block_checksums(pair.src_pool, [4, 2])
    note = ChunkNotification("req-1", 0, 32, True, first_block=3, block_checksums=sums)
    pair.sender.push(pair.target, [4, 2], [7, 30], note).wait(10.0)
    assert _poll_until(pair.receiver, 1) == [note]
    assert block_checksums(pair.dst_pool, [7, 30]) == sums != block_checksums(pair.dst_pool, [30, 7])


def test_host_staging_of_a_cpu_tensor_is_the_tensor_itself() -> None:
    staging = HostStaging()
    blocks = pool_bytes_view(_pool())[3:5]
    with staging.copy(blocks) as host:
        assert host is blocks  # no copy, no buffer: CPU memory is already on the host
    assert staging.capacity == 0 and not staging.pinned


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_cancel_after_a_push_landed_is_a_no_op(pair: Pair) -> None:
    h = pair.sender.push(pair.target, [1], [2], _notif())
    h.wait(10.0)
    assert h.cancel() and h.done()


def test_grpc_receiver_checks_and_copies_under_its_write_lock() -> None:
    """A receiver that withdraws a reservation under ``write_lock`` gets no write of it afterwards."""
    sender, receiver = make_transport("grpc"), make_transport("grpc")
    try:
        src = torch.randn((NUM_BLOCKS, *BLOCK_SHAPE))
        sender.register_pool(src)
        receiver.register_pool(dst := _pool())
        target = receiver.describe()
        reserved = {"req-1"}
        receiver.set_push_filter(lambda rid, ids, sender: rid in reserved)
        with receiver.write_lock:  # a push arriving now waits: the check and copy hold this lock
            h = sender.push(target, [1], [2], _notif())
            time.sleep(0.5)
            assert not dst[2].any() and not h.done()
            reserved.clear()  # withdrawn while the push waits
        with pytest.raises(KVTransferError, match="PERMISSION_DENIED"):
            h.wait(10.0)
        assert not dst[2].any() and receiver.num_pushes_refused == 1
    finally:
        sender.close()
        receiver.close()


def test_grpc_cancel_stops_a_push_in_flight() -> None:
    sender, receiver = make_transport("grpc"), make_transport("grpc")
    try:
        sender.register_pool(torch.randn((NUM_BLOCKS, *BLOCK_SHAPE)))
        receiver.register_pool(_pool())
        target = receiver.describe()
        with receiver.write_lock:  # the stream cannot finish
            h = sender.push(target, [1], [2], _notif())
            time.sleep(0.2)
            assert h.cancel()
            with pytest.raises(KVTransferError, match=r"cancelled|CANCELLED"):
                h.wait(2.0)
    finally:
        sender.close()
        receiver.close()


def test_grpc_receiver_binds_and_advertises_the_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    assert GrpcConfig().bind_host() == "127.0.0.1"  # outside Ray
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.2")  # this node, as Ray knows it
    receiver = make_transport("grpc")
    try:
        receiver.register_pool(_pool())
        assert receiver.describe().address.startswith("127.0.0.2:")
        explicit = make_transport("grpc", GrpcConfig(host="127.0.0.1"))
        explicit.register_pool(_pool())
        assert explicit.describe().address.startswith("127.0.0.1:")
        explicit.close()
    finally:
        receiver.close()


def test_grpc_push_to_a_closed_receiver_fails_within_its_deadline() -> None:
    sender = make_transport("grpc", GrpcConfig(push_timeout_s=5.0))
    receiver = make_transport("grpc")
    try:
        sender.register_pool(_pool())
        receiver.register_pool(_pool())
        target = receiver.describe()
        receiver.close()
        h = sender.push(target, [1], [2], _notif())
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match=r"UNAVAILABLE|DEADLINE"):
            h.wait(10.0)
        assert time.monotonic() - t0 < 9.0
        with pytest.raises(KVTransferError):
            h.done()  # keeps reporting the failure
    finally:
        sender.close()
        receiver.close()


def test_grpc_wire_format_is_plain_block_payload() -> None:
    header = pb.BlockPayload(target_id="t", block_bytes=3, dst_block_ids=[5, 1])
    header.notification.CopyFrom(pb.ChunkNotice(request_id="r", chunk_index=2, tokens_done=9, is_last=True))
    raw = _serialize_payload(header, [b"abc", memoryview(b"xyz")], 6)
    standard = pb.BlockPayload.FromString(raw)
    assert standard.data == b"abcxyz" and list(standard.dst_block_ids) == [5, 1]
    parsed = _parse_payload(raw)
    assert bytes(parsed.data) == b"abcxyz"
    assert parsed.header.notification.request_id == "r" and list(parsed.header.dst_block_ids) == [5, 1]
    # and the other way round: a payload serialized by protobuf itself
    full = pb.BlockPayload(target_id="t", block_bytes=3, dst_block_ids=[1], data=b"qrs")
    parsed = _parse_payload(full.SerializeToString())
    assert bytes(parsed.data) == b"qrs" and parsed.header.target_id == "t"
    with pytest.raises(ValueError):
        _parse_payload(raw[:-2])


def test_grpc_receiver_validates_streams_from_the_generated_stub() -> None:
    receiver = make_transport("grpc")
    pool = _pool()
    try:
        receiver.register_pool(pool)
        target = receiver.describe()
        bb = target.block_bytes
        block = torch.arange(bb, dtype=torch.int64).remainder(251).to(torch.uint8)
        with grpc.insecure_channel(target.address, options=GrpcConfig().channel_options()) as ch:
            stub = pb_grpc.KVTransferStub(ch)
            notice = pb.ChunkNotice(request_id="std", chunk_index=0, tokens_done=4, is_last=True)

            def msg(**kw: Any) -> pb.BlockPayload:
                base: dict[str, Any] = {
                    "target_id": target.target_id,
                    "block_bytes": bb,
                    "dst_block_ids": [3],
                    "data": block.numpy().tobytes(),
                }
                base.update(kw)
                return pb.BlockPayload(**base)

            std = [("x-pdserve-request-id", "std")]  # the request whose reservation it writes into
            ack = stub.PushBlocks(iter([msg(notification=notice)]), timeout=10, metadata=std)
            assert ack.blocks_written == 1 and ack.bytes_written == bb
            assert torch.equal(pool_bytes_view(pool)[3], block)
            assert _poll_until(receiver, 1) == [ChunkNotification("std", 0, 4, True)]

            bad_streams = {
                "unknown target id": [msg(target_id="nope", notification=notice)],
                "block size mismatch": [msg(block_bytes=bb + 1, notification=notice)],
                "out of range": [msg(dst_block_ids=[NUM_BLOCKS], notification=notice)],
                "payload has": [msg(data=b"short", notification=notice)],
                "without a notification": [msg()],
            }
            for match, stream in bad_streams.items():
                with pytest.raises(grpc.RpcError) as info:
                    stub.PushBlocks(iter(stream), timeout=10, metadata=std)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert match in info.value.details()
            assert receiver.poll_notifications() == []  # failed pushes deliver nothing
    finally:
        receiver.close()


# ------------------------------------------------------- across two processes


def test_grpc_receiver_refuses_pushes_without_the_secret_or_outside_a_reservation() -> None:
    receiver = make_transport("grpc", GrpcConfig(secret="deployment-secret"))
    strangers = make_transport("grpc")
    insiders = make_transport("grpc", GrpcConfig(secret="deployment-secret"))
    try:
        dst_pool = _pool()
        receiver.register_pool(dst_pool)
        receiver.set_push_filter(lambda rid, ids, sender: rid == "req-1" and set(ids) <= {3, 4})
        target = receiver.describe()
        for t in (strangers, insiders):
            t.register_pool(_pool().normal_())
        with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
            strangers.push(target, [1], [3], _notif()).wait(10.0)
        with pytest.raises(KVTransferError, match="PERMISSION_DENIED"):
            insiders.push(target, [1], [5], _notif()).wait(10.0)  # not a reserved block
        with pytest.raises(KVTransferError, match="PERMISSION_DENIED"):
            insiders.push(target, [1], [3], _notif(rid="req-2")).wait(10.0)  # no such reservation
        assert receiver.num_pushes_refused == 3
        assert not dst_pool.any() and receiver.poll_notifications() == []
        insiders.push(target, [1, 2], [3, 4], _notif(last=True)).wait(10.0)
        assert torch.equal(dst_pool[3], insiders._pool[1]) and torch.equal(dst_pool[4], insiders._pool[2])
        assert _poll_until(receiver, 1) == [_notif(last=True)]
    finally:
        for t in (receiver, strangers, insiders):
            t.close()


def _landed(pool: torch.Tensor) -> int:
    return int((pool_bytes_view(pool)[:, :64] == 7).all(dim=1).sum())


@pytest.fixture
def tcp_nixl_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[KVTransport, KVTransport, torch.Tensor]]:
    """Two real NIXL agents over UCX TCP: 64 blocks of 1 MiB, the sender's all 7s, the receiver's zeros. With
    TCP a WRITE lands only while the receiver's agent makes progress (``poll_notifications``)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when each agent's UCX context is created
    sender, receiver = make_transport("nixl"), make_transport("nixl")
    dst = torch.zeros((64, 1 << 20), dtype=torch.uint8)
    try:
        sender.register_pool(torch.full((64, 1 << 20), 7, dtype=torch.uint8))
        receiver.register_pool(dst)
        target = receiver.describe()
        warm = sender.push(target, [0], [0], _notif(rid="warm"))  # connect before the test's push
        deadline = time.monotonic() + 10
        while not warm.done():
            receiver.poll_notifications()
            assert time.monotonic() < deadline, "the warm-up push did not land"
        dst.zero_()
        yield sender, receiver, dst
    finally:
        sender.close()
        receiver.close()


def test_a_nixl_cancel_is_confirmed_only_once_no_byte_of_the_push_can_land(tcp_nixl_pair) -> None:
    """NIXL cannot stop a posted WRITE (releasing it does not stop the bytes already queued): a cancel reports
    success only once NIXL says the transfer is over, and after that success no byte of it lands."""
    sender, receiver, dst = tcp_nixl_pair
    target = receiver.describe()
    h = sender.push(target, list(range(1, 64)), list(range(1, 64)), _notif(last=True, rid="cancelled"))
    for _ in range(20):  # the sender drives its side; the receiver makes no progress
        assert not h.done()
    assert _landed(dst) == 0
    for _ in range(50):  # the receiver stays silent (a stopped process): the cancel cannot be confirmed
        assert not h.cancel(), "a cancel confirmed while the WRITE may still land"
        time.sleep(0.002)
    confirmed: tuple[int, float] | None = None  # (blocks landed, time) when the cancel was confirmed
    deadline = time.monotonic() + 20
    while confirmed is None or time.monotonic() < confirmed[1] + 0.5:
        receiver.poll_notifications()  # the receiver runs again: the WRITE's bytes land as it progresses
        landed = _landed(dst)
        if confirmed is None:
            assert time.monotonic() < deadline, "the cancel was never confirmed while the receiver progressed"
            if h.cancel():
                confirmed = (landed, time.monotonic())
        else:
            assert landed == confirmed[0], f"{landed - confirmed[0]} blocks landed after the cancel was confirmed"


def test_grpc_pushes_prove_the_secret_without_sending_it() -> None:
    """What travels is an HMAC of the push's ids: a receiver that records every push's metadata never sees the
    secret, and a proof made for one request does not pass for another."""
    import concurrent.futures as cf

    from pdserve.kv_transfer.grpc_transport import push_proof

    seen: list[dict[str, str]] = []

    def record(request_iterator: Any, context: grpc.ServicerContext) -> pb.PushAck:
        seen.append(dict(context.invocation_metadata()))
        for _ in request_iterator:
            pass
        return pb.PushAck(blocks_written=1)

    server = grpc.server(cf.ThreadPoolExecutor(2))
    handler = grpc.stream_unary_rpc_method_handler(
        record, request_deserializer=lambda b: b, response_serializer=pb.PushAck.SerializeToString
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.kv.KVTransfer", {"PushBlocks": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sender = make_transport("grpc", GrpcConfig(secret="deployment-secret"))
    try:
        sender.register_pool(_pool().normal_())
        target = TransferTarget(
            "grpc", "eavesdropper", NUM_BLOCKS, sender.layout.block_bytes, address=f"127.0.0.1:{port}"
        )  # type: ignore[union-attr]
        sender.push(target, [1], [3], _notif()).wait(10.0)
        [metadata] = seen
        assert not any("deployment-secret" in value for value in metadata.values())
        proof = metadata["x-pdserve-kv-auth"]
        assert proof == push_proof("deployment-secret", "eavesdropper", "req-1", sender.sender_id)
        assert proof != push_proof("deployment-secret", "eavesdropper", "req-2", sender.sender_id)
    finally:
        sender.close()
        server.stop(0)


def test_grpc_kv_service_with_a_certificate_speaks_tls_only() -> None:
    from support.certs import make_ca_and_server_cert

    _, cert, key = make_ca_and_server_cert()
    tls = GrpcConfig(host="127.0.0.1", secret="s", tls_cert_chain=cert, tls_private_key=key)
    receiver, sender, plain = (
        make_transport("grpc", tls),
        make_transport("grpc", tls),
        make_transport("grpc", GrpcConfig(secret="s")),
    )
    try:
        receiver.register_pool(dst := _pool())
        target = receiver.describe()
        for t in (sender, plain):
            t.register_pool(_pool().normal_())
        sender.push(target, [1], [3], _notif()).wait(10.0)  # trusts the deployment's certificate
        assert torch.equal(dst[3], sender._pool[1])  # type: ignore[index]
        with pytest.raises(KVTransferError, match="UNAVAILABLE"):
            plain.push(target, [2], [4], _notif(rid="req-2")).wait(10.0)  # plaintext is not served
        assert not dst[4].any()
    finally:
        for t in (receiver, sender, plain):
            t.close()


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_notifications_name_their_sender(pair: Pair) -> None:
    pair.sender.push(pair.target, [1], [2], _notif(last=True)).wait(10.0)
    [note] = _poll_until(pair.receiver, 1)
    assert note.sender == pair.sender.sender_id and note.sender
