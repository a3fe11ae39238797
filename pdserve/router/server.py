"""The gRPC front door (``grpc.aio``): proto messages in and out, the Router does the work.

Besides the ``pdserve.PDServe`` service the server speaks the standard ``grpc.health.v1.Health``
(Check and Watch) and server reflection in both versions (``grpc_reflection``), so grpc_health_probe,
grpcurl and load balancers work; with a bearer token set, health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import grpc
from google.protobuf import empty_pb2, unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.tokenizer import Tokenizer
from pdserve.net import is_loopback
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.choices import Choices
from pdserve.router.client import CLIENT_ID_KEY
from pdserve.router.grpc_reflection import V1_SERVICE, V1ALPHA_SERVICE, enable_reflection
from pdserve.router.router import RequestError, Router, RouterEvent
from pdserve.router.wire import (
    GRPC_OPTIONS,
    MODE_ENUMS,
    MODE_NAMES,
    logprobs_to_proto,
    metrics_to_proto,
    params_from_proto,
    worker_stats_to_proto,
)

log = logging.getLogger(__name__)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with ``code``: ``context.abort`` raises, and this says so to the type checker."""
    await context.abort(code, details)
    raise AssertionError("context.abort returned")


class Malformed(NamedTuple):
    """A request body that was refused before parsing or could not be parsed; answered INVALID_ARGUMENT."""

    reason: str


def lenient_parser(message_cls: type[Message], max_bytes: int) -> Callable[[bytes], Message | Malformed]:
    """A request deserializer that turns oversized and undecodable bodies into a ``Malformed`` value.

    gRPC's own deserializer failure reaches the client as UNKNOWN; this lets the handler answer
    INVALID_ARGUMENT naming the field (e.g. ``text: not valid UTF-8``), and refuses a body over
    ``max_bytes`` before parsing it.
    """
    string_fields = {f.number: f.name for f in message_cls.DESCRIPTOR.fields if f.type == f.TYPE_STRING}

    def parse(raw: bytes) -> Message | Malformed:
        if len(raw) > max_bytes:
            return Malformed(f"request: {len(raw)} bytes is over the limit of {max_bytes} bytes")
        try:
            return message_cls.FromString(raw)
        except DecodeError:
            return Malformed(_why_undecodable(raw, string_fields))

    return parse


def _why_undecodable(raw: bytes, string_fields: dict[int, str]) -> str:
    try:
        fields = unknown_fields.UnknownFieldSet(empty_pb2.Empty.FromString(raw))
    except DecodeError:
        return "request: not a valid protobuf message"
    for field in fields:
        name = string_fields.get(field.field_number)
        if name is not None and isinstance(field.data, bytes):
            try:
                field.data.decode("utf-8")
            except UnicodeDecodeError:
                return f"{name}: not valid UTF-8"
    return "request: not a valid protobuf message"


def caller(context: grpc.aio.ServicerContext) -> str:
    """Who sent a call: the client id it names (``x-pdserve-client-id``), else its connection. A request can be
    aborted only by its own caller: another client gets ``found=False``, as for an unknown id."""
    client_id = dict(context.invocation_metadata() or ()).get(CLIENT_ID_KEY)
    return f"client:{client_id}" if client_id else f"peer:{context.peer()}"


def user_turn_prompt(tokenizer: Tokenizer | None, text: str) -> str:
    """``text`` as the user's turn through the model's chat template; as is for a model without one."""
    if tokenizer is None or tokenizer.chat_template.is_plain:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


class PDServeServicer(pb_grpc.PDServeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest | Malformed, context: grpc.aio.ServicerContext):
        if isinstance(request, Malformed):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            params = params_from_proto(request.sampling)
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        which = request.WhichOneof("prompt")
        if which is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt: give text or token_ids")
        prompt = request.text if which == "text" else request.token_ids.ids
        if request.apply_chat_template:
            if which != "text":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "apply_chat_template: needs a text prompt")
            try:
                prompt = await asyncio.to_thread(user_turn_prompt, self.router.tokenizer, request.text)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"apply_chat_template: {e}")
        if request.mode not in MODE_NAMES:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown value {request.mode}")
        try:
            choices = await Choices.start(
                self.router,
                request.request_id or None,
                [prompt],
                params,
                request.n or 1,
                MODE_NAMES[request.mode],
                tuple(request.sampling.stop),
                request.stream_interval,
                owner=caller(context),
            )
            async with contextlib.aclosing(choices.events()) as events:
                async for choice, event in events:
                    yield _response(choice.index, event)
        except RequestError as e:
            await abort(context, getattr(grpc.StatusCode, e.code), str(e))

    async def Abort(self, request: pb.AbortRequest | Malformed, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, Malformed):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        if not request.request_id:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        return pb.AbortResponse(found=await self.router.abort(request.request_id, owner=caller(context)))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        ok, status = await self.router.health()
        return pb.HealthResponse(
            ok=ok,
            status=status,
            num_prefill_workers=len(self.router.policy.prefill),
            num_decode_workers=len(self.router.policy.decode),
            default_mode=MODE_ENUMS[self.router.config.default_mode],
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        since = request.steps_since if request.include_steps else None
        workers = [worker_stats_to_proto(w) for w in await self.router.stats(since)]
        return pb.StatsResponse(workers=workers, num_active_requests=len(self.router.active))


def _response(index: int, event: RouterEvent) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token_ids=event.token_ids, text=event.text, index=index)
    if event.logprobs is not None:
        response.logprobs.extend(logprobs_to_proto(event.logprobs))
    if event.prompt_logprobs is not None:
        response.prompt_logprobs.extend(logprobs_to_proto(event.prompt_logprobs))
    if event.metrics is not None:
        response.finished = True
        response.finish_reason = event.finish_reason or ""
        response.metadata.CopyFrom(metrics_to_proto(event.metrics))
    return response


def _handlers(servicer: PDServeServicer, max_bytes: int) -> grpc.GenericRpcHandler:
    """The PDServe service's method table, with lenient, size-bounded request parsing."""

    def method(
        kind: Callable[..., Any], fn: Callable[..., Any], request_cls: type[Message], response_cls: type[Message]
    ):
        return kind(
            fn,
            request_deserializer=lenient_parser(request_cls, max_bytes),
            response_serializer=response_cls.SerializeToString,
        )

    unary = grpc.unary_unary_rpc_method_handler
    methods = {
        "Generate": method(
            grpc.unary_stream_rpc_method_handler, servicer.Generate, pb.GenerateRequest, pb.GenerateResponse
        ),
        "Abort": method(unary, servicer.Abort, pb.AbortRequest, pb.AbortResponse),
        "Health": method(unary, servicer.Health, pb.HealthRequest, pb.HealthResponse),
        "Stats": method(unary, servicer.Stats, pb.StatsRequest, pb.StatsResponse),
    }
    return grpc.method_handlers_generic_handler("pdserve.PDServe", methods)


class ServerSecurity(NamedTuple):
    """Optional protection of the client API: TLS (PEM bytes) and a bearer token."""

    auth_token: str | None = None  # clients send `authorization: Bearer <token>`
    tls_cert_chain: bytes | None = None
    tls_private_key: bytes | None = None


def has_bearer_token(authorization: str | bytes, token: str) -> bool:
    """Whether an ``authorization`` header/metadata value is ``Bearer <token>``, the token compared in constant
    time; the scheme is case-insensitive (RFC 9110: ``bearer``, ``BEARER`` are the same scheme)."""
    given = authorization.encode() if isinstance(authorization, str) else authorization
    scheme, _, credentials = given.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token.encode())


_OPEN_SERVICES = tuple(f"/{service}/" for service in ("grpc.health.v1.Health", V1_SERVICE, V1ALPHA_SERVICE))


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the expected bearer token, comparing in constant time.

    The standard health service and server reflection (both versions) stay open: load balancers and
    Kubernetes probe health without credentials, and a probe such as ``grpcurl`` needs reflection to call
    it. Reflection serves only the schema, which is public (``pdserve/proto/pdserve.proto``); every
    ``pdserve.PDServe`` call still needs the token.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self.num_refused = 0

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(_OPEN_SERVICES):
            return await continuation(details)
        if has_bearer_token(dict(details.invocation_metadata or ()).get("authorization", ""), self._token):
            return await continuation(details)
        self.num_refused += 1
        return self._deny


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PDServe"].full_name  # "pdserve.PDServe"
HEALTH_POLL_S = 1.0


class GrpcServer:
    """The router's gRPC server: the PDServe service, ``grpc.health.v1.Health`` and server reflection.

    The standard health status (for ``""`` and ``"pdserve.PDServe"``) follows ``Router.health``, polled
    every ``HEALTH_POLL_S``: SERVING while some decode worker answers, NOT_SERVING otherwise.
    """

    def __init__(
        self, server: grpc.aio.Server, port: int, health: grpc_health.aio.HealthServicer, router: Router
    ) -> None:
        self.server = server
        self.port = port
        self.health = health
        self._router = router
        self._poller = asyncio.create_task(self._poll_health())

    async def _poll_health(self) -> None:
        last: bool | None = None
        while True:
            try:
                ok, status = await self._router.health()
            except Exception as e:  # a health check that cannot run says the router cannot serve
                ok, status = False, f"health check failed: {e!r}"
            if ok != last:
                if last is not None:
                    log.warning("%s: gRPC health is now %s (%s)", self._router.router_id, _status_name(ok), status)
                for service in ("", SERVICE_NAME):
                    await self.health.set(service, _SERVING if ok else _NOT_SERVING)
                last = ok
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self, grace_s: float = 1.0) -> None:
        self._poller.cancel()
        await asyncio.gather(self._poller, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status_name(ok: bool) -> str:
    return "SERVING" if ok else "NOT_SERVING"


async def start_server(router: Router, host: str, port: int, security: ServerSecurity | None = None) -> GrpcServer:
    """Start serving on ``host:port`` (``port=0`` picks a free one; ``.port`` is the bound one)."""
    security = security or ServerSecurity()
    tls = security.tls_cert_chain is not None and security.tls_private_key is not None
    if security.auth_token and not tls and not is_loopback(host):
        raise ValueError(
            f"gRPC server on {host!r}: a token-protected server off loopback needs TLS, "
            "or the token crosses the network in the clear"
        )
    interceptors = [BearerTokenAuth(security.auth_token)] if security.auth_token else []
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    server.add_generic_rpc_handlers((_handlers(PDServeServicer(router), router.config.max_request_bytes),))
    health = grpc_health.aio.HealthServicer()
    for service in ("", SERVICE_NAME):
        await health.set(service, _SERVING)  # the router has just subscribed to every decode worker
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(server, (SERVICE_NAME, grpc_health.SERVICE_NAME))
    address = f"{host}:{port}"
    if tls:
        credentials = grpc.ssl_server_credentials([(security.tls_private_key, security.tls_cert_chain)])
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return GrpcServer(server, bound, health, router)
