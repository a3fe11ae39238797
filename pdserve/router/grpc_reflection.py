"""gRPC server reflection in both versions, ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha, and its lookups go through the protobuf descriptor pool, whose upb
implementation does not resolve a method (``pdserve.PDServe.Generate``) or an enum value as a symbol, so
``grpcurl describe pdserve.PDServe.Generate`` found nothing. Here:

- ``SymbolPool`` wraps a pool and resolves those symbols too (a method to its service's file, an enum
  value to its enum's file);
- v1 is served by the same servicer: its messages are v1alpha's field for field (only the package
  differs), so one handler parses both; v1's schema is registered in the pool (a renamed copy of
  v1alpha's file) so that reflection can describe itself in both versions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection_pb2

V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class SymbolPool:
    """A descriptor pool whose ``FindFileContainingSymbol`` also finds methods and enum values."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            parent, _, leaf = symbol.rpartition(".")
            if not parent:
                raise
        try:
            service = self._pool.FindServiceByName(parent)
        except KeyError:
            service = None
        if service is not None and leaf in service.methods_by_name:
            return service.file
        try:
            enum = self._pool.FindEnumTypeByName(parent)
        except KeyError:
            enum = None
        if enum is not None and leaf in enum.values_by_name:
            return enum.file
        raise KeyError(f"Couldn't find symbol {symbol}")


def _register_v1_schema(pool: Any) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool`` (v1alpha's file with the v1 package)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    proto.options.Clear()
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) on ``server`` for ``service_names`` and for reflection itself."""
    pool = descriptor_pool.Default()
    _register_v1_schema(pool)
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection_aio.ReflectionServicer(names, pool=SymbolPool(pool))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (V1_SERVICE, V1ALPHA_SERVICE):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )


__all__ = ["V1ALPHA_SERVICE", "V1_SERVICE", "SymbolPool", "enable_reflection"]
