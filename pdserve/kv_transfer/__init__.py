"""Moving KV-cache blocks between worker processes: one interface, two transports.

- ``"nixl"``: NIXL with the UCX backend (RDMA/NVLink on a cluster; shared memory or TCP on one
  machine), one-sided WRITEs with a notification per push.
- ``"grpc"``: a client-streaming gRPC service on the receiver; the fallback and the easy one to debug.

Use :func:`make_transport` to build one; see :class:`kv_transfer.base.KVTransport` for the contract.
"""

from __future__ import annotations

if __name__ != "pdserve.kv_transfer":  # imported as a top-level `kv_transfer` (the repository's link to this folder)
    raise ImportError(f"import pdserve.kv_transfer, not {__name__}: pdserve's parts have one import name each")

from typing import TYPE_CHECKING

from pdserve.kv_transfer.base import (
    TRANSPORT_KINDS,
    ChunkNotification,
    KVTransferError,
    KVTransport,
    PoolLayout,
    PushHandle,
    TransferTarget,
)

if TYPE_CHECKING:
    from pdserve.kv_transfer.nixl_transport import NixlConfig
    from pdserve.transport_config import GrpcConfig

__all__ = [
    "TRANSPORT_KINDS",
    "ChunkNotification",
    "KVTransferError",
    "KVTransport",
    "PoolLayout",
    "PushHandle",
    "TransferTarget",
    "make_transport",
]


def make_transport(kind: str, config: NixlConfig | GrpcConfig | None = None) -> KVTransport:
    """Build a transport of ``kind`` (``"nixl"`` or ``"grpc"``) with an optional config.

    The transport modules are imported lazily, so a gRPC-only process never loads NIXL.
    Raises ``ValueError`` for an unknown kind or a config of the wrong type.
    """
    if kind == "nixl":
        from pdserve.kv_transfer.nixl_transport import NixlConfig, NixlTransport

        if config is not None and not isinstance(config, NixlConfig):
            raise ValueError(f"the nixl transport takes a NixlConfig, got {type(config).__name__}")
        return NixlTransport(config)
    if kind == "grpc":
        from pdserve.kv_transfer.grpc_transport import GrpcTransport
        from pdserve.transport_config import GrpcConfig

        if config is not None and not isinstance(config, GrpcConfig):
            raise ValueError(f"the grpc transport takes a GrpcConfig, got {type(config).__name__}")
        return GrpcTransport(config)
    raise ValueError(f"unknown KV transport kind {kind!r}; expected one of {', '.join(TRANSPORT_KINDS)}")
