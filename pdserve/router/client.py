"""Python clients for a pdserve router: ``Client`` (blocking) and ``AsyncClient`` (asyncio). Both stream.

with Client("127.0.0.1:50051") as client:
    for chunk in client.generate("Hello", SamplingParams(max_tokens=32)):
        print(chunk.text, end="")
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any, NamedTuple

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import PromptLogprob, RequestMetrics, WorkerStats
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.wire import (
    GRPC_OPTIONS,
    MODE_ENUMS,
    logprobs_from_proto,
    metrics_from_proto,
    params_to_proto,
    worker_stats_from_proto,
)


class GenerateChunk(NamedTuple):
    token_ids: list[int]
    text: str
    finished: bool  # the choice's last chunk
    finish_reason: str | None
    metadata: RequestMetrics | None  # on the choice's last chunk
    choice: int = 0  # the choice it belongs to (a request with n > 1): GenerateResponse.index
    logprobs: list[PromptLogprob] | None = None  # per token, when asked (SamplingParams.logprobs); rank 0
    prompt_logprobs: list[PromptLogprob] | None = None  # on the choice's first chunk, when asked


def _request(
    prompt: str | list[int],
    params: SamplingParams | None,
    mode: str | None,
    request_id: str | None,
    stream_interval: int = 0,
    apply_chat_template: bool = False,
    stop: Sequence[str] = (),
    n: int = 1,
) -> pb.GenerateRequest:
    if isinstance(stop, str):
        stop = [stop]
    sampling = params_to_proto(params or SamplingParams(), stop)
    if mode is not None and mode not in MODE_ENUMS:
        raise ValueError(f"mode must be one of {', '.join(MODE_ENUMS)}, got {mode!r}")
    if stream_interval < 0:
        raise ValueError(f"stream_interval must be >= 0 (0: the deployment's), got {stream_interval!r}")
    req = pb.GenerateRequest(
        request_id=request_id or "",
        sampling=sampling,
        mode=MODE_ENUMS[mode] if mode else pb.MODE_UNSPECIFIED,
        stream_interval=stream_interval,
        apply_chat_template=apply_chat_template,
        n=n,
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _chunk(resp: pb.GenerateResponse, params: SamplingParams | None) -> GenerateChunk:
    metrics = metrics_from_proto(resp.metadata) if resp.HasField("metadata") else None
    logprobs = logprobs_from_proto(resp.logprobs) if params is not None and params.logprobs is not None else None
    prompt_logprobs = logprobs_from_proto(resp.prompt_logprobs) if resp.prompt_logprobs else None
    return GenerateChunk(
        list(resp.token_ids),
        resp.text,
        resp.finished,
        resp.finish_reason or None,
        metrics,
        resp.index,
        logprobs,
        prompt_logprobs,
    )


def _stats(resp: pb.StatsResponse) -> list[WorkerStats]:
    return [worker_stats_from_proto(w) for w in resp.workers]


def _channel(api: Any, target: str, root_certificates: bytes | None) -> Any:
    """A channel from ``grpc`` or ``grpc.aio``: TLS when root certificates are given, else plaintext."""
    if root_certificates is None:
        return api.insecure_channel(target, options=GRPC_OPTIONS)
    return api.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=GRPC_OPTIONS)


CLIENT_ID_KEY = "x-pdserve-client-id"  # gRPC metadata: who sends a request (only they may abort it)


def _metadata(auth_token: str | None, client_id: str) -> tuple[tuple[str, str], ...]:
    bearer = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
    return (*bearer, (CLIENT_ID_KEY, client_id))


class Client:
    """A blocking client. ``root_certificates`` (PEM) switches to TLS; ``auth_token`` is sent as a bearer token.

    ``client_id`` names this client to the router (a random id by default): ``abort`` stops only requests sent
    under the same id; share it between clients that should stop each other's requests.
    """

    def __init__(
        self,
        target: str,
        timeout_s: float = 600.0,
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        client_id: str | None = None,
    ) -> None:
        self.client_id = client_id or uuid.uuid4().hex
        self._channel = _channel(grpc, target, root_certificates)
        self._md = _metadata(auth_token, self.client_id)
        self._stub = pb_grpc.PDServeStub(self._channel)
        self.timeout_s = timeout_s

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        mode: str | None = None,
        request_id: str | None = None,
        stream_interval: int = 0,
        apply_chat_template: bool = False,
        stop: Sequence[str] = (),
        n: int = 1,
    ) -> Iterator[GenerateChunk]:
        """Stream chunks; raises ``grpc.RpcError`` (with the server's status and message) on failure.

        Closing the iterator early cancels the request on the server. ``stream_interval``: tokens per
        chunk after the first (0: the deployment's). ``apply_chat_template``: the text prompt is the
        user's turn of a conversation, which the router renders with its model's chat template (as is
        when the model ships none). ``stop``: the text ends before the first of these strings (the choice then
        finishes with reason "stop"). ``n``: completions of the prompt, their chunks interleaved, each naming
        its choice (``choice``) and each choice ending with a chunk that has ``finished``.
        """
        call = self._stub.Generate(
            _request(prompt, params, mode, request_id, stream_interval, apply_chat_template, stop, n),
            timeout=self.timeout_s,
            metadata=self._md,
        )
        try:
            for resp in call:
                yield _chunk(resp, params)
        finally:
            call.cancel()

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30, metadata=self._md).found

    def health(self) -> pb.HealthResponse:
        return self._stub.Health(pb.HealthRequest(), timeout=30, metadata=self._md)

    def stats(self, steps_since: float | None = None) -> list[WorkerStats]:
        req = pb.StatsRequest(include_steps=steps_since is not None, steps_since=steps_since or 0.0)
        return _stats(self._stub.Stats(req, timeout=30, metadata=self._md))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio client; the same options as ``Client``."""

    def __init__(
        self,
        target: str,
        timeout_s: float = 600.0,
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        client_id: str | None = None,
    ) -> None:
        self.client_id = client_id or uuid.uuid4().hex
        self._channel = _channel(grpc.aio, target, root_certificates)
        self._md = _metadata(auth_token, self.client_id)
        self._stub = pb_grpc.PDServeStub(self._channel)
        self.timeout_s = timeout_s

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        mode: str | None = None,
        request_id: str | None = None,
        stream_interval: int = 0,
        apply_chat_template: bool = False,
        stop: Sequence[str] = (),
        n: int = 1,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """``Client.generate``, for asyncio."""
        call = self._stub.Generate(
            _request(prompt, params, mode, request_id, stream_interval, apply_chat_template, stop, n),
            timeout=self.timeout_s,
            metadata=self._md,
        )
        try:
            async for resp in call:
                yield _chunk(resp, params)
        finally:
            call.cancel()  # no-op when the stream completed; tells the server when we stop early

    async def abort(self, request_id: str) -> bool:
        return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30, metadata=self._md)).found

    async def health(self) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=30, metadata=self._md)

    async def stats(self, steps_since: float | None = None) -> list[WorkerStats]:
        req = pb.StatsRequest(include_steps=steps_since is not None, steps_since=steps_since or 0.0)
        return _stats(await self._stub.Stats(req, timeout=30, metadata=self._md))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
