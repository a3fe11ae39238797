"""The router's gRPC server speaks the standard health-checking and reflection services.

Driven with the clients grpcio-health-checking and grpcio-reflection ship, against a real local
deployment whose only decode worker is killed at the end (the last test): health turns NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.router import GenerateInput, ModelLimits, RequestError, Router

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=200, max_num_batched_tokens=48, torch_threads=1, max_model_len=1024
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = DeploymentConfig(engine=ENGINE, num_decode_workers=1, transport="grpc", http_port=0)
    with Deployment(config) as d:
        yield d


@pytest.fixture
def channel(deployment):
    with grpc.insecure_channel(deployment.address) as ch:
        yield ch


def test_health_check_says_serving_for_the_server_and_the_service(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.PDServe"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_describes_pdserve_well_enough_to_call_it(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    assert {"pdserve.PDServe", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        db.get_services()
    )
    pool = DescriptorPool(db)
    service = pool.FindServiceByName("pdserve.PDServe")
    assert {m.name for m in service.methods} == {"Generate", "Abort", "Health", "Stats"}
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming and generate.input_type.full_name == "pdserve.GenerateRequest"

    # A client with no generated code at all, as grpcurl is: messages built from the reflected descriptors.
    request_cls = message_factory.GetMessageClass(generate.input_type)
    response_cls = message_factory.GetMessageClass(generate.output_type)
    request = request_cls(text="Hello", sampling={"max_tokens": 5, "ignore_eos": True})
    call = channel.unary_stream(
        "/pdserve.PDServe/Generate",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    responses = list(call(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 5
    assert responses[-1].finished and responses[-1].finish_reason == "length"


def _watch(channel: grpc.Channel, seen: list[int], stop: threading.Event) -> threading.Thread:
    """Record every status the Watch stream sends until NOT_SERVING (or ``stop``)."""
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service="pdserve.PDServe"), timeout=120)

    def run() -> None:
        try:
            for response in call:
                seen.append(response.status)
                if response.status == NOT_SERVING or stop.is_set():
                    break
        except grpc.RpcError:
            pass
        finally:
            call.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _http_status(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_killing_the_only_decode_worker_makes_every_front_door_say_so(deployment, channel, caplog):
    """Runs last: it leaves the deployment without a decode worker."""
    stub = health_pb2_grpc.HealthStub(channel)
    seen: list[int] = []
    stop = threading.Event()
    watcher = _watch(channel, seen, stop)
    caplog.set_level(logging.DEBUG, logger="pdserve.router.router")

    async def a_request_in_flight_when_the_worker_dies() -> RequestError:
        # A router in this process, over the same workers, so that its log records can be read here.
        limits = ModelLimits(ByteTokenizer.VOCAB_SIZE, ENGINE.max_model_len)
        router = Router(RouterConfig(), deployment.decode_workers, [], limits, ByteTokenizer(), "probe")
        await router.start()
        try:
            params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
            stream = router.generate(GenerateInput("client-7", "Hello", params, None))
            await anext(stream)  # it is running on decode-0
            ray.kill(deployment.decode_workers[0].actor, no_restart=True)
            with pytest.raises(RequestError) as err:
                async for _ in stream:
                    pass
            return err.value
        finally:
            await router.close()

    error = asyncio.run(a_request_in_flight_when_the_worker_dies())
    assert error.code == "UNAVAILABLE"
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.router.router"]
    # the workers know the request as <client id>@<router id>.<n>; the router logs that id as it starts and fails
    assert any(level == logging.DEBUG and "client-7@probe.0" in m and "starts" in m for level, m in records), records
    assert any(level == logging.WARNING and "client-7@probe.0" in m and "failed" in m for level, m in records), records

    deadline = time.monotonic() + 20
    statuses: list[int] = []
    while True:
        statuses = [
            stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=10).status for s in ("", "pdserve.PDServe")
        ]
        if statuses == [NOT_SERVING, NOT_SERVING]:
            break
        assert time.monotonic() < deadline, f"health still {statuses} after the decode worker died"
        time.sleep(0.2)
    watcher.join(timeout=10)
    stop.set()
    assert seen[0] == SERVING and seen[-1] == NOT_SERVING, seen

    status, body = _http_status(deployment.http_url + "/health")
    assert status == 503 and body["ok"] is False and "decode-0" in body["status"]
    status, body = _http_status(deployment.http_url + "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert (
        status == 503
        and body["error"]["code"] == "unavailable"
        and body["error"]["type"] == "service_unavailable_error"
    )
