"""Server reflection, both versions, as standard tools use it: grpcurl, and a client with no generated code.

The gRPC server runs on a stand-in router (no Ray, no model): what is under test is the front door's
schema service and its token rules, not the engine (``test_grpc_conventions`` drives a real deployment).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator, Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import grpc
import pytest
from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection_pb2

from pdserve.messages import RequestMetrics
from pdserve.router.router import GenerateInput, RouterEvent
from pdserve.router.server import ServerSecurity, has_bearer_token, start_server

TOKEN = "s3cret-token"
GRPCURL = shutil.which("grpcurl") or os.path.join(os.path.dirname(sys.executable), "grpcurl")


class EchoRouter:
    """Stands in for ``Router``: Generate answers the prompt's characters back, one per message."""

    router_id = "router-test"
    config = SimpleNamespace(max_request_bytes=1 << 20, default_mode="colocated")
    policy = SimpleNamespace(prefill=[], decode=["decode-0"])
    active: ClassVar[dict[str, Any]] = {}

    async def health(self) -> tuple[bool, str]:
        return True, "ok"

    async def generate(self, req: GenerateInput) -> AsyncGenerator[RouterEvent, None]:
        text = str(req.prompt)[: req.params.max_tokens]
        for i, char in enumerate(text):
            last = i == len(text) - 1
            metrics = RequestMetrics(req.request_id or "r", "colocated", "decode-0", num_output_tokens=len(text))
            yield RouterEvent([ord(char)], char, "length" if last else None, metrics if last else None)


class ServerThread:
    """The gRPC server on its own event loop in a thread, so tests can call it synchronously."""

    def __init__(self, security: ServerSecurity) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            start_server(EchoRouter(), "127.0.0.1", 0, security),
            self.loop,  # type: ignore[arg-type]
        ).result(30)
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    s = ServerThread(ServerSecurity(auth_token=TOKEN))
    yield s
    s.stop()


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=60)


def test_grpcurl_lists_and_describes_methods_without_the_token(server):
    listed = grpcurl(server.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == {
        "pdserve.PDServe",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = grpcurl(server.address, "describe", "pdserve.PDServe.Generate")
    assert described.returncode == 0, described.stdout + described.stderr
    assert "rpc Generate ( .pdserve.GenerateRequest ) returns ( stream .pdserve.GenerateResponse )" in described.stdout
    enum_value = grpcurl(server.address, "describe", "pdserve.Mode.AUTO")
    assert enum_value.returncode == 0 and "AUTO" in enum_value.stdout, enum_value.stderr
    message = grpcurl(server.address, "describe", "pdserve.SamplingParams")
    assert "max_tokens" in message.stdout


def test_grpcurl_calls_generate_from_reflected_schema_only_with_the_token(server):
    request = json.dumps({"text": "hey", "sampling": {"max_tokens": 3}})
    refused = grpcurl("-d", request, server.address, "pdserve.PDServe/Generate")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
    answered = grpcurl(
        "-H", f"authorization: bearer {TOKEN}", "-d", request, server.address, "pdserve.PDServe/Generate"
    )
    assert answered.returncode == 0, answered.stderr
    messages = [json.loads(m) for m in answered.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) == "hey"
    assert messages[-1]["finished"] and messages[-1]["finish_reason"] == "length"
    health = grpcurl(server.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr


def _reflect(channel: grpc.Channel, version: str, **request: Any) -> reflection_pb2.ServerReflectionResponse:
    """One reflection round trip on ``grpc.reflection.<version>`` (the two versions' messages are the same)."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10)))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_a_client_built_from_reflection_alone_streams_generate(server, version):
    with grpc.insecure_channel(server.address) as channel:
        services = _reflect(channel, version, list_services="")
        names = {s.name for s in services.list_services_response.service}
        assert {"pdserve.PDServe", f"grpc.reflection.{version}.ServerReflection"} <= names
        found = _reflect(channel, version, file_containing_symbol="pdserve.PDServe.Generate")
        assert not found.HasField("error_response"), found.error_response
        pool = DescriptorPool()
        for raw in found.file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
        method = pool.FindMethodByName("pdserve.PDServe.Generate")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_stream(
            "/pdserve.PDServe/Generate",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        request = request_cls(text="hello", sampling={"max_tokens": 4})
        responses = list(call(request, timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")]))
        assert "".join(r.text for r in responses) == "hell"
        assert responses[-1].finished and responses[-1].metadata.num_output_tokens == 4
        missing = _reflect(channel, version, file_containing_symbol="pdserve.PDServe.NoSuchMethod")
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_reflection_describes_itself_in_both_versions(server):
    with grpc.insecure_channel(server.address) as channel:
        for version in ("v1", "v1alpha"):
            found = _reflect(channel, version, file_containing_symbol=f"grpc.reflection.{version}.ServerReflection")
            raws = found.file_descriptor_response.file_descriptor_proto
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in raws]
            assert files[0].package == f"grpc.reflection.{version}"
            assert files[0].service[0].method[0].input_type == f".grpc.reflection.{version}.ServerReflectionRequest"


def test_bearer_scheme_is_case_insensitive_and_the_token_exact():
    assert has_bearer_token("Bearer abc", "abc")
    assert has_bearer_token("bearer abc", "abc")
    assert has_bearer_token(b"BEARER abc", "abc")
    assert not has_bearer_token("Bearer abcd", "abc")
    assert not has_bearer_token("Basic abc", "abc")
    assert not has_bearer_token("abc", "abc")
    assert not has_bearer_token("", "abc")
