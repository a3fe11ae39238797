"""The gRPC front door (``grpc.aio``): proto messages in and out, the Router does the work."""

from __future__ import annotations

import logging

import grpc
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.router import GenerateInput, RequestError, Router
from pdserve.router.wire import GRPC_OPTIONS, MODE_ENUMS, MODE_NAMES, params_from_proto

log = logging.getLogger(__name__)


def metadata_to_proto(meta: dict) -> pb.RequestMetadata:
    return pb.RequestMetadata(
        request_id=meta.get("request_id", ""),
        mode=MODE_ENUMS.get(meta.get("mode", ""), pb.MODE_UNSPECIFIED),
        prefill_worker=meta.get("prefill_worker", ""),
        decode_worker=meta.get("decode_worker", ""),
        queue_s=meta.get("queue_s", 0.0),
        prefill_s=meta.get("prefill_s", 0.0),
        kv_transfer_s=meta.get("kv_transfer_s", 0.0),
        kv_transfer_bytes=meta.get("kv_transfer_bytes", 0),
        ttft_s=meta.get("ttft_s", 0.0),
        e2e_s=meta.get("e2e_s", 0.0),
        num_prompt_tokens=meta.get("num_prompt_tokens", 0),
        num_output_tokens=meta.get("num_output_tokens", 0),
        num_cached_tokens=meta.get("num_cached_tokens", 0),
        second_token_time=meta.get("second_token_time", 0.0),
    )


class PDServeServicer(pb_grpc.PDServeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            params = params_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{e}")
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: give text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        if request.mode not in MODE_NAMES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown value {request.mode}")
        req = GenerateInput(request.request_id or None, prompt, params, MODE_NAMES[request.mode])
        try:
            async for event in self.router.generate(req):
                yield pb.GenerateResponse(
                    token_ids=event.token_ids,
                    text=event.text,
                    finished=event.finished,
                    finish_reason=event.finish_reason or "",
                    metadata=metadata_to_proto(event.metadata) if event.metadata else None,
                )
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        return pb.AbortResponse(found=await self.router.abort(request.request_id))

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
        workers = []
        for s in await self.router.stats(since):
            workers.append(
                pb.WorkerStats(
                    worker_id=s.worker_id,
                    role=s.role,
                    blocks_total=s.blocks_total,
                    blocks_free=s.blocks_free,
                    blocks_cached=s.blocks_cached,
                    blocks_used=s.blocks_used,
                    num_running=s.num_running,
                    num_waiting=s.num_waiting,
                    num_remote_pending=s.num_remote_pending,
                    tokens_in_flight=s.tokens_in_flight,
                    num_steps=s.num_steps,
                    kv_bytes_moved=s.kv_bytes_moved,
                    node=s.node,
                    device=s.device,
                    steps=[
                        pb.StepRecord(
                            started=st.started,
                            duration_s=st.duration_s,
                            num_prefill_tokens=st.num_prefill_tokens,
                            num_decode_tokens=st.num_decode_tokens,
                            num_seqs=st.num_seqs,
                            num_context_tokens=st.num_context_tokens,
                        )
                        for st in s.steps
                    ],
                )
            )
        return pb.StatsResponse(workers=workers, num_active_requests=len(self.router.active))


async def start_server(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (``port=0`` picks a free one)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_PDServeServicer_to_server(PDServeServicer(router), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound
