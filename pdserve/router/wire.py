"""The gRPC edge: protobuf messages to and from pdserve's typed messages. Neither Ray nor torch in here.

The server and the client both convert here, so a field added to a message is added in one place.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import AdmissionEvent, RequestMetrics, StepStats, WorkerStats
from pdserve.proto import pdserve_pb2 as pb

MODE_NAMES = {pb.MODE_UNSPECIFIED: None, pb.COLOCATED: "colocated", pb.DISAGGREGATED: "disaggregated", pb.AUTO: "auto"}
MODE_ENUMS = {name: enum for enum, name in MODE_NAMES.items() if name}

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field."""
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    return sampling


def metrics_to_proto(metrics: RequestMetrics) -> pb.RequestMetadata:
    return pb.RequestMetadata(**{**metrics._asdict(), "mode": MODE_ENUMS.get(metrics.mode, pb.MODE_UNSPECIFIED)})


def metrics_from_proto(p: pb.RequestMetadata) -> RequestMetrics:
    fields = {name: getattr(p, name) for name in RequestMetrics._fields}
    return RequestMetrics(**{**fields, "mode": MODE_NAMES.get(p.mode) or ""})


def worker_stats_to_proto(stats: WorkerStats) -> pb.WorkerStats:
    steps = [pb.StepRecord(**step._asdict()) for step in stats.steps]
    admissions = [pb.AdmissionEvent(**event._asdict()) for event in stats.admissions]
    return pb.WorkerStats(**{**stats._asdict(), "steps": steps, "admissions": admissions})


def worker_stats_from_proto(p: pb.WorkerStats) -> WorkerStats:
    fields = {name: getattr(p, name) for name in WorkerStats._fields if name not in ("steps", "admissions")}
    steps = tuple(StepStats(**{name: getattr(s, name) for name in StepStats._fields}) for s in p.steps)
    admissions = tuple(AdmissionEvent(e.request_id, e.event, e.time) for e in p.admissions)
    return WorkerStats(**fields, steps=steps, admissions=admissions)
